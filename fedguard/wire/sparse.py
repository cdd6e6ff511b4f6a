"""Coordinate encoding of mostly-zero arrays, for sending pruned uploads as plain numpy arrays.

An array becomes three arrays: where its nonzero entries are, their values (k,) in the array's dtype, and its
shape as int64 (ndim,). Where is written in the shorter of two forms: the flat (row-major) positions as int32
(k,), strictly increasing (4 bytes per nonzero entry), or a bit mask of all entries packed 8 to a byte
(``numpy.packbits``, uint8 (ceil(n/8),), padding bits zero; 1/8 byte per entry), which is shorter once more
than 1 entry in 32 is nonzero. The dtype tells the forms apart. An entry counts as nonzero when any bit of it
is set, so -0.0 and NaN are kept and ``decode(*encode(a))`` equals ``a`` bit for bit. A list of arrays (a
Flower NumPyClient upload) is sent as the concatenation of these triples (``encode_arrays``) and restored with
``decode_arrays``. For float32, DGP's default 20 % sent travels at 0.23 of the dense bytes (mask) where
positions would take 0.4.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

INDEX = np.dtype(np.int32)
MASK = np.dtype(np.uint8)
SHAPE = np.dtype(np.int64)
PARTS = 3  # arrays per encoded array: where (positions or mask), values, shape
ENCODING_KEY = "encoding"  # fit metric that marks an upload sent as ``encode_arrays``
SPARSE = "sparse"  # its value for such an upload


class ByteCounts(NamedTuple):
    """Bytes of a list of arrays encoded (indices + values + shapes) and dense (``nbytes``)."""

    encoded: int
    dense: int


def mask_bytes(size: int) -> int:
    """Bytes of the bit mask of an array of ``size`` entries."""
    return -(-size // 8)


def position_bytes(size: int, count: int) -> int:
    """Bytes ``encode`` spends on where ``count`` nonzero entries of ``size`` are: the shorter form."""
    return min(count * INDEX.itemsize, mask_bytes(size))


def encode(array: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(where, values (k,), shape int64 (ndim,)) of the nonzero entries of ``array``: where is int32 positions
    (k,) or a packed uint8 bit mask (ceil(n/8),), whichever is shorter (positions on a tie)."""
    array = np.asarray(array)
    if array.size > np.iinfo(INDEX).max:
        raise ValueError(f"an array of {array.size} entries has positions beyond int32")
    if array.dtype.kind not in "biufc" or array.dtype.itemsize not in (1, 2, 4, 8):
        raise ValueError(f"cannot encode dtype {array.dtype}: numbers of 1, 2, 4 or 8 bytes only")
    flat = np.ascontiguousarray(array).reshape(-1)
    nonzero = flat.view(f"u{flat.dtype.itemsize}") != 0
    count = int(np.count_nonzero(nonzero))
    shape = np.asarray(array.shape, dtype=SHAPE)
    if mask_bytes(flat.size) < count * INDEX.itemsize:
        return np.packbits(nonzero), flat[nonzero], shape
    indices = np.flatnonzero(nonzero).astype(INDEX)
    return indices, flat[indices], shape


def decode(where: np.ndarray, values: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """The dense array of ``shape`` with ``values`` at the entries ``where`` names (int32 flat positions or a
    packed uint8 bit mask) and zeros elsewhere.

    Raises ``ValueError`` for inputs ``encode`` cannot produce: positions that are not integers, not strictly
    increasing or out of range; a mask of the wrong length or with padding bits set; counts that differ; a
    shape that is not a vector of non-negative integers.
    """
    where, values, shape = np.asarray(where), np.asarray(values), np.asarray(shape)
    if shape.ndim != 1 or shape.dtype.kind not in "iu" or (shape < 0).any():
        raise ValueError(f"shape must be a vector of non-negative integers, got {shape!r}")
    if where.ndim != 1 or values.ndim != 1:
        raise ValueError(f"expected positions or a mask and values as vectors, got {where.shape} and {values.shape}")
    size = int(np.prod(shape, dtype=np.int64))
    dense = np.zeros(size, dtype=values.dtype)
    if where.dtype == MASK:
        flags = mask_flags(where, size)
        marked = int(np.count_nonzero(flags))
        if marked != len(values):
            raise ValueError(
                f"expected as many values as marked entries, got {len(values)} values for {marked} entries"
            )
        dense[flags] = values
    else:
        check_positions(where, size, len(values))
        dense[where] = values
    return dense.reshape(tuple(int(n) for n in shape))


def mask_flags(mask: np.ndarray, size: int) -> np.ndarray:
    """The (size,) booleans of a packed ``mask`` of an array of ``size`` entries; ``ValueError`` for a mask of
    another length or with padding bits set."""
    if len(mask) != mask_bytes(size):
        raise ValueError(f"a mask of {size} entries takes {mask_bytes(size)} bytes, got {len(mask)}")
    bits = np.unpackbits(mask)
    if bits[size:].any():
        raise ValueError(f"the mask's padding bits past entry {size} must be zero")
    return bits[:size].astype(bool)


def check_positions(indices: np.ndarray, size: int, count: int) -> None:
    """``indices`` are ``count`` integer positions strictly increasing in [0, size); ``ValueError`` otherwise."""
    if len(indices) != count:
        raise ValueError(f"expected as many indices as values, got {len(indices)} and {count}")
    if indices.dtype.kind not in "iu":
        raise ValueError(f"indices must be integers or a uint8 mask, got {indices.dtype}")
    if len(indices) and (indices[0] < 0 or indices[-1] >= size or (np.diff(indices) <= 0).any()):
        raise ValueError(f"indices must be strictly increasing positions in [0, {size})")


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
    encoded = sum(
        position_bytes(a.size, count) + count * a.dtype.itemsize + a.ndim * SHAPE.itemsize
        for a, count in ((a, nonzero_count(a)) for a in arrays)
    )
    return ByteCounts(encoded, sum(a.nbytes for a in arrays))
