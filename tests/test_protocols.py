"""The protocols as components (``fedguard.protocols``): each one's local step and upload, the server's checks
that read them, a protocol of one's own run by configuration, and no protocol name compared anywhere else."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedguard.data import Split, load_dataset
from fedguard.models import build_model
from fedguard.protocols import PROTOCOLS, Schedule, protocol
from fedguard.report.run_status import read_status
from fedguard.training import compute_gradients, get_arrays, local_sgd, parameters
from tests.helpers import config
from tests.test_strategies import run_in_process

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE = Schedule(lr=0.1, batch_size=4, local_epochs=2)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mlp", load_dataset("digits").spec, config().model.params)


@pytest.fixture
def setting() -> tuple[torch.nn.Module, Split]:
    return mlp(), load_dataset("digits").train


def test_the_registry_names_the_protocols_and_refuses_an_unknown_one() -> None:
    assert PROTOCOLS.names() == ["fedavg", "fedsgd"]
    with pytest.raises(ValueError, match="unknown protocol 'fedsgdd'; choose one of: fedavg, fedsgd"):
        protocol("fedsgdd")


def test_fedsgd_uploads_one_batch_gradient_and_leaves_the_model(setting) -> None:
    model, local = setting
    before = [a.copy() for a in get_arrays(model)]
    update = protocol("fedsgd").local_step(model, local, SCHEDULE, np.random.default_rng(0))
    assert len(update.y) == SCHEDULE.batch_size and update.declared.record() == {"batch-size": 4, "loss": update.loss}
    expected, _ = compute_gradients(model, update.x, update.y)
    assert all(torch.equal(d, e) for d, e in zip(update.direction, expected))
    uploaded = protocol("fedsgd").upload(model, update.direction)
    assert all(np.array_equal(u, d.numpy()) for u, d in zip(uploaded, update.direction))
    assert all(np.array_equal(b, a) for b, a in zip(before, get_arrays(model)))


def test_fedavg_uploads_the_local_model_its_epochs_reach(setting) -> None:
    model, local = setting
    update = protocol("fedavg").local_step(model, local, SCHEDULE, np.random.default_rng(0))
    trained = mlp()
    steps, _ = local_sgd(trained, update.x, update.y, 0.1, 2, 4, np.random.default_rng(0))
    assert update.declared.record()["local-steps"] == steps == protocol("fedavg").local_steps(len(local), 4, 2)[0]
    uploaded = protocol("fedavg").upload(model, update.direction)
    for sent, reached, replayed in zip(uploaded, parameters(update.buffers_from), parameters(trained)):
        np.testing.assert_allclose(sent, reached.detach().numpy(), rtol=0, atol=1e-6)
        assert torch.equal(reached, replayed)


def test_a_protocol_of_ones_own_runs_from_the_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PROTOCOLS, "_entries", dict(PROTOCOLS._entries))  # the plugin registers into a copy
    monkeypatch.delitem(sys.modules, "extensions.local_steps", raising=False)
    folder = run_in_process(
        tmp_path,
        "server.plugins=extensions.local_steps",
        "train.protocol=fedsgd-steps",
        "train.local-epochs=3",
        "train.lr=0.1",
        "train.rounds=4",
    )
    rows = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
    assert read_status(folder)["status"] == "completed"
    assert all(not row.get("refused") for row in rows), rows
    loss = [row["loss"] for row in rows]
    assert loss[-1] < loss[0] - 0.01, loss


def test_no_module_outside_the_protocols_compares_a_protocol_to_a_string() -> None:
    comparison = re.compile(r"protocol\w*(\.name)?\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(\[{]")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("fedguard", "attackers", "clients", "strategies")
        for path in sorted((ROOT / package).rglob("*.py"))
        if "protocols" not in path.relative_to(ROOT).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if comparison.search(line)
    ]
    assert not found, found
