"""benchmarks/scale_clients.py: its measurement of both tools on a tiny federation, and that the bare app starts
from fedguard's model and takes fedguard's client step (batch draw, gradient, DGP with error feedback)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scale_clients", BENCHMARKS / "scale_clients.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("scale_clients", module)
    spec.loader.exec_module(module)
    return module


def test_bare_app_starts_from_fedguards_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same layers, names, shapes and initial weights as fedguard's default MLP under the same seed."""
    from fedguard.config import Config
    from fedguard.data import load_dataset
    from fedguard.models import build_model

    monkeypatch.syspath_prepend(str(BENCHMARKS / "bare_flower"))
    from bareflower.task import build_model as bare_model

    config = Config()
    torch.manual_seed(config.run.seed)
    ours = build_model(
        config.model.name, load_dataset(config.data.name, config.data.source_options()).spec, config.model.params
    ).state_dict()
    run_config = {
        "data-name": config.data.name,
        "data-root": config.data.root,
        "seed": config.run.seed,
        "test-fraction": config.data.test_fraction,
        "image-size": config.data.image_size,
    }
    bare = bare_model(run_config, seed=config.run.seed).state_dict()
    assert list(bare) == list(ours)
    assert all(torch.equal(bare[name], ours[name]) for name in ours)


@pytest.mark.parametrize("defense", ["dgp", "none"])
def test_bare_client_step_is_fedguards(monkeypatch: pytest.MonkeyPatch, defense: str) -> None:
    """Bit for bit what fedguard's FedSGD client sends, round after round: the same batch, gradient and DGP
    output, the residual carried in a Context.state RecordDict on the bare side."""
    from flwr.app import RecordDict

    from clients.defended_client import DefendedClient
    from fedguard.wire.sparse import ENCODING_KEY, SPARSE, decode_arrays

    monkeypatch.syspath_prepend(str(BENCHMARKS / "bare_flower"))
    from bareflower import task

    clients, client, lr = 10, 3, 0.5
    config = _benchmark().fedguard_config(clients, 3, defense)
    run_config = {
        "data-name": config.data.name,
        "data-root": config.data.root,
        "seed": config.run.seed,
        "test-fraction": config.data.test_fraction,
        "image-size": config.data.image_size,
    }
    global_model = task.build_model(run_config, seed=config.run.seed)
    ours, state = DefendedClient(config, client, RecordDict()), RecordDict()
    local = task.local_split(run_config, client, clients)
    for server_round in (1, 2, 3):
        arrays = [v.detach().numpy().copy() for v in global_model.state_dict().values()]
        upload, _, declared = ours.fit(arrays, {"server-round": server_round})
        if declared.get(ENCODING_KEY) == SPARSE:
            upload = decode_arrays(upload)
        model = task.process_model(run_config)
        model.load_state_dict(global_model.state_dict())
        batch, generator = task.client_batch(len(local), config.train.batch_size, config.run.seed, client, server_round)
        x, y = local.batch(batch)
        sent, loss = task.defended_gradients(model, x, y, defense, state, generator, server_round, client, len(local))
        assert loss == declared["loss"]
        assert all(np.array_equal(a, s.numpy()) for a, s in zip(upload, sent, strict=True)), server_round
        assert (task.RESIDUAL_KEY in state) == (defense == "dgp")
        if defense == "dgp":
            assert sum(int((s != 0).sum()) for s in sent) < sum(s.numel() for s in sent) / 4  # 20 % sent
        task.sgd_step(model, sent, lr)
        global_model.load_state_dict(model.state_dict())


def test_memory_reads_pss_and_refuses_too_many_clients() -> None:
    bench = _benchmark()
    pss, rss, proportional = bench._memory(os.getpid())
    assert proportional and 0 < pss <= rss
    assert bench._memory(2**22 + 1) == (0, 0, True)  # beyond pid_max: no such process
    reason = bench.refusal(4001, 3)
    assert reason is not None and "--data fashion-mnist" in reason
    assert bench.refusal(4000, 3) is None


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_scale_benchmark_measures_both_tools(tmp_path: Path) -> None:
    bench = _benchmark()
    out, plot = tmp_path / "scale.json", tmp_path / "scale.png"
    payload = bench.run_benchmark([4], 2, ("fedguard", "bare"), out, plot, timeout=240.0, defense="dgp")

    assert json.loads(out.read_text()) == payload
    results = {r["tool"]: r for r in payload["results"]}
    assert set(results) == {"fedguard", "bare"}
    for tool, result in results.items():
        assert result["status"] == "ok", (tool, result.get("error"))
        assert result["clients"] == 4 and len(result["round_seconds"]) == 2
        assert (result["defense"], result["data"]) == ("dgp", "mnist-5k")
        for key in (
            "seconds_per_round",
            "ms_per_client_step",
            "first_round_seconds",
            "peak_pss_sum_gb",
            "peak_pss_max_gb",
            "peak_rss_sum_gb",
            "peak_rss_max_gb",
        ):
            assert math.isfinite(result[key]) and result[key] > 0, (tool, key, result[key])
        assert result["memory_measure"] == "PSS" and not result["pss_unreadable"]
        assert result["peak_pss_max_gb"] <= result["peak_pss_sum_gb"] <= result["peak_rss_sum_gb"]
        assert result["peak_rss_max_gb"] <= result["peak_rss_sum_gb"]
        # the sampler found the run's processes, including those in sessions of their own and Ray's actors
        assert {"simulation (ServerApp)", "Ray ClientAppActor", "SuperLink"} <= set(result["peak_breakdown_gb"])
    assert "fedguard CLI" in results["fedguard"]["peak_breakdown_gb"]
    (ratio,) = payload["ratios"]
    assert all(
        math.isfinite(ratio[k]) and ratio[k] > 0
        for k in ("step_time", "memory", "memory_rss", "largest_process", "largest_process_rss")
    )
    (line,) = bench.summary_lines(payload["results"])
    assert line.startswith("N =      4: fedguard/bare") and "peak PSS" in line
    assert plot.stat().st_size > 0
