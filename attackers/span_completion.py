"""The first Linear layer's update rebuilt from a defended upload: a rank-N matrix consistent with what the known
defense sent, for ``fc-span-adaptive`` to read.

Before the defense, ``G = [dW | db]`` (units, d + 1) has rank N, the client's example count (``attackers.fc_span``).
The defense's declared record (``fedguard.defenses.revealed``) gives the set of matrices consistent with the upload,
tensor by tensor (the weight block and the bias column apart):

- ``SentBand`` (top-k pruning): the sent entries exactly, every other within ``[-lo, lo]``, ``lo`` the smallest
  sent magnitude; with ``drops_top`` (DGP) an unsent entry is instead at most ``lo`` or at least ``hi``, the
  largest sent magnitude, in magnitude (its sign unknown);
- ``QuantizedLevels``: every entry within one level step of the sent one (the step from the sent tensor's minimum
  and maximum, which are sent exactly).

``complete`` alternates the two projections, as low-rank matrix completion does: onto the matrices of rank N (the
truncated SVD) and onto the consistent set, from the upload as sent. That leaves a pruned update about 4 % off, and
fc-span's reading needs an exact span. ``factor_sent`` then fits ``D X^T`` to the sent entries alone, which are
exact: every pixel's column and every unit's row that holds enough of them is determined, to about 1e-4 on the
realistic setting's pruned uploads. Any other record has no such set to project on (DP noise: the rank-N
truncation fc-span already takes is the estimate), and ``consistent_set`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedguard.defenses.quantization import level_grid
from fedguard.defenses.revealed import QuantizedLevels, Revealed, SentBand


@dataclass(frozen=True)
class Bounds:
    """Per entry of a (units, d + 1) matrix: ``fixed`` (bool) entries equal ``sent``; the others lie within
    ``[low, high]`` (float64), or, where ``gap`` is True, outside ``(-high, high)`` as well as within
    ``[-low, low]`` (DGP's two unsent bands; ``high`` is then the top band's edge)."""

    sent: torch.Tensor
    fixed: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    gap: torch.Tensor

    def project(self, matrix: torch.Tensor) -> torch.Tensor:
        """The nearest matrix of the set, entry by entry."""
        inside = torch.minimum(torch.maximum(matrix, self.low), self.high)
        magnitude, sign = matrix.abs(), torch.where(matrix >= 0, 1.0, -1.0).to(matrix.dtype)
        small, large = torch.minimum(magnitude, self.low.abs()), torch.maximum(magnitude, self.high)
        banded = sign * torch.where(magnitude - small <= large - magnitude, small, large)
        return torch.where(self.fixed, self.sent, torch.where(self.gap, banded, inside))


def tensor_bounds(sent: torch.Tensor, revealed: SentBand | QuantizedLevels) -> Bounds:
    """The consistent set of one tensor as sent (any shape), float64."""
    sent = sent.double()
    if isinstance(revealed, QuantizedLevels):
        _, _, step = level_grid(sent.reshape(1, -1), revealed.bits)
        width = step.reshape(()).expand_as(sent)
        none = torch.zeros_like(sent, dtype=torch.bool)
        return Bounds(sent, none, sent - width, sent + width, none)
    fixed = sent != 0
    magnitudes = sent[fixed].abs()
    low = magnitudes.min() if len(magnitudes) else torch.tensor(0.0, dtype=torch.float64)
    high = magnitudes.max() if len(magnitudes) else low
    gap = ~fixed if revealed.drops_top else torch.zeros_like(fixed)
    return Bounds(sent, fixed, (-low).expand_as(sent), (high if revealed.drops_top else low).expand_as(sent), gap)


def consistent_set(revealed: Revealed, weight: torch.Tensor, bias: torch.Tensor) -> Bounds | None:
    """The set of ``[dW | db]`` (units, d + 1) consistent with the sent ``weight`` (units, d) and ``bias``
    (units,) under ``revealed``; None for a record that bounds no entry (module docstring)."""
    if not isinstance(revealed, SentBand | QuantizedLevels):
        return None
    parts = (tensor_bounds(weight, revealed), tensor_bounds(bias[:, None], revealed))
    fields = ("sent", "fixed", "low", "high", "gap")
    return Bounds(*(torch.cat([getattr(part, name) for part in parts], 1) for name in fields))


def low_rank(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """The nearest matrix of rank ``rank`` to ``matrix`` (Eckart-Young: the truncated SVD), as its projection onto
    the top ``rank`` eigenvectors of the smaller Gram matrix (a third of the SVD's time on a 256 x 785 update)."""
    wide = matrix.shape[0] <= matrix.shape[1]
    gram = matrix @ matrix.T if wide else matrix.T @ matrix
    top = torch.linalg.eigh(gram).eigenvectors[:, -rank:]
    return top @ (top.T @ matrix) if wide else (matrix @ top) @ top.T


def masked_least_squares(factor: torch.Tensor, values: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """(C, N): for each column c of ``values`` (R, C), the ``x`` minimizing the squared misfit of ``factor @ x``
    (``factor`` (R, N)) on the rows where ``known`` (R, C) is True (a ridge of 1e-12 times the factor's scale
    keeps a column with fewer than N of them solvable)."""
    weights = known.to(factor.dtype)
    normal = torch.einsum("rc,rk,rl->ckl", weights, factor, factor)
    ridge = 1e-12 * factor.pow(2).sum() * torch.eye(factor.shape[1], dtype=factor.dtype)
    right = torch.einsum("rc,rk,rc->ck", weights, factor, values)
    return torch.linalg.solve(normal + ridge, right)


def factor_sent(bounds: Bounds, rank: int, start: torch.Tensor, sweeps: int, spare: int) -> tuple[torch.Tensor, int]:
    """(the first layer's update as ``D X^T`` fitted to the sent entries of ``bounds`` alone, the pixels read):
    ``sweeps`` of alternating least squares from the rank-``rank`` ``start``, each solving every column's ``X_j``
    on its sent entries, then every row's ``D_i``. A sent entry is an exact entry of the rank-N update, so a column
    with at least ``rank + spare`` sent entries (in rows that hold as many) is determined by them; the others are
    read as 0 (dark pixels mostly: no entry of theirs was large enough to be sent), but for the last (bias)
    column, which keeps ``start``'s value (the reading needs it), and so are the rows with too few."""
    left, singular, right = torch.linalg.svd(start, full_matrices=False)
    units, columns = left[:, :rank] * singular[:rank], right[:rank].T.clone()
    sent, known = bounds.sent, bounds.fixed
    solvable_columns, solvable_rows = (known.sum(0) >= rank)[:, None], (known.sum(1) >= rank)[:, None]
    for _ in range(sweeps):  # a column or row with fewer sent entries than the rank keeps its start
        columns = torch.where(solvable_columns, masked_least_squares(units, sent, known), columns)
        units = torch.where(solvable_rows, masked_least_squares(columns, sent.T, known.T), units)
    read_rows = known.sum(1) >= rank + spare
    read_columns = (known & read_rows[:, None]).sum(0) >= rank + spare
    fitted = units @ columns.T
    fitted[:, -1] = torch.where(read_columns[-1], fitted[:, -1], start[:, -1])
    fitted[:, :-1] *= read_columns[:-1]
    return fitted * read_rows[:, None], int(read_columns[:-1].sum())


def complete(bounds: Bounds, rank: int, iterations: int) -> torch.Tensor:
    """A rank-``rank`` matrix near the set ``bounds``: ``iterations`` alternating projections from the upload as
    sent, the last onto rank ``rank``."""
    current = bounds.sent
    for _ in range(iterations):
        current = bounds.project(low_rank(current, rank))
    return low_rank(current, rank)
