"""CENSOR: seconds per defended client step vs the undefended step, and how often the fallback fires.

The undefended step is the FedSGD local step (batch gradient in train mode); the defended step adds CENSOR
with T trials. Also times CENSOR's probe losses batched with vmap against T + 1 forward passes one by one.

    .venv/bin/python benchmarks/censor_step_time.py [--trials 20] [--batch 32] [--repeats 10] [--threads 1]
        [--models mlp,lenet] [--probe-lr 0.5]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from fedguard.data import load_dataset
from fedguard.defenses.base import LocalStep
from fedguard.defenses.censor import FALLBACKS_KEY, Censor, CensorParams, probe_losses
from fedguard.models import build_model
from fedguard.training import compute_gradients, loss_fn


def seconds(work, repeats: int) -> float:
    """Median wall-clock seconds of ``work()`` over ``repeats`` calls, after one warm-up call."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def losses_one_by_one(step: LocalStep, candidates: list[torch.Tensor], probe_lr: float) -> list[float]:
    """The T + 1 probe losses by separate forward passes of a model copy."""
    model = copy.deepcopy(step.model)
    params = [p for p in model.parameters() if p.requires_grad]
    originals = [p.detach().clone() for p in params]
    out = []
    with torch.no_grad():
        for t in range(candidates[0].shape[0] + 1):
            for p, o, c in zip(params, originals, candidates):
                p.copy_(o if t == len(c) else o - probe_lr * c[t])
            out.append(float(step.loss_fn(model(step.x), step.y)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="mlp,lenet")
    parser.add_argument("--probe-lr", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = load_dataset("photos")
    x, y = data.train.batch(list(range(args.batch)))
    defense = Censor(CensorParams(trials=args.trials, probe_lr=args.probe_lr))
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = build_model(name, data.spec)
        seeds = iter(range(10**6))

        def undefended() -> list[torch.Tensor]:
            return compute_gradients(model, x, y)[0]

        def defended(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            step = LocalStep(model, x, y, undefended(), loss_fn, torch.Generator().manual_seed(next(seeds)))
            return defense(step, state)

        state: dict[str, torch.Tensor] = {}
        plain, guarded = seconds(undefended, args.repeats), seconds(lambda: defended(state), args.repeats)
        step = LocalStep(model, x, y, undefended(), loss_fn, torch.Generator().manual_seed(0))
        candidates = defense.candidates(step.grads, step.generator)
        batched = seconds(lambda: probe_losses(step, candidates, args.probe_lr), args.repeats)
        looped = seconds(lambda: losses_one_by_one(step, candidates, args.probe_lr), args.repeats)
        print(f"{name:6s} B={args.batch} T={args.trials}: undefended {plain * 1e3:8.2f} ms, defended "
              f"{guarded * 1e3:8.2f} ms ({guarded / plain:5.1f}x); probe losses vmap {batched * 1e3:8.2f} ms vs "
              f"loop {looped * 1e3:8.2f} ms; fallbacks {int(state[FALLBACKS_KEY])}/{args.repeats + 1}")


if __name__ == "__main__":
    main()
