"""Reconstructions per second of every optimization attack: batched vs one at a time, same inputs.

For each attack, U captured uploads (batch-1 FedSGD gradients of distinct
images) are attacked with R restarts each, twice with the same attack code:
one at a time (U x R calls of one restart each) and batched (one call that
runs all U x R jobs as one tensor program). Prints seconds, reconstructions
per second (uploads finished per second) and the speed-up.

    .venv/bin/python benchmarks/attack_throughput.py [--attacks ig,dlg,idlg,gradinversion,ggl]
        [--uploads 4] [--restarts 2] [--iterations 30] [--threads 1] [--device cpu] [--generator PATH]

Targets: ig, dlg and idlg on the DLG LeNet (32x32 photos); gradinversion on
the ConvNet (width 16, BatchNorm; 32x32 photos); ggl on the MLP (MNIST digits)
with the generator at --generator, or one trained for a single epoch here
(its quality does not matter for timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from attackers.base import build_attack
from fedguard.data import load_dataset
from fedguard.models import MODELS, build_model
from fedguard.models.convnet import ConvNetParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import compute_gradients, get_arrays, trainable_mask

TARGETS: dict[str, tuple[str, str, Any]] = {
    "ig": ("photos", "lenet", None),
    "dlg": ("photos", "lenet", None),
    "idlg": ("photos", "lenet", None),
    "gradinversion": ("photos", "convnet", ConvNetParams(width=16)),
    "ggl": ("mnist-5k", "mlp", None),
}


def captures(data_name: str, model_name: str, params: Any, uploads: int) -> list[Observation]:
    """``uploads`` batch-1 gradient observations of distinct test images, client buffers included."""
    data = load_dataset(data_name)
    params = params if params is not None else MODELS.get(model_name).params()
    torch.manual_seed(0)
    model = build_model(model_name, data.spec, params)
    arrays = get_arrays(model)
    card = ModelCard(
        model_name, dataclasses.asdict(params), data.spec, tuple(model.state_dict()), tuple(trainable_mask(model))
    )
    observations = []
    for index in range(uploads):
        model.load_state_dict({n: torch.tensor(a) for n, a in zip(card.names, arrays)})
        x, y = data.test.batch([index * 7])
        grads, _ = compute_gradients(model, x, y)
        after = iter(grads)
        upload = [
            next(after).numpy() if t else a.detach().numpy().copy()
            for t, a in zip(card.trainable, model.state_dict().values())
        ]
        observations.append(card.observe(1, index, "gradient", arrays, upload, 1, {"batch-size": 1}))
    return observations


def attack_params(name: str, iterations: int, restarts: int, device: str, generator: str) -> Any:
    from attackers.base import ATTACKS

    extra = {"generator": generator} if name == "ggl" else {}
    return ATTACKS.get(name).params(iterations=iterations, restarts=restarts, device=device, **extra)


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def default_generator(folder: Path) -> str:
    """A one-epoch generator on mnist-5k's test split, for timing only."""
    from attackers.generators import save_generator, train_generator
    from attackers.generators.train import TrainOptions

    trained = train_generator("mnist-5k", "test", TrainOptions(epochs=1))
    return str(save_generator(trained, folder / "mnist-5k.npz"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attacks", default=",".join(TARGETS))
    parser.add_argument("--uploads", type=int, default=4)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--generator", default="", help="ggl's generator (.npz); default: train one epoch here")
    args = parser.parse_args()
    names = [n.strip() for n in args.attacks.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown attack(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        generator = args.generator or (default_generator(Path(scratch)) if "ggl" in names else "")
        print(
            f"{args.uploads} uploads x {args.restarts} restarts x {args.iterations} iterations, "
            f"{args.threads} thread(s), device {args.device}"
        )
        print(f"{'attack':14} {'model':8} {'one at a time s':>16} {'batched s':>10} {'recon/s':>8} {'speed-up':>9}")
        for name in names:
            data_name, model_name, model_params = TARGETS[name]
            observations = captures(data_name, model_name, model_params, args.uploads)
            one = build_attack(name, attack_params(name, args.iterations, 1, args.device, generator))
            many = build_attack(name, attack_params(name, args.iterations, args.restarts, args.device, generator))
            build_attack(name, attack_params(name, 2, 1, args.device, generator)).reconstruct_many(
                [observations[0]], 0
            )[0]  # warm-up
            sequential = timed(
                lambda: [one.reconstruct_many([o], 0)[0] for o in observations for _ in range(args.restarts)]
            )
            batched = timed(lambda: many.reconstruct_many(observations, 0))
            print(
                f"{name:14} {model_name:8} {sequential:>16.2f} {batched:>10.2f} {args.uploads / batched:>8.2f} "
                f"{sequential / batched:>8.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
