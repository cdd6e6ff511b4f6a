"""Per-client state that survives rounds: what a defense must remember (residuals, caches), a dict of tensors.

Two homes, one interface (``ClientState``: ``load(round_)``, ``store(round_, tensors)``):

- ``RecordState``: Flower's ``Context.state`` of the node (one ``ArrayRecord``), as a SuperNode keeps it.
- ``FileState`` (``fedguard.store.client_state``): one file per client under the run folder, as the simulation
  keeps it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from flwr.app import ArrayRecord, RecordDict

DEFENSE_STATE_KEY = "defense"


class ClientState(Protocol):
    """Where one client's defense state lives between its rounds."""

    def load(self, round_: int) -> dict[str, torch.Tensor]:
        """The state as it was after the client's last round before ``round_`` (empty before its first)."""
        ...

    def store(self, round_: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep ``tensors`` as the state after ``round_``."""
        ...


def load_defense_state(state: RecordDict, key: str = DEFENSE_STATE_KEY) -> dict[str, torch.Tensor]:
    """The tensors saved in ``state[key]`` (empty on a client's first round)."""
    if key not in state:
        return {}
    record = state[key]
    if not isinstance(record, ArrayRecord):
        raise TypeError(f"Context.state[{key!r}] is a {type(record).__name__}, expected ArrayRecord")
    return dict(record.to_torch_state_dict())


def store_defense_state(state: RecordDict, tensors: dict[str, torch.Tensor], key: str = DEFENSE_STATE_KEY) -> None:
    """Save ``tensors`` into ``state[key]`` (removes the record when empty)."""
    if not tensors:
        if key in state:
            del state[key]
        return
    state[key] = ArrayRecord({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


class RecordState:
    """The state in a node's ``Context.state`` under ``key`` (one ``ArrayRecord``): one version, the latest (rounds
    are not kept)."""

    def __init__(self, record: RecordDict, key: str = DEFENSE_STATE_KEY) -> None:
        self.record = record
        self.key = key

    def load(self, round_: int) -> dict[str, torch.Tensor]:
        return load_defense_state(self.record, self.key)

    def store(self, round_: int, tensors: dict[str, torch.Tensor]) -> None:
        store_defense_state(self.record, tensors, self.key)
