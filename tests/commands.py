"""The command lines the tests start: ``fedguard run`` on the quickstart with ``--set`` overrides, and the
override sets several tests share."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "experiments" / "quickstart.toml")

# The small configuration of the in-process tests: scikit-learn digits, an MLP of 16 units, 4 clients.
SMALL_RUN = [
    "data.name=digits",
    "model.name=mlp",
    "model.mlp.hidden=16",
    "partition.num-clients=4",
    "train.clients-per-round=3",
    "train.batch-size=8",
]
# IG at a size that runs in a second on a CPU: what `fedguard attack` tests run.
QUICK_IG = ["attack.name=ig", "attack.ig.iterations=5", "attack.ig.restarts=1", "attack.ig.device=cpu"]
# A run that goes on until it is stopped: 500 rounds of 3 clients, IG attacking rounds 1-2 without end.
ENDLESS_RUN = [
    "train.rounds=500",
    "partition.num-clients=3",
    "train.clients-per-round=3",
    "capture.rounds=1-2",
    "capture.clients=0-2",
    "attack.ig.iterations=1000000",
]


def settings(overrides: Iterable[str]) -> list[str]:
    """``--set KEY=VALUE`` for each override."""
    return [arg for override in overrides for arg in ("--set", override)]


def quickstart_run(out: Path, overrides: Iterable[str] = ()) -> list[str]:
    """The command line of ``fedguard run`` on the quickstart into ``out`` with ``overrides``."""
    return [sys.executable, "-m", "fedguard", "run", QUICKSTART, "--out", str(out), *settings(overrides)]
