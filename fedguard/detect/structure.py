"""A structural check of the first two layers of a received model, for the values a malicious server writes.

The first layer is the model's first trainable weight ``W``, read as ``n`` rows (n, k) (a Linear layer's
(units, inputs), a convolution's (out channels, in channels * kernel)), with its bias ``b`` (n,) when the next
parameter is one. The next layer is the first later weight that takes those ``n`` units as input (its second
dimension is ``n``), read as ``n`` columns (n, m). Rows (columns) ``i`` and ``j`` are near-identical when
``||r_i - r_j|| <= tolerance * max(||r_i||, ||r_j||)`` (two zero rows are). Four scores:

- ``repeated-rows``: the most rows of ``W`` near-identical to one row (itself included; 1 for distinct rows).
  The imprint module (``attackers.imprint``) writes ``bins`` equal rows and zeroes the others.
- ``bias-ladder``: the longest strictly monotone run, in row order, of the biases of the largest group of
  near-identical non-zero rows (0 without a bias or such a group): the imprint's bin edges ``b_i = -gain e_i``.
- ``equal-columns``: the most columns of the next layer near-identical to one column: the imprint's
  ``V[:, i] = V[:, 0]``.
- ``trap-sign``: ``-sqrt(r) mean(l) / std(l)`` over the ``r`` rows with positive and negative entries (0 when
  fewer than ``TRAP_ROWS``: the t-statistic of a few rows has heavy tails), where
  ``l_i = log(P_i / N_i) - log(p_i / q_i)``: ``P_i`` the mean of row i's positive entries, ``N_i`` that of the
  magnitudes of its negative ones, ``p_i`` and ``q_i`` their counts. It is the t-statistic of a positive part
  shrunk while the signs stay balanced. Trap weights (``attackers.trap_weights``) scale every row's positive
  entries by ``s < 1`` and leave each sign half the entries: ``l_i`` is about ``log s`` in every row. An honest
  row at initialisation is symmetric about 0 (``l_i`` near 0, either sign); training on non-negative pixels
  shifts a row's entries, which moves the magnitude ratio and the count ratio alike (exactly so for PyTorch's
  uniform initialisation), so ``l_i`` stays near 0. The magnitude ratio alone, without the counts, reached
  t = 7 on honest MLPs after 20 SGD steps on mnist-5k, and -11 the other way.

The model is flagged when any score reaches its threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from fedguard.detect.base import Finding, Received, register_detector

TRAP_ROWS = 32  # fewest rows trap-sign reads: LeNet's 6 first-layer rows gave up to 4.1 at initialisation


@dataclass(frozen=True)
class StructureParams:
    """``tolerance``: relative distance (of the larger norm) within which two rows or columns count as one;
    ``rows``: flag at this many near-identical first-layer rows; ``ladder``: flag at a bias ladder this long;
    ``columns``: flag at this many near-identical next-layer columns; ``trap``: flag at this trap-sign
    t-statistic."""

    tolerance: float = 1e-6
    rows: int = 3
    ladder: int = 3
    columns: int = 3
    trap: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        for name in ("rows", "ladder", "columns"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")
        if not self.trap > 0:
            raise ValueError(f"trap must be > 0, got {self.trap}")


@dataclass(frozen=True)
class FirstLayers:
    """``rows`` (n, k) of the first weight, its ``bias`` (n,) or None, the next layer's ``columns`` (n, m) or
    None; float64."""

    rows: torch.Tensor
    bias: torch.Tensor | None
    columns: torch.Tensor | None


def first_layers(model: nn.Module) -> FirstLayers:
    """The first weight's rows and bias and the next layer's columns (module docstring); raises ``ValueError``
    for a model without a trainable weight."""
    params = [p.detach().to(torch.float64) for p in model.parameters() if p.requires_grad]
    first = next((i for i, p in enumerate(params) if p.dim() >= 2), None)
    if first is None:
        raise ValueError("the model has no trainable weight (2 or more dimensions) to check")
    rows = params[first].reshape(params[first].shape[0], -1)
    n = rows.shape[0]
    after = params[first + 1] if first + 1 < len(params) else None
    bias = after if after is not None and after.shape == (n,) else None
    nxt = next((p for p in params[first + 1 :] if p.dim() >= 2 and p.shape[1] == n), None)
    columns = None if nxt is None else nxt.transpose(0, 1).reshape(n, -1)
    return FirstLayers(rows, bias, columns)


def near_identical(vectors: torch.Tensor, tolerance: float) -> torch.Tensor:
    """(n, n) bool: entry (i, j) when vectors i and j (rows of (n, k)) are near-identical."""
    norms = vectors.norm(dim=1)
    return torch.cdist(vectors, vectors) <= tolerance * torch.maximum(norms[:, None], norms[None, :])


def largest_group(vectors: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Indices, ascending, of the most vectors (rows of (n, k)) near-identical to one of them."""
    close = near_identical(vectors, tolerance)
    return torch.nonzero(close[int(close.sum(1).argmax())]).flatten()


def longest_monotone_run(values: torch.Tensor) -> int:
    """The length of the longest run of consecutive entries of ``values`` (n,) that strictly increases or strictly
    decreases (1 for a single entry, 0 for none)."""
    if len(values) < 2:
        return len(values)
    steps = torch.sign(values[1:] - values[:-1]).tolist()
    best = run = 1
    for previous, step in zip([0.0, *steps[:-1]], steps):
        run = run + 1 if step != 0 and step == previous else (2 if step != 0 else 1)
        best = max(best, run)
    return best


def bias_ladder(layers: FirstLayers, tolerance: float) -> int:
    """The ``bias-ladder`` score: the longest monotone bias run of the largest group of near-identical non-zero
    rows."""
    nonzero = torch.nonzero(layers.rows.norm(dim=1) > 0).flatten()
    if layers.bias is None or len(nonzero) < 2:
        return 0
    group = nonzero[largest_group(layers.rows[nonzero], tolerance)]
    return longest_monotone_run(layers.bias[group]) if len(group) >= 2 else 0


def trap_sign(rows: torch.Tensor) -> float:
    """The ``trap-sign`` t-statistic of rows (n, k); 0 with fewer than ``TRAP_ROWS`` rows holding both signs or
    a zero spread."""
    positives, negatives = (rows > 0).sum(1), (rows < 0).sum(1)
    both = (positives > 0) & (negatives > 0)
    p, q = positives[both].to(rows.dtype), negatives[both].to(rows.dtype)
    magnitudes = (rows.clamp(min=0).sum(1)[both] / p) / ((-rows).clamp(min=0).sum(1)[both] / q)
    logs = torch.log(magnitudes) - torch.log(p / q)
    if len(logs) < TRAP_ROWS or float(logs.std()) == 0:
        return 0.0
    return -math.sqrt(len(logs)) * float(logs.mean()) / float(logs.std())


class StructureDetector:
    """Scores the first two layers of the received model for imprint and trap-weights values."""

    def __init__(self, params: StructureParams) -> None:
        self.params = params

    def __call__(self, received: Received, state: dict[str, torch.Tensor]) -> Finding:
        p = self.params
        layers = first_layers(received.model)
        scores = {
            "repeated-rows": float(len(largest_group(layers.rows, p.tolerance))),
            "bias-ladder": float(bias_ladder(layers, p.tolerance)),
            "equal-columns": 0.0 if layers.columns is None else float(len(largest_group(layers.columns, p.tolerance))),
            "trap-sign": trap_sign(layers.rows),
        }
        limits = {"repeated-rows": p.rows, "bias-ladder": p.ladder, "equal-columns": p.columns, "trap-sign": p.trap}
        return Finding(scores, any(scores[name] >= limit for name, limit in limits.items()))


@register_detector("structure", params=StructureParams)
def build_structure(params: StructureParams) -> StructureDetector:
    """Repeated first-layer rows, a bias ladder, equal next-layer columns, the trap-weights sign pattern."""
    return StructureDetector(params)
