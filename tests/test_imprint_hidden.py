"""The hidden imprint (``attackers.imprint_hidden``): what it sends, that ``structure`` and ``drift`` pass it where
they flag the plain imprint, and that its read-out still recovers the inputs alone in their bins.

Models are MLPs (256 + 256 units) on mnist-5k after a few SGD steps; uploads are FedSGD gradients of a client's
batch of 8 test digits on the model the server sent.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from attackers.base import build_attack
from attackers.imprint import ImprintParams, bin_edges, build_imprint
from attackers.imprint_hidden import HiddenImprintParams, build_hidden_imprint
from attackers.manipulation import Manipulation
from fedguard.data import load_dataset
from fedguard.detect import Received, build_detector
from fedguard.detect.drift import DriftDetector, DriftParams
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import get_arrays, loss_fn, set_arrays
from tests.helpers import card_of
from tests.test_detect import trained
from tests.test_malicious_attacks import paired_psnr, upload

DATA = load_dataset("mnist-5k")
PARAMS = HiddenImprintParams(bins=32, edges="normal", mean=0.13, std=0.04)
HIDDEN = build_hidden_imprint(PARAMS)
PLAIN = build_imprint(ImprintParams(bins=64, edges="normal", mean=0.13, std=0.04))
BATCH = np.arange(8)  # test digits 0-7
EXACT_DB = 40.0  # dB: an image recovered exactly


def honest(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return trained(build_model("mlp", DATA.spec, MLPParams()), steps=5, seed=seed)


def sent_model(model: nn.Module, manipulation: Manipulation) -> tuple[nn.Module, ModelCard, list[np.ndarray]]:
    """(a copy of ``model`` loaded with what ``manipulation`` sends, its card, the arrays sent)."""
    card = card_of(model, "mlp", DATA.spec)
    sent = manipulation(get_arrays(model), card, np.random.default_rng(0))
    copy = build_model("mlp", DATA.spec, MLPParams())
    set_arrays(copy, sent)
    return copy, card, sent


def received(model: nn.Module) -> Received:
    x, y = DATA.test.batch(np.arange(100, 132))
    return Received(model, x, y, loss_fn)


def test_only_values_change_in_the_chosen_rows_and_columns() -> None:
    model = honest()
    before = get_arrays(model)
    _, _, sent = sent_model(model, HIDDEN)
    assert [(a.shape, a.dtype) for a in sent] == [(a.shape, a.dtype) for a in before]
    changed = [i for i, (a, b) in enumerate(zip(before, sent)) if not np.array_equal(a, b)]
    assert changed == [0, 1, 2]  # first weight and bias, the next weight
    rows = np.flatnonzero((before[0] != sent[0]).any(1))
    assert len(rows) == 32 and rows.tolist() != list(range(32))  # drawn units, not the first ones
    columns = np.flatnonzero((before[2] != sent[2]).any(0))
    assert set(columns) <= set(rows) and len(columns) >= 31  # the first bin's column is the others' direction
    np.testing.assert_allclose(np.linalg.norm(sent[0][rows], axis=1), np.linalg.norm(before[0][rows], axis=1), 1e-5)


def test_structure_and_drift_pass_it_and_flag_the_plain_imprint() -> None:
    model = honest()
    structure = build_detector("structure")
    drift = DriftDetector(DriftParams(references=1))  # against the honest model alone
    state: dict[str, torch.Tensor] = {}
    drift.remember(received(model), state)
    hidden, plain = sent_model(model, HIDDEN)[0], sent_model(model, PLAIN)[0]
    hidden_structure, plain_structure = structure(received(hidden), {}), structure(received(plain), {})
    hidden_drift, plain_drift = drift(received(hidden), state), drift(received(plain), state)
    print("hidden", hidden_structure.scores, hidden_drift.scores, "plain", plain_structure.scores, plain_drift.scores)
    assert plain_structure.flagged and plain_drift.flagged
    assert not hidden_structure.flagged and not hidden_drift.flagged
    assert hidden_structure.scores["repeated-rows"] == 1 and hidden_structure.scores["equal-columns"] == 1
    assert hidden_drift.scores["drift"] < 0.4  # measured 0.25; the plain imprint 0.97
    assert not build_detector("dsnr")(received(hidden), {}).flagged


def alone_in_bins(count: int) -> list[int]:
    """The first ``count`` test digits whose mean pixels fall in distinct bins of ``PARAMS``."""
    means = DATA.test.batch(np.arange(200))[0].flatten(1).double().mean(1).numpy()
    bins = np.searchsorted(bin_edges(PARAMS.imprint()), means, side="right") - 1
    first = {int(b): i for i, b in reversed(list(enumerate(bins)))}
    return sorted(first.values())[:count]


def test_read_out_recovers_the_inputs_alone_in_their_bins() -> None:
    model, card, sent = sent_model(honest(), HIDDEN)
    x, y = DATA.test.batch(np.array(alone_in_bins(8)))
    obs: Observation = upload(model, card, sent, x, y, "imprint-hidden")
    recon = build_attack("imprint-hidden").reconstruct_many([obs], 0)[0]
    got = paired_psnr(recon.images, x)
    print("imprint-hidden stats", recon.stats, "psnr", got)
    assert recon.stats["bins"] == 32 and recon.stats["recovered"] == 8
    assert (got > EXACT_DB).all(), got


def test_the_read_out_refuses_a_model_without_hidden_bins() -> None:
    model = honest()
    card = card_of(model, "mlp", DATA.spec)
    x, y = DATA.test.batch(BATCH)
    obs = upload(model, card, get_arrays(model), x, y, "imprint-hidden")
    with pytest.raises(ValueError, match="no bin units"):
        build_attack("imprint-hidden").reconstruct_many([obs], 0)


def test_bad_parameters_name_the_value() -> None:
    with pytest.raises(ValueError, match="bins must be >= 1"):
        HiddenImprintParams(bins=0)
    with pytest.raises(ValueError, match="exceeds the 256 units"):
        sent_model(honest(), build_hidden_imprint(HiddenImprintParams(bins=300)))
