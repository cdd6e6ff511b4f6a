"""Label inference from the last layer's gradient, on real gradients of the project's models."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from attackers.labels import infer_labels, last_layer_signal
from fedguard.data import DataSpec
from fedguard.models import build_model
from fedguard.models.convnet import ConvNetParams
from fedguard.training import compute_gradients

CLASSES = 10
MODELS = {
    "lenet": (DataSpec(1, 28, 28, CLASSES), None),
    "mlp": (DataSpec(1, 28, 28, CLASSES), None),
    "convnet": (DataSpec(3, 32, 32, CLASSES), ConvNetParams(width=4)),
}


def gradients(model: nn.Module, spec: DataSpec, labels: list[int], seed: int) -> list[torch.Tensor]:
    """The batch gradient of ``model`` on random images in [0, 1] with ``labels``."""
    x = torch.rand(len(labels), *spec.shape, generator=torch.Generator().manual_seed(seed))
    grads, _ = compute_gradients(model, x, torch.tensor(labels))
    return grads


def no_bias_model(spec: DataSpec) -> nn.Module:
    """A small MLP whose last linear layer has no bias: the signal is the weight gradient's row sums."""
    return nn.Sequential(nn.Flatten(), nn.Linear(spec.channels * spec.height * spec.width, 32), nn.ReLU(),
                         nn.Linear(32, spec.num_classes, bias=False))


def multiset_hits(truth: list[int], guess: list[int]) -> int:
    """How many labels of ``guess`` match one of ``truth`` (multiset intersection)."""
    return sum((Counter(truth) & Counter(guess)).values())


@pytest.mark.parametrize("name", list(MODELS))
def test_a_single_label_is_recovered_for_every_class(name: str) -> None:
    spec, params = MODELS[name]
    torch.manual_seed(0)
    model = build_model(name, spec, params)
    assert model(torch.rand(1, *spec.shape)).shape == (1, CLASSES)
    for label in range(CLASSES):
        grads = gradients(model, spec, [label], seed=label)
        guess = infer_labels(grads, CLASSES, 1)
        assert guess.dtype == torch.long and guess.shape == (1,)
        assert guess.tolist() == [label], f"{name}: label {label} read as {guess.tolist()}"


def test_a_single_label_is_recovered_from_a_last_layer_without_bias() -> None:
    spec = DataSpec(1, 8, 8, 6)
    torch.manual_seed(0)
    model = no_bias_model(spec)
    for label in range(spec.num_classes):
        grads = gradients(model, spec, [label], seed=label)
        assert grads[-1].shape == (spec.num_classes, 32)  # no bias: the weight gradient is last
        signal = last_layer_signal(grads, spec.num_classes)
        torch.testing.assert_close(signal, grads[-1].sum(1))
        assert (signal < 0).nonzero().flatten().tolist() == [label]
        assert infer_labels(grads, spec.num_classes, 1).tolist() == [label]


def test_the_signal_is_the_last_bias_gradient() -> None:
    spec, params = MODELS["mlp"]
    torch.manual_seed(0)
    grads = gradients(build_model("mlp", spec, params), spec, [3, 3, 7], seed=0)
    assert grads[-1].shape == (CLASSES,)
    torch.testing.assert_close(last_layer_signal(grads, CLASSES), grads[-1])
    # the bias gradient of mean cross-entropy sums to zero, and is -count / B + mean probability per class
    assert float(grads[-1].sum()) == pytest.approx(0.0, abs=1e-6)


def test_a_batch_with_repeated_labels_is_counted_on_an_untrained_mlp() -> None:
    spec, params = MODELS["mlp"]
    hits, total, exact = 0, 0, 0
    for trial in range(20):
        generator = torch.Generator().manual_seed(100 + trial)
        torch.manual_seed(trial)
        model = build_model("mlp", spec, params)
        distinct = torch.randperm(CLASSES, generator=generator)[:5].tolist()
        repeats = torch.randint(0, 5, (3,), generator=generator).tolist()
        labels = distinct + [distinct[i] for i in repeats]  # 8 labels, 5 classes, some 2-4 times
        guess = infer_labels(gradients(model, spec, labels, seed=trial), CLASSES, 8)
        assert guess.dtype == torch.long and guess.shape == (8,)
        assert guess.tolist() == sorted(guess.tolist())
        assert set(guess.tolist()) == set(labels), f"trial {trial}: {sorted(labels)} read as {guess.tolist()}"
        hits += multiset_hits(labels, guess.tolist())
        total += len(labels)
        exact += sorted(labels) == guess.tolist()
    # measured: 160 of 160 labels, 20 of 20 batches exact
    assert hits / total >= 0.95
    assert exact >= 17


@pytest.mark.parametrize("name", list(MODELS))
def test_batches_of_distinct_labels_on_each_model(name: str) -> None:
    spec, params = MODELS[name]
    torch.manual_seed(1)
    model = build_model(name, spec, params)
    labels = [0, 2, 5, 9]
    guess = infer_labels(gradients(model, spec, labels, seed=3), CLASSES, len(labels))
    assert guess.tolist() == labels


@settings(max_examples=200, deadline=None)
@given(
    signal=st.lists(st.floats(-1.0, 1.0, allow_nan=False, width=32), min_size=2, max_size=12),
    batch_size=st.integers(1, 40),
)
def test_the_output_always_has_batch_size_labels_in_range(signal: list[float], batch_size: int) -> None:
    classes = len(signal)
    grads = [torch.randn(classes, 5), torch.tensor(signal)]
    guess = infer_labels(grads, classes, batch_size)
    assert guess.dtype == torch.long and guess.shape == (batch_size,)
    assert all(0 <= c < classes for c in guess.tolist())
    assert guess.tolist() == sorted(guess.tolist())
    negative = {c for c, s in enumerate(signal) if s < 0}
    if negative:  # only classes with a negative signal are ever named
        assert set(guess.tolist()) <= negative
    else:  # none negative: the batch is given the class of the lowest signal
        assert all(signal[c] == min(signal) for c in guess.tolist())


def test_a_gradient_list_without_a_layer_of_num_classes_rows_is_rejected() -> None:
    grads = [torch.zeros(16, 8), torch.zeros(16), torch.zeros(7, 16), torch.zeros(7)]
    with pytest.raises(ValueError, match=r"no last-layer gradient with 10 rows among shapes \[\(16, 8\), \(16,\)"):
        last_layer_signal(grads, 10)
    with pytest.raises(ValueError, match="10 rows"):
        infer_labels(grads, 10, 4)
    with pytest.raises(ValueError, match="10 rows"):
        infer_labels([torch.zeros(10, 3, 5, 5)], 10, 1)  # a conv kernel with 10 filters is no last layer
