"""Whether an upload is the raw update of its batch: what tells an attacker who knows CENSOR a raw fallback
(Algorithm 1's G* = G^0, which the upload does not mark) from an orthogonal candidate.

A Linear layer's weight gradient over n samples is ``sum_b delta_b a_b^T``: its rank is at most n, and a FedAvg
update's (a sum of such gradients over the local steps) at most the samples those steps processed. CENSOR's
candidate is a Gaussian draw with one direction removed, of full rank with probability 1. So in a 2-D weight
whose sides are both longer than n, the (n+1)-th singular value over the largest tells them apart: float32
rounding (about 1e-6) for the raw update, of order 0.1 for a candidate.
"""

from __future__ import annotations

import torch

from attackers.engine.problem import target_update
from fedguard.observation import Observation

RANK_TOLERANCE = 1e-3
"""A weight whose (n+1)-th singular value is below this share of its largest has rank at most n."""


def samples_mixed(obs: Observation) -> int | None:
    """How many samples the upload's weights mix: the batch of a FedSGD gradient; for a FedAvg upload the
    declared local steps times the batch size (None when the client declared neither steps nor epochs)."""
    declared = obs.declared
    batch = declared.batch(obs.num_examples)
    if obs.kind == "gradient":
        return batch
    if declared.local_steps is not None:
        return declared.local_steps * batch
    if declared.local_epochs is not None:
        return declared.local_epochs * obs.num_examples
    return None


def is_raw_update(obs: Observation, tolerance: float = RANK_TOLERANCE) -> bool | None:
    """True when every 2-D weight longer than the samples mixed on both sides has at most that rank (the raw
    update), False when one has more (not an update of this batch), None when no weight can tell."""
    bound = samples_mixed(obs)
    if bound is None:
        return None
    verdicts = []
    for tensor in target_update(obs, torch.device("cpu")):
        if tensor.dim() != 2 or min(tensor.shape) <= bound:
            continue
        singular = torch.linalg.svdvals(tensor.double())
        verdicts.append(bool(singular[0] == 0 or singular[bound] <= tolerance * singular[0]))
    return all(verdicts) if verdicts else None
