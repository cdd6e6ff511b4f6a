"""Client-side detection of a malicious server: each detector's maths on hand-built and manipulated models, the
reply a declining client sends, and a run in which clients refuse a manipulated round."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
import torch.nn as nn
from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from attackers.imprint import ImprintParams, build_imprint
from attackers.manipulation import Manipulation
from attackers.trap_weights import TrapWeightsParams, build_trap_weights
from clients.defended_client import ModelDeclined
from fedguard.config import ConfigError, load_config
from fedguard.data import load_dataset
from fedguard.detect import Finding, Received, Verdict, build_detector, detect
from fedguard.detect.base import weights
from fedguard.detect.drift import DriftDetector, DriftParams, relative_changes
from fedguard.detect.dsnr import dsnr
from fedguard.detect.structure import longest_monotone_run, trap_sign
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard
from fedguard.runtime.client_app import make_client_app
from fedguard.runtime.server_app import run_server
from fedguard.training import get_arrays, loss_fn, set_arrays, trainable_mask
from fedguard.wire.records import DETECT, REFUSED, array_record, declined_content, read_findings, refusal_reason
from strategies import RoundGuard
from strategies.upload_checks import UploadRules
from tests.helpers import Nodes, client_fit, config, reply
from tests.local_grid import LocalGrid

SPEC = load_dataset("mnist-5k").spec
Batch = tuple[torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module")
def batch() -> Batch:
    """32 training images of mnist-5k and their labels."""
    data = load_dataset("mnist-5k")
    return data.train.batch(np.random.default_rng(0).choice(len(data.train), 32, replace=False))


def mlp(seed: int, hidden: int = 256) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", SPEC, MLPParams(hidden=hidden))


def trained(model: nn.Module, steps: int, seed: int) -> nn.Module:
    """``model`` after ``steps`` SGD steps (lr 0.5) on batches of 64 mnist-5k images."""
    data, rng = load_dataset("mnist-5k"), np.random.default_rng(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        x, y = data.train.batch(rng.choice(len(data.train), 64, replace=False))
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    return model


def manipulated(model: nn.Module, manipulation: Manipulation, hidden: int = 256) -> nn.Module:
    """A copy of the MLP ``model`` (``hidden`` units) loaded with what ``manipulation`` sends in its place."""
    card = ModelCard("mlp", {}, SPEC, tuple(model.state_dict()), tuple(trainable_mask(model)))
    sent = build_model("mlp", SPEC, MLPParams(hidden=hidden))
    set_arrays(sent, manipulation(get_arrays(model), card, np.random.default_rng(0)))
    return sent


def received(model: nn.Module, batch: Batch) -> Received:
    return Received(model, batch[0], batch[1], loss_fn)


IMPRINT = build_imprint(ImprintParams(bins=16, edges="normal"))
TRAP = build_trap_weights(TrapWeightsParams())


def test_monotone_runs_and_trap_sign_on_hand_built_arrays() -> None:
    assert longest_monotone_run(torch.tensor([3.0, 1.0, 2.0, 5.0, 9.0, 9.0, 4.0])) == 4
    assert longest_monotone_run(torch.tensor([5.0, 4.0, 3.0])) == 3
    assert longest_monotone_run(torch.tensor([1.0, 1.0])) == 1
    symmetric = torch.tensor([[1.0, -1.0, 2.0, -2.0], [3.0, -3.0, 0.5, -0.5]]).repeat(16, 1)
    assert trap_sign(symmetric) == 0.0
    # per row l = log(mean positive / mean negative magnitude) - log(positive count / negative count)
    rows = torch.tensor([[0.5, -1.0, -1.0], [1.5, -2.0, 0.0]], dtype=torch.float64).repeat(16, 1)
    logs = torch.tensor([math.log(0.5) - math.log(1 / 2), math.log(0.75)], dtype=torch.float64).repeat(16)
    assert trap_sign(rows) == pytest.approx(-math.sqrt(32) * float(logs.mean() / logs.std()))
    assert trap_sign(rows[:31]) == 0.0, "too few rows to read"


def test_structure_flags_imprint_and_trap_weights_of_an_honest_model(batch: Batch) -> None:
    detector = build_detector("structure")
    for honest in (mlp(0), trained(mlp(1), 30, 1)):
        finding = detector(received(honest, batch), {})
        assert not finding.flagged, finding
        assert finding.scores["repeated-rows"] == 1 and finding.scores["equal-columns"] == 1
        imprint = detector(received(manipulated(honest, IMPRINT), batch), {})
        assert imprint.flagged
        # 16 bin rows and 240 zero rows; the bins' biases -gain * e_i descend; their next-layer columns are equal
        assert imprint.scores["repeated-rows"] == 240 and imprint.scores["bias-ladder"] == 16
        assert imprint.scores["equal-columns"] == 16
        trap = detector(received(manipulated(honest, TRAP), batch), {})
        assert trap.flagged and trap.scores["trap-sign"] > 8 and trap.scores["repeated-rows"] == 1


def test_structure_does_not_flag_honest_lenets(batch: Batch) -> None:
    detector = build_detector("structure")
    for seed in range(3):
        torch.manual_seed(seed)
        lenet = build_model("lenet", SPEC, None)
        assert not detector(received(lenet, batch), {}).flagged
        assert not detector(received(trained(lenet, 10, seed), batch), {}).flagged


def test_dsnr_is_the_largest_share_over_layers() -> None:
    norms = torch.tensor([[1.0, 4.0], [1.0, 1.0], [2.0, 1.0]], dtype=torch.float64)
    assert dsnr(norms) == pytest.approx(max(2 / 2, 4 / 2))
    assert dsnr(torch.tensor([[0.0], [3.0], [0.0]])) == math.inf  # one example alone has a gradient
    assert dsnr(torch.zeros(2, 1)) == 0.0
    with pytest.raises(ValueError, match="2 or more"):
        dsnr(torch.ones(1, 3))


def one_example_fishing(target: torch.Tensor) -> nn.Module:
    """An MLP whose single live first-layer unit fires for ``target`` alone: its row is the target image and
    its bias lets no other image of lower correlation through (a fishing model that singles one example out)."""
    model = mlp(0)
    first = cast(nn.Linear, model.get_submodule("1"))
    flat = target.flatten()
    with torch.no_grad():
        first.weight.zero_()
        first.bias.fill_(-1.0)
        first.weight[0] = flat
        first.bias[0] = -(0.999 * float(flat @ flat))
    return model


def test_dsnr_is_low_for_honest_models_and_high_when_one_example_dominates(batch: Batch) -> None:
    detector = build_detector("dsnr")
    for honest in (mlp(0), trained(mlp(1), 30, 1)):
        finding = detector(received(honest, batch), {})
        assert finding.scores["dsnr"] < 0.5 and not finding.flagged
    x = batch[0]
    brightest = int(x.flatten(1).norm(dim=1).argmax())
    fishing = detector(received(one_example_fishing(x[brightest]), batch), {})
    assert fishing.flagged and fishing.scores["dsnr"] == math.inf
    imprint = detector(received(manipulated(mlp(0), build_imprint(ImprintParams(bins=64, edges="normal"))), batch), {})
    assert imprint.scores["dsnr"] < 0.5, "64 bins over 32 examples: no example dominates a layer (see the docs)"


def test_drift_flags_a_manipulated_round_after_two_honest_ones(batch: Batch) -> None:
    detector = DriftDetector(DriftParams())
    state: dict[str, torch.Tensor] = {}
    start = mlp(0)
    first = detector(received(start, batch), state)
    assert first.scores == {"drift": 0.0, "layer": -1.0, "reference": 0.0} and not first.flagged
    detector.remember(received(start, batch), state)
    honest = trained(mlp(0), 10, 0)
    step = detector(received(honest, batch), state)
    assert step.scores["reference"] == 1 and 0 < step.scores["drift"] < DriftParams().threshold
    assert not detector(received(manipulated(honest, TRAP), batch), state).flagged, "one reference: no verdict"
    detector.remember(received(honest, batch), state)
    attacked = detector(received(manipulated(honest, TRAP), batch), state)
    assert attacked.flagged and attacked.scores["layer"] == 0 and attacked.scores["drift"] > 0.7
    assert attacked.scores["reference"] == 2


def test_drift_after_an_unflagged_manipulation(batch: Batch) -> None:
    """A manipulated model accepted in a client's first round: the honest models after it are not flagged, it
    leaves the references after two accepted rounds, and a rewritten layer is flagged again; with one reference
    every honest model after it is flagged, and sent every other round it stays near one of two references."""
    trapped, honest = manipulated(mlp(0), TRAP), [trained(mlp(0), steps, 0) for steps in (5, 10, 15)]
    detector, single = DriftDetector(DriftParams()), DriftDetector(DriftParams(references=1))
    state: dict[str, torch.Tensor] = {}
    detector.remember(received(trapped, batch), state)
    for model in honest[:2]:
        finding = detector(received(model, batch), state)
        assert not finding.flagged, finding
        detector.remember(received(model, batch), state)
    assert detector(received(trapped, batch), state).flagged, "it left the references"
    assert detector(received(manipulated(honest[1], TRAP), batch), state).flagged
    assert not detector(received(honest[2], batch), state).flagged

    alone: dict[str, torch.Tensor] = {}
    single.remember(received(trapped, batch), alone)
    assert all(single(received(model, batch), alone).flagged for model in honest), "stuck on the trapped model"

    alternate: dict[str, torch.Tensor] = {}
    detector.remember(received(trapped, batch), alternate)
    detector.remember(received(honest[0], batch), alternate)
    assert not detector(received(trapped, batch), alternate).flagged, "the same manipulation two rounds later"


def test_drift_keeps_its_references_newest_first_in_the_state(batch: Batch) -> None:
    detector = DriftDetector(DriftParams(references=2))
    state = {"detect.drift.0": torch.ones(3), "detect.other": torch.zeros(1)}  # an older layout is dropped
    models = [mlp(seed) for seed in range(3)]
    for model in models:
        detector.remember(received(model, batch), state)
    kept = sorted(k for k in state if k.startswith("detect.drift."))
    assert kept == [f"detect.drift.{slot}.{i}" for slot in (0, 1) for i in range(3)]
    assert torch.equal(state["detect.drift.0.0"], weights(models[2])[0])
    assert torch.equal(state["detect.drift.1.0"], weights(models[1])[0])
    assert torch.equal(state["detect.other"], torch.zeros(1))
    with pytest.raises(ValueError, match="references"):
        DriftParams(references=0)


def test_relative_change_is_bounded_and_checks_the_layout() -> None:
    a, b = torch.tensor([[3.0, 4.0]]), torch.tensor([[0.0, 0.0]])
    assert relative_changes([a], [a]).tolist() == [0.0]
    assert relative_changes([a], [-a]).tolist() == [1.0]
    assert relative_changes([a], [b]).tolist() == [1.0] and relative_changes([b], [b]).tolist() == [0.0]
    with pytest.raises(ValueError, match="model changed"):
        relative_changes([a], [torch.zeros(2, 2)])


def test_detect_remembers_only_an_unflagged_model(batch: Batch) -> None:
    detectors = {"structure": build_detector("structure"), "drift": build_detector("drift")}
    state: dict[str, torch.Tensor] = {}
    attacked = detect(detectors, received(manipulated(mlp(0), IMPRINT), batch), state, "refuse")
    assert attacked.flagged and attacked.declines and state == {}
    row = attacked.row()
    assert row["structure.flagged"] == 1.0 and row["drift.flagged"] == 0.0 and row["action"] == "refuse"
    honest = detect(detectors, received(mlp(0), batch), state, "refuse")
    assert not honest.declines and honest.row()["action"] == "none" and len(state) == 3
    assert not Verdict({"x": Finding({}, True)}, "report").declines


def test_findings_travel_in_a_refusal_reason_and_are_checked() -> None:
    findings: dict[str, float | str] = {
        "structure.trap-sign": 9.5,
        "dsnr.dsnr": math.inf,
        "flagged": 1.0,
        "action": "refuse",
    }
    reason = refusal_reason(findings)
    message = Message(RecordDict(), dst_node_id=1, message_type="train")
    refusal = Message(Error(0, reason), reply_to=message)
    assert read_findings(refusal) == findings
    bad = Message(RecordDict({DETECT: ConfigRecord({"action": "steal"})}), reply_to=message)
    with pytest.raises(ValueError, match="action"):
        read_findings(bad)


def test_configuration_names_bad_detect_values() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, ["detect.name=structure,dsnr,drifts", "detect.action=block", "detect.drift.threshold=2.0"])
    problems = "\n".join(error.value.problems)
    assert re.search(r"'drifts' is not one of none, drift, dsnr, (\S+, )*structure", problems)  # plugins may add more
    assert "detect.action = 'block': choose one of report, skip, refuse" in problems
    assert "detect.drift.threshold = 2.0" in problems
    with pytest.raises(ConfigError, match="train.batch-size = 1"):
        config("detect.name=dsnr", "train.batch-size=1")


def test_a_skipping_client_trains_nothing_and_a_reporting_one_trains() -> None:
    cfg = config("detect.name=structure", "detect.action=skip", "model.mlp.hidden=32")
    torch.manual_seed(0)
    honest = build_model("mlp", load_dataset("digits").spec, cfg.model.params)
    card = ModelCard("mlp", {}, load_dataset("digits").spec, tuple(honest.state_dict()), (True,) * 6)
    sent = build_imprint(ImprintParams(bins=8, edges="normal"))(get_arrays(honest), card, np.random.default_rng(0))
    with pytest.raises(ModelDeclined) as declined:
        client_fit(cfg, 1, sent, round_=2)
    assert declined.value.verdict.action == "skip" and declined.value.client == 1
    reporting = config("detect.name=structure", "detect.action=report", "model.mlp.hidden=32")
    _, n, metrics = client_fit(reporting, 1, sent, round_=2)
    assert n == 8 and metrics["detect.flagged"] == 1.0 and metrics["detect.action"] == "report"


@pytest.mark.parametrize("action", ["refuse", "skip"])
def test_clients_decline_a_manipulated_round_and_the_round_records_it(tmp_path: Path, action: str) -> None:
    cfg = config(
        "train.rounds=3",
        "capture.rounds=2",
        "threat.malicious=2:imprint",
        "manipulation.imprint.bins=8",
        "detect.name=structure,drift",
        f"detect.action={action}",
        f"out-dir={tmp_path / 'run'}",
    )
    folder = run_server(LocalGrid(make_client_app(cfg), cfg.partition.num_clients), cfg)
    rows = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
    by_round = {row["round"]: row for row in rows}
    assert by_round[1]["clients"] == 3 and "declined" not in by_round[1]
    assert all(f["action"] == "none" and f["flagged"] == 0 for f in by_round[1]["detect"])
    attacked = by_round[2]
    assert attacked["clients"] == 0 and attacked["declined"] == 3 and "failures" not in attacked
    assert "rejected" not in attacked and "model is unchanged" in attacked["skipped"]
    assert len({f["client"] for f in attacked["detect"]}) == 3
    for finding in attacked["detect"]:
        assert finding["action"] == action and finding["structure.flagged"] == 1
        assert finding["structure.bias-ladder"] == 8 and finding["structure.equal-columns"] == 8
    assert attacked["loss"] == by_round[1]["loss"], "the refused round left the model as it was"
    assert by_round[3]["clients"] == 3 and "declined" not in by_round[3]


def test_the_round_guard_rejects_a_skip_that_names_another_client_and_fails_a_garbled_refusal() -> None:
    seen: list[tuple] = []
    rules = UploadRules("fedsgd", lr=0.5, batch_size=8, local_epochs=1, num_classes=10, partition_sizes=(8, 8, 8))
    guard = RoundGuard(FedAvg(min_train_nodes=3), lambda *a: seen.append(a), rules)
    sent = sorted(
        guard.configure_train(1, array_record(["w"], [np.zeros(2, np.float32)]), ConfigRecord(), Nodes(3)),
        key=lambda m: m.metadata.dst_node_id,
    )  # clients 0, 1, 2
    for m in sent:
        m.metadata.__dict__["_message_id"] = f"m{m.metadata.dst_node_id}"
    findings: dict[str, float | str] = {"flagged": 1.0, "action": "skip"}
    impostor = Message(declined_content(0, findings), reply_to=sent[1])
    garbled = Message(Error(0, REFUSED + "{not json"), reply_to=sent[2])
    replies = [reply(sent[0], [np.ones(2, np.float32)], 8, {"client": 0}), impostor, garbled]
    for message, to in zip(replies[1:], sent[1:]):
        message.metadata.__dict__["_src_node_id"] = to.metadata.dst_node_id
    new, _ = guard.aggregate_train(1, replies)
    assert new is not None and new.to_numpy_ndarrays()[0].tolist() == [1.0, 1.0]
    _, uploads, errors, rejected, found, stragglers = seen[0]
    assert [u.client for u in uploads] == [0] and found == [] and stragglers == []
    assert len(errors) == 1 and "not json" in errors[0].reason
    assert [(r.client, "declares client 0" in r.reason) for r in rejected] == [(1, True)]
