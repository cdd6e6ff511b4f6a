"""The Ray cluster a sweep's runs share: who may share it, and that it is gone once the sweep's block ends."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from fedguard.config import Config
from fedguard.runtime.ray_head import shared_cpus, shared_ray
from fedguard.runtime.simulation import LOOPBACK_RAY


def _with_sim(**changes: Any) -> Config:
    config = Config()
    return dataclasses.replace(config, sim=dataclasses.replace(config.sim, **changes))


def test_runs_share_a_cluster_only_where_they_would_each_start_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    two, four = _with_sim(num_cpus=2), _with_sim(num_cpus=4)
    assert shared_cpus([two, two]) == 2
    assert shared_cpus([two, four]) is None  # different clusters
    assert shared_cpus([two, _with_sim(num_cpus=2, address="127.0.0.1:6379")]) is None  # one joins its own
    assert shared_cpus([_with_sim(num_cpus=2, client_cpus=3)]) is None  # refused by the run itself
    assert shared_cpus([]) is None
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert shared_cpus([two]) is None


@pytest.mark.slow
def test_a_run_joins_the_shared_cluster_and_it_stops_with_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    probe = (
        "import os, ray; ray.init(address=os.environ['RAY_ADDRESS'], logging_level=40); "
        "print(ray.cluster_resources()['CPU'])"
    )
    with shared_ray([_with_sim(num_cpus=2)], say=pytest.fail) as env:
        joined = subprocess.run(
            [sys.executable, "-c", probe],
            env={**os.environ, **env, **LOOPBACK_RAY},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert joined.stdout.split()[-1] == "2.0", joined.stderr[-2000:]
        host, _, port = env["RAY_ADDRESS"].rpartition(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=5):
        pass
