"""Coordinate encoding of mostly-zero arrays, for sending pruned uploads as plain numpy arrays.

An array becomes three arrays: the flat (row-major) positions of its nonzero entries as int32 (k,), strictly
increasing; their values (k,) in the array's dtype; and its shape as int64 (ndim,). An entry counts as nonzero
when any bit of it is set, so -0.0 and NaN are kept and ``decode(*encode(a))`` equals ``a`` bit for bit. A
list of arrays (a Flower NumPyClient upload) is sent as the concatenation of these triples
(``encode_arrays``) and restored with ``decode_arrays``. Size on the wire: 4 bytes per index plus the values
plus 8 bytes per dimension, against ``a.nbytes`` dense; for float32 that pays off below half the entries
nonzero (DGP's default 20 % sent gives 0.4 of the dense bytes).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

INDEX = np.dtype(np.int32)
SHAPE = np.dtype(np.int64)
PARTS = 3  # arrays per encoded array: indices, values, shape
ENCODING_KEY = "encoding"  # fit metric that marks an upload sent as ``encode_arrays``
SPARSE = "sparse"  # its value for such an upload


class ByteCounts(NamedTuple):
    """Bytes of a list of arrays encoded (indices + values + shapes) and dense (``nbytes``)."""

    encoded: int
    dense: int


def encode(array: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices int32 (k,), values (k,), shape int64 (ndim,)) of the nonzero entries of ``array``."""
    array = np.asarray(array)
    if array.size > np.iinfo(INDEX).max:
        raise ValueError(f"an array of {array.size} entries has positions beyond int32")
    if array.dtype.kind not in "biufc" or array.dtype.itemsize not in (1, 2, 4, 8):
        raise ValueError(f"cannot encode dtype {array.dtype}: numbers of 1, 2, 4 or 8 bytes only")
    flat = np.ascontiguousarray(array).reshape(-1)
    indices = np.flatnonzero(flat.view(f"u{flat.dtype.itemsize}")).astype(INDEX)
    return indices, flat[indices], np.asarray(array.shape, dtype=SHAPE)


def decode(indices: np.ndarray, values: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """The dense array of ``shape`` with ``values`` at the flat positions ``indices`` and zeros elsewhere.

    Raises ``ValueError`` for inputs ``encode`` cannot produce: positions that are not integers, not strictly
    increasing or out of range; counts that differ; a shape that is not a vector of non-negative integers.
    """
    indices, values, shape = np.asarray(indices), np.asarray(values), np.asarray(shape)
    if shape.ndim != 1 or shape.dtype.kind not in "iu" or (shape < 0).any():
        raise ValueError(f"shape must be a vector of non-negative integers, got {shape!r}")
    if indices.ndim != 1 or values.ndim != 1 or len(indices) != len(values):
        raise ValueError(f"expected as many indices as values, got {indices.shape} and {values.shape}")
    if indices.dtype.kind not in "iu":
        raise ValueError(f"indices must be integers, got {indices.dtype}")
    size = int(np.prod(shape, dtype=np.int64))
    if len(indices) and (indices[0] < 0 or indices[-1] >= size or (np.diff(indices) <= 0).any()):
        raise ValueError(f"indices must be strictly increasing positions in [0, {size})")
    dense = np.zeros(size, dtype=values.dtype)
    dense[indices] = values
    return dense.reshape(tuple(int(n) for n in shape))


def encode_arrays(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The triples of ``encode`` for each array, concatenated: 3 * len(arrays) arrays."""
    return [part for array in arrays for part in encode(array)]


def decode_arrays(encoded: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Inverse of ``encode_arrays``."""
    if len(encoded) % PARTS:
        raise ValueError(f"an encoded upload holds {PARTS} arrays per tensor, got {len(encoded)} arrays")
    return [decode(*encoded[i : i + PARTS]) for i in range(0, len(encoded), PARTS)]


def nonzero_count(array: np.ndarray) -> int:
    """Entries of ``array`` with any bit set (those ``encode`` keeps)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return int(np.count_nonzero(flat.view(f"u{flat.dtype.itemsize}")))


def byte_counts(arrays: Sequence[np.ndarray]) -> ByteCounts:
    """Bytes of ``arrays`` encoded by ``encode_arrays`` and dense, counted without encoding."""
    arrays = [np.asarray(a) for a in arrays]
    encoded = sum(nonzero_count(a) * (INDEX.itemsize + a.dtype.itemsize) + a.ndim * SHAPE.itemsize for a in arrays)
    return ByteCounts(encoded, sum(a.nbytes for a in arrays))
