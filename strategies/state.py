"""What a strategy carries from round to round, as named arrays: checkpointed after every round, restored when a
run resumes (``fedguard run --resume``).

Every strategy in the chain of wrappers (``.strategy``) is read. One of your own keeps its state by defining
``state_arrays() -> dict[str, numpy.ndarray]`` and ``load_state_arrays(arrays)``; Flower's built-in strategies
are read through the attributes that hold their state (``STATE_ATTRIBUTES``: FedAdam's, FedYogi's and
FedAdagrad's moments, FedAvgM's momentum, adaptive clipping's norm). The model a strategy keeps of the current
round (``current_arrays``) is set again by the round's ``configure_train`` and needs no saving.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

STATE_ATTRIBUTES = ("m_t", "v_t", "momentum_vector", "clipping_norm")


@runtime_checkable
class StatefulStrategy(Protocol):
    """A strategy that declares its own state between rounds, as named arrays."""

    def state_arrays(self) -> dict[str, np.ndarray]: ...

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None: ...


_SEP = "/"


def chain(strategy: Any) -> Iterator[Any]:
    """``strategy`` and every strategy it wraps, outermost first."""
    seen: set[int] = set()
    while strategy is not None and id(strategy) not in seen:
        seen.add(id(strategy))
        yield strategy
        strategy = getattr(strategy, "strategy", None)


def _flatten(prefix: str, value: Any, out: dict[str, np.ndarray]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}{_SEP}d{_SEP}{key}", item, out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _flatten(f"{prefix}{_SEP}l{_SEP}{index}", item, out)
    else:
        out[prefix] = np.asarray(value)


def strategy_state(strategy: Any) -> dict[str, np.ndarray]:
    """The state of every strategy in the chain of ``strategy``, as named arrays."""
    state: dict[str, np.ndarray] = {}
    for depth, member in enumerate(chain(strategy)):
        if isinstance(member, StatefulStrategy):
            for name, array in member.state_arrays().items():
                state[f"{depth}{_SEP}own{_SEP}{name}"] = np.asarray(array)
            continue
        for attribute in STATE_ATTRIBUTES:
            value = getattr(member, attribute, None)
            if value is not None:
                _flatten(f"{depth}{_SEP}{attribute}", value, state)
    return state


def _set(target: dict[str, Any], path: list[str], array: np.ndarray) -> None:
    """Put ``array`` at ``path`` (``d/key`` or ``l/index`` steps) in the nested ``target``."""
    node: dict[Any, Any] = target
    for kind, key in zip(path[0::2], path[1::2]):
        node = node.setdefault((kind, key), {})
    node[None] = array


def _build(node: dict[Any, Any]) -> Any:
    """The dicts, lists and arrays ``_set`` described."""
    if None in node:
        array = node[None]
        return array.item() if array.ndim == 0 and array.dtype.kind == "f" else array
    kinds = {kind for kind, _ in node}
    if kinds == {"l"}:
        return [_build(node[("l", str(i))]) for i in range(len(node))]
    return {key: _build(child) for (_, key), child in node.items()}


def restore_strategy_state(strategy: Any, state: dict[str, np.ndarray]) -> None:
    """Put ``state`` (from ``strategy_state``) back into the chain of ``strategy``; ``ValueError`` when it names
    a strategy or an attribute the chain does not have."""
    members = list(chain(strategy))
    own: dict[int, dict[str, np.ndarray]] = {}
    nested: dict[tuple[int, str], dict[Any, Any]] = {}
    for name, array in state.items():
        depth_text, attribute, *path = name.split(_SEP)
        depth = int(depth_text)
        if depth >= len(members):
            raise ValueError(f"checkpointed strategy state {name!r}: the strategy has {len(members)} levels")
        if attribute == "own":
            own.setdefault(depth, {})[_SEP.join(path)] = array
        elif attribute in STATE_ATTRIBUTES and hasattr(members[depth], attribute):
            _set(nested.setdefault((depth, attribute), {}), path, array)
        else:
            raise ValueError(
                f"checkpointed strategy state {name!r}: {type(members[depth]).__name__} has no "
                f"attribute {attribute!r}; was the run resumed with another server.strategy?"
            )
    for depth, arrays in own.items():
        member = members[depth]
        if not isinstance(member, StatefulStrategy):
            raise ValueError(
                f"checkpointed strategy state for {type(member).__name__}, which has no "
                "state_arrays() and load_state_arrays(arrays)"
            )
        member.load_state_arrays(arrays)
    for (depth, attribute), tree in nested.items():
        setattr(members[depth], attribute, _build(tree))
