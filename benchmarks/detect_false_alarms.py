"""False alarms and detections of the client-side detectors (``fedguard.detect``) at their default thresholds.

Honest models: ``--models`` of each architecture (the MLP of ``model.mlp`` defaults and LeNet) on mnist-5k, each
from its own seed, checked at random initialisation and after 1 to ``--steps`` SGD steps (learning rate
``--lr``; batches of 320 images, one aggregated FedSGD round of 10 clients of 32). ``structure`` and ``dsnr``
see each of them on a batch of 32 of the client's images; ``drift`` compares the trained model with the same
model three steps earlier (a client that sat out two rounds) as its one reference (``references = 1``).
Manipulated models: imprint (64 and 16 bins) and trap weights (defaults) written by ``attackers`` from each
trained MLP, with ``drift`` against that honest model. A cell is the share of models flagged.

    .venv/bin/python benchmarks/detect_false_alarms.py [--models 50] [--steps 20] [--lr 0.5] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn

from attackers.imprint import ImprintParams, build_imprint
from attackers.manipulation import Manipulation
from attackers.trap_weights import TrapWeightsParams, build_trap_weights
from fedguard.data import ImageData, load_dataset
from fedguard.detect import Finding, Received, build_detector
from fedguard.detect.drift import DriftDetector, DriftParams
from fedguard.models import build_model
from fedguard.observation import ModelCard
from fedguard.training import get_arrays, loss_fn, set_arrays, trainable_mask

DETECTORS = ("structure", "dsnr", "drift")
COLUMNS = (*DETECTORS, "any")  # "any": flagged by one detector or more
SCORES = (
    "structure.repeated-rows",
    "structure.bias-ladder",
    "structure.equal-columns",
    "structure.trap-sign",
    "dsnr.dsnr",
    "drift.drift",
)
ROUND_BATCH = 320  # images of one aggregated FedSGD round: 10 clients of 32
CLIENT_BATCH = 32


def sgd_steps(model: nn.Module, data: ImageData, steps: int, lr: float, rng: np.random.Generator) -> None:
    """``steps`` SGD steps of ``model`` in place on batches of ``ROUND_BATCH`` training images."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        x, y = data.train.batch(rng.choice(len(data.train), ROUND_BATCH, replace=False))
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()


def findings(
    model: nn.Module, reference: nn.Module | None, batch: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, Finding]:
    """Each detector's finding on ``model``; ``drift`` against ``reference`` alone (not flagged without one)."""
    received = Received(model, batch[0], batch[1], loss_fn)
    found = {name: build_detector(name)(received, {}) for name in ("structure", "dsnr")}
    state: dict[str, torch.Tensor] = {}
    drift = DriftDetector(DriftParams(references=1))
    if reference is not None:
        drift.remember(Received(reference, batch[0], batch[1], loss_fn), state)
    found["drift"] = drift(received, state)
    return found


def manipulated(model: nn.Module, name: str, manipulation: Manipulation, data: ImageData) -> nn.Module:
    """A copy of ``model`` (architecture ``name``) loaded with what ``manipulation`` sends in its place."""
    card = ModelCard(name, {}, data.spec, tuple(model.state_dict()), tuple(trainable_mask(model)))
    sent = build_model(name, data.spec, None)
    set_arrays(sent, manipulation(get_arrays(model), card, np.random.default_rng(0)))
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=50, help="honest models per architecture")
    parser.add_argument("--steps", type=int, default=20, help="most SGD steps of a trained honest model")
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate of the honest steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset("mnist-5k")
    manipulations: dict[str, Callable[[], Manipulation]] = {
        "imprint-64": lambda: build_imprint(ImprintParams(bins=64, edges="normal")),
        "imprint-16": lambda: build_imprint(ImprintParams(bins=16, edges="normal")),
        "trap-weights": lambda: build_trap_weights(TrapWeightsParams()),
    }
    counts: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    ranges: dict[str, dict[str, tuple[float, float]]] = {}

    def count(row: str, found: dict[str, Finding]) -> None:
        counts.setdefault(row, dict.fromkeys(COLUMNS, 0))
        totals[row] = totals.get(row, 0) + 1
        flagged = {name: f.flagged for name, f in found.items()}
        for name, flag in {**flagged, "any": any(flagged.values())}.items():
            counts[row][name] += int(flag)
        low_high = ranges.setdefault(row, {})
        for name, finding in found.items():
            for score, value in finding.scores.items():
                low, high = low_high.get(f"{name}.{score}", (value, value))
                low_high[f"{name}.{score}"] = (min(low, value), max(high, value))

    start = time.perf_counter()
    for architecture in ("mlp", "lenet"):
        for index in range(args.models):
            rng = np.random.default_rng([args.seed, index])
            torch.manual_seed(args.seed * 100_000 + index)
            model = build_model(architecture, data.spec, None)
            batch = data.train.batch(rng.choice(len(data.train), CLIENT_BATCH, replace=False))
            count(f"{architecture} initial", findings(model, None, batch))
            sgd_steps(model, data, int(rng.integers(1, args.steps + 1)), args.lr, rng)
            reference = build_model(architecture, data.spec, None)
            reference.load_state_dict(model.state_dict())
            sgd_steps(model, data, 3, args.lr, rng)
            count(f"{architecture} trained", findings(model, reference, batch))
            if architecture == "mlp":
                for name, build in manipulations.items():
                    count(f"mlp {name}", findings(manipulated(model, "mlp", build(), data), model, batch))
    print(f"share of models flagged ({time.perf_counter() - start:.0f} s)\n")
    print(f"| models | n | {' | '.join(COLUMNS)} |\n|---|---|{'---|' * len(COLUMNS)}")
    for row, found in counts.items():
        cells = " | ".join(f"{found[name] / totals[row]:.2f}" for name in COLUMNS)
        print(f"| {row} | {totals[row]} | {cells} |")
    print("\nrange of each score (smallest to largest; drift 0 without a reference)\n")
    print(f"| models | {' | '.join(SCORES)} |\n|---|{'---|' * len(SCORES)}")
    for row, low_high in ranges.items():
        print(f"| {row} | {' | '.join(f'{low_high[s][0]:.3g} to {low_high[s][1]:.3g}' for s in SCORES)} |")


if __name__ == "__main__":
    main()
