"""Attack workers on a GPU the simulated clients already reserved (``attackers.pool.gpu_options``).

Flower sizes its client actor pool to take every GPU share Ray has, so an attack worker that claims a whole
GPU is never scheduled. The pool then starts its workers without a claim, and Ray must leave the GPU visible
to them. The Ray cluster here declares one logical GPU; no hardware is needed to see what Ray exposes.
"""

from __future__ import annotations

import os
import time

import pytest
import ray

from attackers.pool import gpu_options

pytestmark = pytest.mark.slow  # starts Ray


@ray.remote
class VisibleDevices:
    def read(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture
def one_gpu_cluster(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", raising=False)  # Ray's default, which conftest turns off
    ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_whole_free_gpu_is_claimed() -> None:
    assert gpu_options(1.0) == {"num_gpus": 1}
    assert gpu_options(2.5)["num_gpus"] == 1


@pytest.mark.parametrize("free", [0.0, 0.75])
def test_without_a_whole_free_gpu_the_worker_claims_none(free: float) -> None:
    assert gpu_options(free)["num_gpus"] == 0


def free_gpus_once_settled(expected: float, within_s: float = 30.0) -> float:
    """Ray's resource view lags a new reservation by a heartbeat; read it until it shows ``expected``."""
    deadline = time.monotonic() + within_s
    free = ray.available_resources().get("GPU", 0.0)
    while free != expected and time.monotonic() < deadline:
        time.sleep(0.2)
        free = ray.available_resources().get("GPU", 0.0)
    return free


def test_a_worker_without_a_claim_still_sees_the_gpu_the_clients_hold(one_gpu_cluster) -> None:
    client = VisibleDevices.options(num_cpus=0, num_gpus=1).remote()  # the client actor holding the GPU
    assert ray.get(client.read.remote(), timeout=60) == "0"
    free = free_gpus_once_settled(0.0)
    assert free == 0.0
    hidden = VisibleDevices.options(num_cpus=0, num_gpus=0).remote()
    shared = VisibleDevices.options(num_cpus=0, **gpu_options(free)).remote()
    assert ray.get(hidden.read.remote(), timeout=60) == ""  # what Ray does to an actor that claims no GPU
    assert ray.get(shared.read.remote(), timeout=60) == "0"
