"""Shared fixtures: small, deterministic inputs and the offline datasets."""

from __future__ import annotations

import os

import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
# Attacks run eager here: compiling costs seconds per program, and tests/test_compiled.py checks that the
# compiled programs equal the eager ones.
os.environ.setdefault("FEDGUARD_COMPILE", "off")
torch.set_num_threads(1)
# Messages built in this process (strategies driven without a SuperLink) take their run and task from here,
# as a ServerApp's process has them from Flower.
TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpacked system datasets go to a temporary cache, never the user's."""
    monkeypatch.setenv("FEDGUARD_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
