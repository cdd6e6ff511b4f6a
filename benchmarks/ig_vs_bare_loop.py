"""Inverting Gradients on ResNet-18: fedguard's engine against a bare PyTorch loop of the same maths, same inputs.

Both sides attack the same U batch-1 FedSGD gradients of distinct held-out
32x32 photos through one model (``--model``, default ResNet-18 with the CIFAR
stem; BatchNorm on batch statistics; built with ``--seed``) for N iterations, every upload's job in one program,
from the same uniform starting points. fedguard runs ``attack.ig`` (one restart,
its default ``lr`` and ``tv`` unless given) through ``reconstruct_many``. The
bare loop is that maths written out by hand in one function: per-sample
parameter gradients of the shared weights (``torch.func.vmap`` of
``torch.func.grad``), ``1 - cosine`` over every parameter plus ``tv`` times the
total variation, the sign of its gradient w.r.t. the images, torch's fused Adam,
the step decay at 3/8, 5/8 and 7/8 of the iterations and the clamp to [0, 1];
its step is compiled with ``torch.compile`` whenever fedguard's search compiles.
The bare loop is given the true labels; fedguard infers them from the
uploads (exact at batch 1; the report says whether they were). Each side runs a
few untimed iterations first (tracing, compiling); the timed calls include
everything each side does, fedguard's set-up, restart selection and copy to the
host included. Prints job-iterations per second, fedguard's ratio to the bare
loop, mean PSNR and SSIM of each side, the device and the peak device memory.

    make bench-bare-loop
    .venv/bin/python benchmarks/ig_vs_bare_loop.py [--device auto|cpu|cuda] [--model resnet18|convnet|lenet]
        [--uploads 32] [--iterations 500] [--lr LR] [--tv TV] [--threads N] [--seed 0]
        [--compile auto|on|off] [--out PATH]

Target of the project: fedguard's iterations per second within 1.5x of the bare
loop's on a GPU kept busy by the batch of uploads.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call, grad, replace_all_batch_norm_modules_, vmap
from vs_breaching import Case, Inputs, capture, check_layout, compiled, device_name, measured, score

from attackers.base import COMPILE_MODES, DEVICES, build_attack
from attackers.engine.terms import total_variation
from attackers.inverting_gradients import InvertingGradientsParams
from attackers.jobs import job_seed, resolve_device

HERE = Path(__file__).resolve().parent
WARM_UP_ITERATIONS = 2
MODELS = ("resnet18", "convnet", "lenet")


def bare_step(
    model: nn.Module, params: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], labels: torch.Tensor, tv: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``z (J, 1, C, H, W) -> sign of d/dz sum_j [1 - cos(g_j(z), target_j) + tv * TV(z_j)]``, ``g_j`` the
    parameter gradient of job j's image under the shared ``params``."""

    def loss_of(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    per_job = vmap(grad(loss_of), in_dims=(None, 0, 0))
    target_norm = torch.sqrt(sum((t.flatten(1) ** 2).sum(1) for t in targets.values()))

    def objective(z: torch.Tensor) -> torch.Tensor:
        g = per_job(params, z, labels)
        dot = sum((g[n] * targets[n]).flatten(1).sum(1) for n in targets)
        norm = torch.sqrt(sum((g[n] ** 2).flatten(1).sum(1) for n in targets))
        return (1 - dot / (norm * target_norm + 1e-12) + tv * total_variation(z).mean(1)).sum()

    direction = grad(objective)
    return lambda z: direction(z).sign()


def bare_loop(
    step: Callable[[torch.Tensor], torch.Tensor], starts: torch.Tensor, iterations: int, lr: float
) -> torch.Tensor:
    """Signed Adam (fused) with step decay and the [0, 1] box, ``iterations`` steps from ``starts``."""
    z = starts.clone().requires_grad_()
    optimizer = torch.optim.Adam([z], lr=lr, fused=True)
    milestones = [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    for _ in range(iterations):
        z.grad = step(z.detach())
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            z.clamp_(0, 1)
    return z.detach()


def bare_inputs(
    inputs: Inputs, device: torch.device
) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """(model on batch statistics, shared parameters, targets (U, ...) per parameter, true labels (U,)) on
    ``device``, read from the same observations fedguard gets."""
    model = copy.deepcopy(inputs.model)
    replace_all_batch_norm_modules_(model)
    model = model.train().to(device)
    check_layout(model, inputs.observations[0])
    params = {n: p.detach().to(device) for n, p in model.named_parameters()}
    uploads = [[torch.tensor(a) for a, t in zip(o.upload, o.trainable) if t] for o in inputs.observations]
    targets = {n: torch.stack([u[i] for u in uploads]).to(device) for i, n in enumerate(params)}
    return model, params, targets, inputs.labels.reshape(len(inputs.observations), -1).to(device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides' rows and the settings."""
    device = resolve_device(args.device)
    case = Case("ig", None, args.model, None, args.iterations)
    inputs = capture(case, args.uploads, args.seed)
    params = dataclasses.replace(
        InvertingGradientsParams(),
        iterations=args.iterations,
        restarts=1,
        device=device.type,
        compile=args.compile,
        **{k: v for k, v in (("lr", args.lr), ("tv", args.tv)) if v is not None},
    )
    compiles = compiled(params)
    attack = build_attack("ig", params)
    warm = build_attack(
        "ig", dataclasses.replace(params, iterations=WARM_UP_ITERATIONS, compile="on" if compiles else "off")
    )
    warm.reconstruct_many(inputs.observations, seed=args.seed)
    found: list[Any] = []

    def fedguard() -> torch.Tensor:
        found[:] = attack.reconstruct_many(inputs.observations, seed=args.seed)
        return torch.cat([r.images for r in found])

    fedguard_run = measured(device, fedguard)
    labels_exact = all(torch.equal(r.labels.cpu(), inputs.labels[i : i + 1]) for i, r in enumerate(found))

    model, shared, targets, labels = bare_inputs(inputs, device)
    starts = torch.stack(
        [
            torch.rand((1, *inputs.spec.shape), generator=torch.Generator().manual_seed(job_seed(args.seed, o, 0)))
            for o in inputs.observations
        ]
    ).to(device)
    step = bare_step(model, shared, targets, labels, params.tv)
    step = torch.compile(step, dynamic=False) if compiles else step
    bare_loop(step, starts, WARM_UP_ITERATIONS, params.lr)
    bare_run = measured(device, lambda: bare_loop(step, starts, params.iterations, params.lr).flatten(0, 1))

    rows = []
    for tool, timing in (("fedguard", fedguard_run), ("bare loop", bare_run)):
        row = score(
            tool, case, "ig", params.iterations, timing.seconds, timing.result, inputs.truth, timing.peak_memory_gib
        )
        row.update(job_iterations_per_s=args.uploads * params.iterations / timing.seconds)
        rows.append(row)
    rows[0]["vs_bare"] = rows[0]["job_iterations_per_s"] / rows[1]["job_iterations_per_s"]
    rows[0]["labels_exact"] = labels_exact
    return {
        "torch": torch.__version__,
        "device": device_name(device),
        "model": args.model,
        "threads": args.threads,
        "compiled": compiles,
        "uploads": args.uploads,
        "iterations": params.iterations,
        "lr": params.lr,
        "tv": params.tv,
        "seed": args.seed,
        "rows": rows,
    }


def print_report(report: dict[str, Any]) -> None:
    """The rows as plain aligned text."""
    print(
        f"{report['model']}, {report['uploads']} uploads x {report['iterations']} iterations, lr {report['lr']}, "
        f"tv {report['tv']}, compiled: {report['compiled']}, {report['device']}"
    )
    print(f"{'tool':10} {'seconds':>8} {'job-it/s':>9} {'PSNR dB':>8} {'SSIM':>6} {'peak GiB':>8}")
    for r in report["rows"]:
        memory = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        print(
            f"{r['tool']:10} {r['seconds']:8.2f} {r['job_iterations_per_s']:9.1f} {r['psnr_db']:8.2f} "
            f"{r['ssim']:6.3f} {memory:>8}"
        )
    first = report["rows"][0]
    print(
        f"fedguard at {first['vs_bare']:.2f}x the bare loop's iterations per second "
        f"(labels inferred exactly: {first['labels_exact']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--model", default="resnet18", choices=MODELS)
    parser.add_argument("--uploads", type=int, default=32, help="batch-1 uploads, one job each")
    parser.add_argument("--iterations", type=int, default=500, help="500 or more: compiled under 'auto'")
    parser.add_argument("--lr", type=float, help="Adam step (default: attack.ig's)")
    parser.add_argument("--tv", type=float, help="TV weight (default: attack.ig's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", default="auto", choices=COMPILE_MODES)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ig_vs_bare_loop.json")
    args = parser.parse_args()
    if args.uploads < 1 or args.iterations < 1 or args.threads < 1:
        parser.error("--uploads, --iterations and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    report = run(args)
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
