"""Seconds per client step of every defense, as a ratio to the undefended step on the same model and batch.

A step is what a FedSGD client does per round: the batch gradient in train mode (``compute_gradients``),
then the defense. Both are timed in this process on the same inputs; the median of ``--repeats`` calls
after one warm-up. Refiner loads the evaluation network at --evalnet, or trains a small one here (its
quality does not change the cost). DP-SGD refuses BatchNorm models (ResNet-18), which the table says.

    .venv/bin/python benchmarks/defense_step_time.py [--models lenet,resnet18] [--batch 8] [--repeats 5]
        [--threads 2] [--defenses none,dp,dp-sgd,dgp,prune,quantize,soteria,censor,refiner] [--evalnet PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedguard.data import load_dataset
from fedguard.defenses import DEFENSES, LocalStep, build_defense
from fedguard.defenses.evalnet import EvalNetOptions, save_evalnet, train_evalnet
from fedguard.models import build_model
from fedguard.training import compute_gradients, loss_fn

DEFAULT_DEFENSES = "none,dp,dp-sgd,dgp,prune,quantize,soteria,censor,refiner"


def seconds(work: Callable[[], Any], repeats: int) -> float:
    """Median wall-clock seconds of ``work()`` over ``repeats`` calls, after one warm-up call."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def defense_params(name: str, evalnet: Path) -> Any:
    """Each defense's default parameters (Refiner pointed at ``evalnet``)."""
    params = DEFENSES.get(name).params
    return params(evalnet=str(evalnet)) if name == "refiner" else (params() if params else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="lenet,resnet18")
    parser.add_argument("--defenses", default=DEFAULT_DEFENSES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--evalnet", type=Path, help="a saved evaluation network for 32x32 photos")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = load_dataset("photos")
    x, y = data.train.batch(list(range(args.batch)))
    evalnet = args.evalnet or save_evalnet(
        train_evalnet("photos", "test", EvalNetOptions(epochs=1)), Path(tempfile.mkdtemp()) / "photos.npz"
    )
    print(f"photos 32x32, batch {args.batch}, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'model':10s} {'defense':9s} {'step ms':>10s} {'ratio':>8s}")
    for model_name in args.models.split(","):
        torch.manual_seed(0)
        model = build_model(model_name, data.spec)
        baseline = seconds(lambda: compute_gradients(model, x, y), args.repeats)
        for name in args.defenses.split(","):
            defense = build_defense(name, defense_params(name, evalnet))
            state: dict[str, torch.Tensor] = {}
            seeds = iter(range(10**6))

            def step() -> list[torch.Tensor]:
                grads, _ = compute_gradients(model, x, y)
                local = LocalStep(
                    model, x, y, grads, loss_fn, torch.Generator().manual_seed(next(seeds)), 1, 0, len(data.train)
                )
                return defense(local, state)

            try:
                took = seconds(step, args.repeats)
            except ValueError as refused:
                print(f"{model_name:10s} {name:9s} refused: {str(refused).splitlines()[0][:90]}")
                continue
            print(f"{model_name:10s} {name:9s} {took * 1e3:10.1f} {took / baseline:7.1f}x", flush=True)


if __name__ == "__main__":
    main()
