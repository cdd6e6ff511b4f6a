"""Per-node index of the messages waiting in Flower's in-memory simulation state.

Flower 1.41's simulation engine asks its ``InMemoryLinkState`` for each node's next message every 0.1 s, and
each ask walks every stored message (checking each one's expiry and federation): N nodes times M stored
messages per tick, which at 1,000 clients kept one core of the simulation process busy and held the state's
lock against the replies. ``index_message_delivery`` makes the ask walk only that node's own messages: the
messages a node is given, their order, their validity checks and their ``delivered_at`` stamp are unchanged.

It patches the one Flower version the project pins (``FLOWER_VERSION``) and nothing otherwise; ``server.
message-index = false`` keeps Flower's own lookup (``fedguard.runtime.server_app``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flwr.supercore.date import now

FLOWER_VERSION = "1.41.0"
_PENDING = "_fedguard_pending"  # attribute of a state: node id -> ids of its messages, oldest first
_installed: dict[str, Callable[..., Any]] = {}
_install_lock = threading.Lock()


def index_message_delivery() -> bool:
    """Install the index on ``InMemoryLinkState`` (once per process). True when it is installed; False when
    the installed Flower is not ``FLOWER_VERSION``, whose state this was written against."""
    import flwr
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    if flwr.__version__ != FLOWER_VERSION:
        return False
    with _install_lock:
        if not _installed:
            _installed["store_message_ins"] = InMemoryLinkState.store_message_ins
            _installed["get_message_ins"] = InMemoryLinkState.get_message_ins
            # The index is installed by patching Flower's class (its methods take ``state`` for ``self``).
            InMemoryLinkState.store_message_ins = _store_message_ins  # type: ignore[method-assign,assignment]
            InMemoryLinkState.get_message_ins = _get_message_ins  # type: ignore[method-assign,assignment]
    return True


def remove_message_index() -> None:
    """Put Flower's own lookup back (``server.message-index = false``)."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    with _install_lock:
        for name, method in _installed.items():
            setattr(InMemoryLinkState, name, method)
        _installed.clear()


def _pending(state: Any) -> dict[int, list[str]]:
    """The index of ``state``; messages stored before it existed are added on first use (oldest first)."""
    pending = getattr(state, _PENDING, None)
    if pending is None:
        pending = {}
        for message_id, message in state.message_ins_store.items():
            pending.setdefault(message.metadata.dst_node_id, []).append(message_id)
        setattr(state, _PENDING, pending)
    return pending


def _store_message_ins(state: Any, message: Any) -> str | None:
    """Flower's ``store_message_ins``, then the stored message added to its node's list."""
    with state.lock:
        pending = _pending(state)
        known = message.metadata.message_id in state.message_ins_store
        message_id = _installed["store_message_ins"](state, message)
        if message_id is not None and not known:
            pending.setdefault(message.metadata.dst_node_id, []).append(message_id)
    return message_id


def _get_message_ins(state: Any, node_id: int, limit: int | None, *, run_id: int | None = None) -> list[Any]:
    """Up to ``limit`` undelivered messages of ``node_id`` (of run ``run_id`` when given), oldest first, marked
    delivered: Flower's ``get_message_ins`` over the node's own messages instead of every stored one."""
    if limit is not None and limit < 1:
        raise AssertionError("`limit` must be >= 1")
    found: list[Any] = []
    with state.lock:
        pending = _pending(state)
        ids = pending.get(node_id)
        if not ids:  # most asks, 10 times a second for every node
            return found
        kept: list[str] = []
        for position, message_id in enumerate(ids):
            if limit and len(found) == limit:
                kept += ids[position:]
                break
            state._check_stored_messages({message_id})
            message = state.message_ins_store.get(message_id)
            if message is None or message.metadata.delivered_at != "":
                continue  # expired, deleted or delivered: it leaves the index
            if run_id is None or message.metadata.run_id == run_id:
                found.append(message)
            else:
                kept.append(message_id)
        if kept:
            pending[node_id] = kept
        else:
            pending.pop(node_id, None)
        if found:
            delivered_at = now().isoformat()
            for message in found:
                message.metadata.delivered_at = delivered_at
    return found
