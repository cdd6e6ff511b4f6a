"""The shared loss/gradient function, local SGD, and the model <-> array wire format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedguard.data import DataSpec
from fedguard.models import build_model
from fedguard.models.convnet import ConvNetParams
from fedguard.training import (
    compute_gradients,
    evaluate,
    get_arrays,
    local_sgd,
    merge_by_mask,
    parameters,
    set_arrays,
    split_by_mask,
    trainable_mask,
)

SPEC = DataSpec(3, 16, 16, 4)


def test_gradients_match_a_manual_backward() -> None:
    torch.manual_seed(0)
    model = build_model("lenet", SPEC)
    x, y = torch.rand(5, 3, 16, 16), torch.tensor([0, 1, 2, 3, 0])
    grads, loss = compute_gradients(model, x, y)
    model.zero_grad()
    reference = torch.nn.functional.cross_entropy(model(x), y)
    reference.backward()
    assert loss == pytest.approx(float(reference.detach()))
    for g, p in zip(grads, parameters(model)):
        assert torch.allclose(g, p.grad)


def test_arrays_round_trip_with_buffers() -> None:
    model = build_model("convnet", SPEC, ConvNetParams(width=4))
    compute_gradients(model, torch.rand(4, 3, 16, 16), torch.tensor([0, 1, 2, 3]))  # moves running stats
    arrays = get_arrays(model)
    fresh = build_model("convnet", SPEC, ConvNetParams(width=4))
    set_arrays(fresh, arrays)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, get_arrays(fresh)))
    mask = trainable_mask(model)
    assert mask.count(False) == 3 * 8  # running_mean, running_var, num_batches_tracked per BatchNorm
    params, buffers = split_by_mask(arrays, mask)
    assert all(np.array_equal(a, b) for a, b in zip(merge_by_mask(params, buffers, mask), arrays))


def test_set_arrays_rejects_wrong_shapes() -> None:
    model = build_model("mlp", SPEC)
    arrays = get_arrays(model)
    with pytest.raises(ValueError, match="expected"):
        set_arrays(model, arrays[:-1])
    arrays[0] = np.zeros((2, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="shape"):
        set_arrays(model, arrays)


def test_local_sgd_lowers_the_loss() -> None:
    torch.manual_seed(0)
    model = build_model("mlp", SPEC)
    x, y = torch.rand(64, 3, 16, 16), torch.arange(64) % 4
    before, _ = evaluate(model, x, y)
    steps, _ = local_sgd(model, x, y, lr=0.5, epochs=5, batch_size=16, generator=np.random.default_rng(0))
    after, _ = evaluate(model, x, y)
    assert steps == 20 and after < before
