"""The run's least memory, read off the model on the meta device, against the machine's: a model no machine here
can hold is refused before anything starts, naming its keys and the estimate, without allocating it."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from fedguard.config import ConfigError, load_config
from fedguard.data.registry import SourceOptions, dataset_spec
from fedguard.memory import (
    ACTIVATION_COPIES,
    CLIENT_COPIES,
    WORKER_COPIES,
    RunMemory,
    activation_bytes,
    machine_bytes,
    model_bytes,
    size_text,
)
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams


def test_model_bytes_on_the_meta_device_equal_the_built_models() -> None:
    spec = dataset_spec("digits", SourceOptions())
    params = MLPParams(hidden=48, depth=3, batch_norm=True)
    real = build_model("mlp", spec, params)
    with torch.device("meta"):
        meta = build_model("mlp", spec, params)
    expected = sum(t.numel() * t.element_size() for t in [*real.parameters(), *real.buffers()])
    assert model_bytes(meta) == expected
    inputs = spec.channels * spec.height * spec.width
    weights = inputs * 48 + 48 + 2 * (48 * 48 + 48) + 48 * 10 + 10
    norms = 2 * (4 * 48 * 4 + 8)  # two BatchNorms: weight, bias, running mean and variance; a batch count
    assert expected == 4 * weights + norms


def test_activation_bytes_count_every_leaf_output_of_one_sample() -> None:
    spec = dataset_spec("digits", SourceOptions())
    with torch.device("meta"):
        net = build_model("mlp", spec, MLPParams(hidden=32, depth=2))
    inputs = spec.channels * spec.height * spec.width
    # flatten, linear + relu twice, the head
    assert activation_bytes(net, spec.shape) == 4 * (inputs + 4 * 32 + 10)
    assert net.training, "the estimate leaves the model in its mode"


def test_the_total_counts_each_holder() -> None:
    need = RunMemory(weights=100, activations=10, batch=8, clients=2, uploads=5, workers=3)
    assert need.client_bytes == CLIENT_COPIES * 100 + ACTIVATION_COPIES * 10 * 8
    assert need.total == 2 * need.client_bytes + 6 * 100 + 3 * WORKER_COPIES * 100


def test_the_machine_has_memory_and_sizes_read_in_decimal_units() -> None:
    assert 2**28 < machine_bytes() < 2**50
    assert [size_text(n) for n in (999, 1000, 512 * 10**6, 10_200_000_000, 4 * 10**18)] == [
        "999 B",
        "1 kB",
        "512 MB",
        "10.2 GB",
        "4000.0 PB",
    ]


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    return caught.value.problems


def test_a_model_the_machine_cannot_hold_is_refused_naming_its_keys_without_allocating_it() -> None:
    tracemalloc.start()
    try:
        [problem] = _problems(["model.mlp.hidden=50000"])
        [huge] = _problems(["model.mlp.hidden=1000000"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20
    assert problem.startswith("model.name = 'mlp', model.mlp.hidden = 50000: the run needs at least ")
    assert "10.2 GB of weights" in problem and "2 clients training at once" in problem
    assert f"this machine has {size_text(machine_bytes())}" in problem and "sim.num-cpus = 2" in problem
    assert "4.0 TB of weights" in huge
    [overflow] = _problems([f"model.mlp.hidden={2**31}"])
    assert overflow.startswith(f"model.name = 'mlp', model.mlp.hidden = {2**31}: a model too large for any machine")


def test_the_estimate_follows_the_machine_and_the_clients_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    load_config(None, ["model.mlp.hidden=4096"])  # 68 MB of weights: fits
    monkeypatch.setattr("fedguard.config_checks.machine_bytes", lambda: 2 * 10**9)
    [problem] = _problems(["model.mlp.hidden=4096", "sim.num-cpus=16", "train.clients-per-round=10"])
    assert "10 clients training at once" in problem and "this machine has 2.0 GB" in problem
    load_config(None, ["model.mlp.hidden=4096", "sim.num-cpus=1", "train.clients-per-round=1"])
    [cluster] = _problems(["model.mlp.hidden=30000", "sim.address=10.0.0.5:6379"])
    assert "training at once" not in cluster and "the server with 10 uploads a round" in cluster


def test_a_deeper_model_than_the_limit_is_refused_before_it_is_built() -> None:
    [problem] = _problems(["model.mlp.depth=100000"])
    assert problem == "model.mlp: depth must be in 0..1000, got 100000 (model.mlp.depth = 100000)"


def test_fedguard_run_refuses_it_before_anything_starts(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fedguard", "run", "--set", "model.mlp.hidden=50000"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "model.mlp.hidden = 50000: the run needs at least" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == [], "nothing is written"
