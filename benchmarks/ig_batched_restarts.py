"""Inverting Gradients: restarts batched in one tensor program vs the same restarts one after another.

Both sides run the same attack code on the same captured upload; the batched
side runs R restarts in one call, the sequential side R calls of one restart.
Prints seconds and the speed-up per model.

    .venv/bin/python benchmarks/ig_batched_restarts.py [--restarts 8] [--iterations 50] [--threads 1]
        [--models lenet,mlp,convnet,resnet18]
"""

from __future__ import annotations

import argparse
import time

import torch

from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from fedguard.data import load_dataset
from fedguard.models import build_model
from fedguard.models.convnet import ConvNetParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import compute_gradients, get_arrays, trainable_mask


def capture(model_name: str, params: object, batch: int) -> Observation:
    data = load_dataset("photos")
    torch.manual_seed(0)
    model = build_model(model_name, data.spec, params)
    arrays = get_arrays(model)
    x, y = data.test.batch(list(range(batch)))
    grads, _ = compute_gradients(model, x, y)
    upload = [g.numpy() for g in grads]
    card = ModelCard(
        model_name,
        {} if params is None else vars(params),
        data.spec,
        tuple(model.state_dict()),
        tuple(trainable_mask(model)),
    )
    full = iter(upload)
    merged = [next(full) if t else a for a, t in zip(arrays, card.trainable)]
    return card.observe(1, 0, "gradient", arrays, merged, batch, {"batch-size": batch})


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--restarts", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="lenet,mlp,convnet", help="comma-separated: lenet, mlp, convnet, resnet18")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    known = {"lenet": None, "mlp": None, "convnet": ConvNetParams(width=16), "resnet18": None}
    unknown = [m for m in args.models.split(",") if m not in known]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    models = [(name, known[name]) for name in args.models.split(",")]
    print(f"{'model':10} {'restarts':>8} {'sequential s':>13} {'batched s':>10} {'speed-up':>9} {'restart-it/s':>13}")
    for name, params in models:
        obs = capture(name, params, batch=1)
        one = InvertingGradientsParams(iterations=args.iterations, restarts=1, device=args.device)
        many = InvertingGradientsParams(iterations=args.iterations, restarts=args.restarts, device=args.device)
        InvertingGradients(InvertingGradientsParams(iterations=2, restarts=2, device=args.device)).reconstruct_many(
            [obs], 0
        )[0]
        sequential = timed(
            lambda: [InvertingGradients(one).reconstruct_many([obs], 0)[0] for _ in range(args.restarts)]
        )
        batched = timed(lambda: InvertingGradients(many).reconstruct_many([obs], 0)[0])
        rate = args.restarts * args.iterations / batched
        print(
            f"{name:10} {args.restarts:>8} {sequential:>13.2f} {batched:>10.2f} "
            f"{sequential / batched:>8.2f}x {rate:>13.0f}"
        )


if __name__ == "__main__":
    main()
