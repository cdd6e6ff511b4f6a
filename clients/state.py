"""Per-client state that survives rounds, kept in Flower's ``Context.state``.

Clients are rebuilt every round; what a defense must remember (residuals,
caches) is a dict of tensors stored as one ``ArrayRecord``.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, RecordDict

DEFENSE_STATE_KEY = "defense"


def load_defense_state(state: RecordDict) -> dict[str, torch.Tensor]:
    """The defense's tensors saved in ``state`` (empty on a client's first round)."""
    if DEFENSE_STATE_KEY not in state:
        return {}
    record = state[DEFENSE_STATE_KEY]
    if not isinstance(record, ArrayRecord):
        raise TypeError(f"Context.state[{DEFENSE_STATE_KEY!r}] is a {type(record).__name__}, expected ArrayRecord")
    return dict(record.to_torch_state_dict())


def store_defense_state(state: RecordDict, tensors: dict[str, torch.Tensor]) -> None:
    """Save the defense's tensors into ``state`` (removes the record when empty)."""
    if not tensors:
        if DEFENSE_STATE_KEY in state:
            del state[DEFENSE_STATE_KEY]
        return
    state[DEFENSE_STATE_KEY] = ArrayRecord({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
