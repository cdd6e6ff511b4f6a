"""Models: shapes for every dataset geometry, sizes that match the papers, BatchNorm where expected."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fedguard.data import DataSpec
from fedguard.models import MODELS, build_model
from fedguard.models.convnet import ConvNetParams
from fedguard.models.mlp import MLPParams

SPECS = [DataSpec(3, 32, 32, 10), DataSpec(1, 28, 28, 10), DataSpec(1, 25, 25, 2), DataSpec(3, 16, 16, 100)]


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MODELS.names())
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "x".join(map(str, s.shape)))
def test_logits_shape_and_gradients(name: str, spec: DataSpec) -> None:
    params = ConvNetParams(width=4) if name == "convnet" else None
    model = build_model(name, spec, params)
    x = torch.rand(2, *spec.shape)
    logits = model(x)
    assert logits.shape == (2, spec.num_classes)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_paper_sizes() -> None:
    cifar = DataSpec(3, 32, 32, 10)
    assert 2.8e6 < count(build_model("convnet", cifar)) < 3.0e6
    assert 11.1e6 < count(build_model("resnet18", cifar)) < 11.2e6
    lenet = build_model("lenet", cifar)
    assert count(lenet) == 3 * (12 * 5 * 5) + 12 * 12 * 5 * 5 * 2 + 36 + 768 * 10 + 10


def test_lenet_is_sigmoid_with_dlg_initialization() -> None:
    model = build_model("lenet", DataSpec(3, 32, 32, 10))
    assert any(isinstance(m, nn.Sigmoid) for m in model.modules())
    assert not any(isinstance(m, (nn.ReLU, nn.BatchNorm2d)) for m in model.modules())
    for p in model.parameters():
        assert float(p.min()) >= -0.5 and float(p.max()) <= 0.5
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert abs(float(weights.std()) - 12**-0.5) < 0.01  # U(-0.5, 0.5): standard deviation 1 / sqrt(12)


def test_batchnorm_models_have_running_statistics() -> None:
    for name in ("convnet", "resnet18"):
        model = build_model(name, DataSpec(3, 32, 32, 10), ConvNetParams(width=4) if name == "convnet" else None)
        assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
        assert any("running_mean" in key for key in model.state_dict())


def test_mlp_params() -> None:
    model = build_model("mlp", DataSpec(1, 8, 8, 10), MLPParams(hidden=5, depth=3))
    assert [m.out_features for m in model.modules() if isinstance(m, nn.Linear)] == [5, 5, 5, 10]
    with pytest.raises(ValueError, match="hidden"):
        MLPParams(hidden=0)


def test_convnet_rejects_tiny_images() -> None:
    with pytest.raises(ValueError, match="9x9"):
        build_model("convnet", DataSpec(1, 8, 8, 10))


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="lenet"):
        build_model("vgg", SPECS[0])
