"""The sparse codec: bit-exact round trips, the encoded layout, byte counts, Flower transport, bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays

from fedguard.defenses import LocalStep, build_defense
from fedguard.defenses.dgp import DGPParams
from fedguard.wire.sparse import ByteCounts, byte_counts, decode, decode_arrays, encode, encode_arrays


def mostly_zero(shape: tuple[int, ...], fraction: float, seed: int, dtype=np.float32) -> np.ndarray:
    """Random values at a ``fraction`` of the entries, zeros elsewhere."""
    rng = np.random.default_rng(seed)
    values = rng.normal(size=shape).astype(dtype)
    return np.where(rng.random(shape) < fraction, values, 0).astype(dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


SPECIAL = np.array([[0.0, -0.0, 1.5], [np.nan, 0.0, -np.inf]], dtype=np.float32)
ARRAYS = [
    mostly_zero((64, 300), 0.2, 0),
    mostly_zero((10,), 0.2, 1),
    mostly_zero((3, 4, 5, 6), 0.5, 2, np.float64),
    mostly_zero((50,), 0.1, 3, np.float16),
    np.array([0, 7, 0, -2], dtype=np.int64),
    np.array([True, False, True]),
    SPECIAL,
    np.float32(2.5).reshape(()),
    np.zeros((4, 0), dtype=np.float32),
    np.zeros((3, 3), dtype=np.float32),
    np.ones(5, dtype=np.float32),
]


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_round_trip_is_bit_exact(array: np.ndarray) -> None:
    assert same_bits(decode(*encode(array)), array)


def test_the_encoded_layout() -> None:
    mask, values, shape = encode(SPECIAL)  # 4 of 6 entries: a 1-byte mask beats 16 bytes of positions
    assert mask.dtype == np.uint8 and shape.dtype == np.int64 and values.dtype == np.float32
    assert mask.tolist() == [0b01110100]  # -0.0 and NaN are kept, +0.0 is not; padding bits zero
    assert shape.tolist() == [2, 3]
    assert np.signbit(values[0]) and values[1] == 1.5 and np.isnan(values[2]) and values[3] == -np.inf
    mask, values, shape = encode(np.float32(2.5).reshape(()))
    assert mask.tolist() == [0b10000000] and values.tolist() == [2.5] and shape.shape == (0,)


def test_positions_are_sent_where_they_are_shorter_than_the_mask() -> None:
    sparse = np.zeros(1000, np.float32)
    sparse[[3, 500, 999]] = [1.0, -2.0, 3.0]  # 12 bytes of positions against a 125-byte mask
    indices, values, _ = encode(sparse)
    assert indices.dtype == np.int32 and indices.tolist() == [3, 500, 999] and values.tolist() == [1.0, -2.0, 3.0]
    tie = np.zeros(256, np.float32)
    tie[:8] = 1.0  # 32 bytes either way: positions
    assert encode(tie)[0].dtype == np.int32
    tie[8] = 1.0  # 36 bytes of positions against 32 of mask
    assert encode(tie)[0].dtype == np.uint8


def test_a_non_contiguous_view_is_encoded_in_row_major_order() -> None:
    base = mostly_zero((6, 8), 0.3, 4)
    view = base.T[::2]
    assert same_bits(decode(*encode(view)), np.ascontiguousarray(view))


def test_byte_counts_of_a_float32_array() -> None:
    array = mostly_zero((100, 50), 0.2, 5)
    nonzero = int((array != 0).sum())
    assert byte_counts([array]) == ByteCounts(encoded=5000 // 8 + 4 * nonzero + 8 * 2, dense=4 * 5000)
    assert sum(part.nbytes for part in encode(array)) == byte_counts([array]).encoded
    assert byte_counts([np.zeros(10, np.float32), np.ones(3, np.float64)]) == ByteCounts(8 + 1 + 3 * 8 + 8, 40 + 24)


def test_a_dgp_upload_travels_through_flower_parameters_at_under_a_quarter_of_the_dense_size() -> None:
    g = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(256, 3072, generator=g),
        torch.randn(256, generator=g),
        torch.randn(10, 256, generator=g),
        torch.randn(10, generator=g),
    ]
    step = LocalStep(
        torch.nn.Identity(), torch.zeros(1), torch.zeros(1), grads, torch.nn.functional.cross_entropy, torch.Generator()
    )
    upload = [t.numpy() for t in build_defense("dgp", DGPParams())(step, {})]
    encoded = encode_arrays(upload)
    assert len(encoded) == 3 * len(upload)
    received = parameters_to_ndarrays(ndarrays_to_parameters(encoded))
    assert all(same_bits(a, b) for a, b in zip(decode_arrays(received), upload))
    counts = byte_counts(upload)
    print("DGP upload bytes encoded", counts.encoded, "dense", counts.dense)
    assert counts.encoded / counts.dense == pytest.approx(0.2 + 1 / 32, abs=1e-3)  # 20 % of the values, 1 bit each


def test_an_empty_list_encodes_to_nothing() -> None:
    assert encode_arrays([]) == [] and decode_arrays([]) == [] and byte_counts([]) == ByteCounts(0, 0)


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ((np.array([0, 1], np.int32), np.array([1.0], np.float32), np.array([3])), "as many indices as values"),
        ((np.array([0, 3], np.int32), np.ones(2, np.float32), np.array([3])), "strictly increasing positions in"),
        ((np.array([-1], np.int32), np.ones(1, np.float32), np.array([3])), r"\[0, 3\)"),
        ((np.array([2, 1], np.int32), np.ones(2, np.float32), np.array([3])), "strictly increasing"),
        ((np.array([1, 1], np.int32), np.ones(2, np.float32), np.array([3])), "strictly increasing"),
        ((np.array([0.0]), np.ones(1, np.float32), np.array([3])), "indices must be integers"),
        ((np.array([0], np.int32), np.ones(1, np.float32), np.array([-3])), "non-negative integers"),
        ((np.array([0], np.int32), np.ones(1, np.float32), np.array([[3]])), "non-negative integers"),
        ((np.array([0b1010_0000, 0], np.uint8), np.ones(2, np.float32), np.array([3])), "takes 1 bytes, got 2"),
        ((np.array([0b1010_0001], np.uint8), np.ones(2, np.float32), np.array([3])), "padding bits past entry 3"),
        ((np.array([0b1010_0000], np.uint8), np.ones(3, np.float32), np.array([3])), "3 values for 2 entries"),
    ],
)
def test_malformed_encodings_are_rejected(parts: tuple[np.ndarray, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode(*parts)


def test_a_truncated_upload_and_unencodable_dtypes_are_rejected() -> None:
    with pytest.raises(ValueError, match="3 arrays per tensor, got 4"):
        decode_arrays(encode_arrays([np.ones(2, np.float32)]) + [np.ones(1)])
    with pytest.raises(ValueError, match="cannot encode dtype object"):
        encode(np.array([1, None], dtype=object))
    with pytest.raises(ValueError, match="cannot encode dtype complex128"):
        encode(np.ones(2, dtype=np.complex128))
