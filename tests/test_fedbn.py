"""FedBN (``train.fedbn``): the BatchNorm layers stay on the client, exactly.

What the server gets back at every BatchNorm entry is what it sent (weights and buffers, or a zero gradient);
every other entry is the upload the client makes from a model holding its own BatchNorm layers; those layers,
kept in the client's state, are what its own step left; a defense's noise never reaches them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from clients.local_batch_norm import KEY_PREFIX, batch_norm_names
from clients.state import load_defense_state, store_defense_state
from fedguard.config import ConfigError
from fedguard.data import load_dataset
from fedguard.data.federated import client_split
from fedguard.defenses import LocalStep
from fedguard.models import build_model
from fedguard.seeding import client_generators
from fedguard.training import compute_gradients, get_arrays, local_sgd, set_arrays
from tests.helpers import client_fit, config

BN = ("model.mlp.batch-norm=true", "model.mlp.depth=2")


def _model(cfg, arrays: list[np.ndarray]) -> torch.nn.Module:
    model = build_model("mlp", load_dataset("digits").spec, cfg.model.params)
    set_arrays(model, arrays)
    return model


def _start(cfg) -> list[np.ndarray]:
    torch.manual_seed(0)
    return get_arrays(build_model("mlp", load_dataset("digits").spec, cfg.model.params))


def _names(cfg) -> list[str]:
    return list(build_model("mlp", load_dataset("digits").spec, cfg.model.params).state_dict())


def _own_layers(names: list[str], bn: set[str], arrays: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """``arrays`` with every BatchNorm entry moved, as a client's own layers after some rounds would be."""
    return [
        (a + rng.uniform(0.1, 0.5, a.shape)).astype(a.dtype) if n in bn and a.dtype.kind == "f" else a
        for n, a in zip(names, arrays)
    ]


@pytest.mark.parametrize("protocol", ["fedsgd", "fedavg"])
def test_the_server_gets_back_what_it_sent_at_every_batch_norm_entry(protocol: str) -> None:
    cfg = config(*BN, f"train.protocol={protocol}", "train.fedbn=true", "train.lr=0.05")
    sent = _start(cfg)
    names = _names(cfg)
    bn = batch_norm_names(_model(cfg, sent))
    assert {n.rsplit(".", 1)[1] for n in bn} == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    state = RecordDict()
    client_fit(cfg, 1, sent, round_=1, state=state)
    upload, _, _ = client_fit(cfg, 1, sent, round_=2, state=state)
    for name, got, original in zip(names, upload, sent):
        if name in bn:
            gradient = protocol == "fedsgd" and not name.endswith(("running_mean", "running_var", "tracked"))
            np.testing.assert_array_equal(got, np.zeros_like(original) if gradient else original, err_msg=name)


def test_a_fedsgd_client_uploads_the_gradient_of_its_own_model_and_keeps_the_step_of_its_layers() -> None:
    cfg = config(*BN, "train.fedbn=true", "train.lr=0.05")
    sent, names = _start(cfg), _names(cfg)
    bn = batch_norm_names(_model(cfg, sent))
    own = _own_layers(names, bn, sent, np.random.default_rng(0))
    state = RecordDict()
    store_defense_state(state, {f"{KEY_PREFIX}{n}": torch.as_tensor(a) for n, a in zip(names, own) if n in bn})
    upload, _, _ = client_fit(cfg, 2, sent, round_=3, state=state)

    model = _model(cfg, own)  # the global layers, the client's BatchNorm
    rng, _ = client_generators(cfg.run.seed, 2, 3)
    local = client_split("digits", cfg.data.source_options(), "iid", cfg.partition.options(), 4, cfg.run.seed, 2)
    x, y = local.batch(rng.choice(len(local), size=8, replace=False))
    grads, _ = compute_gradients(model, x, y)  # a training-mode step: the buffers move too
    trainable = [n for n in names if n in dict(model.named_parameters())]
    by_name = dict(zip(trainable, grads))
    for name, got in zip(names, upload):
        if name in by_name and name not in bn:
            np.testing.assert_allclose(got, by_name[name].numpy(), rtol=1e-6, atol=1e-7, err_msg=name)
    kept = load_defense_state(state)
    after = dict(model.state_dict())
    for name, before in zip(names, own):
        if name not in bn:
            continue
        want = before - 0.05 * by_name[name].numpy() if name in by_name else after[name].numpy()
        np.testing.assert_allclose(kept[f"{KEY_PREFIX}{name}"].numpy(), want, rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_fedavg_client_trains_from_its_own_layers_and_keeps_what_training_left() -> None:
    cfg = config(*BN, "train.protocol=fedavg", "train.local-epochs=2", "train.fedbn=true", "train.lr=0.05")
    sent, names = _start(cfg), _names(cfg)
    state = RecordDict()
    client_fit(cfg, 3, sent, round_=1, state=state)
    first = load_defense_state(state)
    upload, _, _ = client_fit(cfg, 3, sent, round_=2, state=state)

    bn = batch_norm_names(_model(cfg, sent))
    own = [first[f"{KEY_PREFIX}{n}"].numpy() if n in bn else a for n, a in zip(names, sent)]
    model = _model(cfg, own)
    local = client_split("digits", cfg.data.source_options(), "iid", cfg.partition.options(), 4, cfg.run.seed, 3)
    rng, _ = client_generators(cfg.run.seed, 3, 2)
    x, y = local.batch()
    local_sgd(model, x, y, 0.05, 2, 8, rng)
    trained = get_arrays(model)
    kept = load_defense_state(state)
    for name, got, want in zip(names, upload, trained):
        if name in bn:
            np.testing.assert_allclose(kept[f"{KEY_PREFIX}{name}"].numpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_defense_never_puts_noise_on_the_layers_that_stay() -> None:
    cfg = config(*BN, "train.fedbn=true", "defense.name=dp", "defense.dp.noise-multiplier=5.0")
    sent, names = _start(cfg), _names(cfg)
    bn = batch_norm_names(_model(cfg, sent))
    upload, _, _ = client_fit(cfg, 0, sent, round_=1)
    noisy = [name for name, got, original in zip(names, upload, sent) if name not in bn and not np.all(got == 0)]
    assert noisy, "the other layers carry the defense's noise"
    for name, got in zip(names, upload):
        if name in bn and not name.endswith(("running_mean", "running_var", "tracked")):
            assert not np.any(got), name


def test_the_defense_is_given_the_other_layers_direction_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[torch.Tensor]] = []

    def recording(step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        seen.append([g.clone() for g in step.grads])
        return step.grads

    monkeypatch.setattr("clients.defended_client._defense", lambda name, params: recording)
    cfg = config(*BN, "train.fedbn=true")
    sent, names = _start(cfg), _names(cfg)
    model = _model(cfg, sent)
    bn = batch_norm_names(model)
    client_fit(cfg, 0, sent, round_=1)
    trainable = [n for n in names if n in dict(model.named_parameters())]
    assert [bool(torch.any(g != 0)) for g in seen[0]] == [n not in bn for n in trainable]


def test_fedbn_on_a_model_without_batch_norm_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train.fedbn = true: model.name = 'mlp'.* has no BatchNorm layer"):
        config("train.fedbn=true")


def test_an_attack_that_reads_the_uploaded_statistics_is_refused_under_fedbn() -> None:
    grant = ("threat.bn-statistics=true", "attack.name=gradinversion")
    config(*BN, *grant)
    with pytest.raises(ConfigError, match=r"attack 'gradinversion' reads each batch's BatchNorm statistics"):
        config(*BN, *grant, "train.fedbn=true")
