"""Which configuration of an optimization attack reconstructs best at a fixed budget: the evidence behind its defaults.

On the inputs of ``vs_breaching.py`` (U FedSGD gradients of distinct held-out
images, one model built with ``--seed``), every configuration of the attack's
grid runs with the same budget of job-iterations per upload (``restarts x
iterations``) and is scored against the true images (each upload's
reconstructions matched to its images by MSE): mean PSNR (dB), mean SSIM, images
with SSIM > 0.9, seconds. The row marked ``*`` is the attack's current default;
the table is sorted by mean SSIM.

Cases: those of ``vs_breaching.py`` (batch-1 uploads of 32x32 photos), and the
setting of the attacks preset (``experiments/attacks.toml``): batch-4
uploads of MNIST digits through the MLP of two hidden layers of 1,000 units,
BatchNorm in the second, attacked by ``gradinversion`` (its BatchNorm statistics
read off the upload's buffers) and ``ggl`` (a generator trained here on the
held-out split, as ``fedguard train-generator --data mnist-5k`` does, unless
``--generator`` names one).

    .venv/bin/python benchmarks/attack_defaults.py [--case ig-lenet|ig-convnet|dlg-lenet|gradinversion-mlp|ggl-mlp]
        [--uploads 8] [--budget N] [--seed 0] [--threads N] [--settings "lr=0.1,tv=0.5;tv=0.01"]
        [--precision float32|bfloat16] [--compile auto|on|off] [--generator PATH]

Grids: ig varies lr, the TV weight and restarts (iterations = budget / restarts), then the
learning-rate schedule;
dlg (L-BFGS) varies the line search, the history and restarts (6,000 iterations:
the 300 steps of ``torch.optim.LBFGS``, 20 iterations each, of the DLG code);
gradinversion varies lr, the TV weight and restarts, then the BatchNorm and group
weights one at a time; ggl varies lr and the KL weight, then the distance and
restarts one at a time.
``--settings`` runs only the given settings (``;`` between settings, ``,``
between parameters; restarts default to the attack's) instead of the grid; ``--precision``
sets the attack's ``precision`` (attacks that have one), ``--compile`` its ``compile``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vs_breaching import CASES, Case, capture, run_fedguard, score

from attackers.base import ATTACKS, COMPILE_MODES
from attackers.engine.spec import PRECISIONS
from fedguard.models.mlp import MLPParams

PRESET_MLP = MLPParams(hidden=1000, depth=2, batch_norm=True)
STUDY_CASES = {
    **CASES,
    "gradinversion-mlp": Case("gradinversion", None, "mlp", PRESET_MLP, 1000, data="mnist-5k", batch=4),
    "ggl-mlp": Case("ggl", None, "mlp", PRESET_MLP, 500, data="mnist-5k", batch=4),
}
DEFAULT_BUDGET = {"ig": 2000, "dlg": 6000, "gradinversion": 4000, "ggl": 2000}


def ig_grid(budget: int) -> Iterator[dict[str, Any]]:
    """lr x TV weight x restarts, iterations filling the budget, then the other schedules at the default's others."""
    for lr, tv, restarts in itertools.product((0.025, 0.1), (1e-4, 1e-2, 0.2, 0.5), (1, 2)):
        yield {"lr": lr, "tv": tv, "restarts": restarts, "iterations": budget // restarts}
    for schedule in ("cosine", "none"):
        yield {"schedule": schedule, "iterations": budget}


def dlg_grid(budget: int) -> Iterator[dict[str, Any]]:
    """Line search x history x restarts, iterations filling the budget."""
    for search, history, restarts in (
        ("none", 10, 1),
        ("none", 100, 1),
        ("fractions", 10, 1),
        ("fractions", 100, 1),
        ("fractions", 10, 4),
    ):
        yield {"line_search": search, "history": history, "restarts": restarts, "iterations": budget // restarts}


def gradinversion_grid(budget: int) -> Iterator[dict[str, Any]]:
    """lr x TV weight x restarts, then the BatchNorm and group weights one at a time at the default's others."""
    for lr, tv, restarts in itertools.product((0.1, 0.025), (1e-4, 1e-2), (4, 1)):
        yield {"lr": lr, "tv": tv, "restarts": restarts, "iterations": budget // restarts}
    for change in ({"bn": 1.0}, {"bn": 10.0}, {"group": 0.0}, {"group": 0.1}):
        yield {**change, "restarts": 4, "iterations": budget // 4}


def ggl_grid(budget: int) -> Iterator[dict[str, Any]]:
    """lr x KL weight, then the distance and restarts one at a time at the default's others."""
    for lr, kl in itertools.product((0.03, 0.1, 0.3), (0.0, 0.01, 0.1)):
        yield {"lr": lr, "kl": kl, "restarts": 4, "iterations": budget // 4}
    for change in ({"distance": "l2", "restarts": 4}, {"restarts": 1}, {"restarts": 8}):
        yield {**change, "iterations": budget // change["restarts"]}


GRIDS = {"ig": ig_grid, "dlg": dlg_grid, "gradinversion": gradinversion_grid, "ggl": ggl_grid}


def study_generator(path: str | None) -> str:
    """``path``, or a generator trained as ``fedguard train-generator --data mnist-5k`` does, in a temporary
    folder."""
    if path:
        return path
    from attackers.generators import save_generator, train_generator

    folder = Path(tempfile.mkdtemp(prefix="attack-defaults-"))
    print("training the generator on mnist-5k's held-out split (fedguard train-generator's defaults)", flush=True)
    return str(save_generator(train_generator("mnist-5k", "test"), folder / "mnist-5k.npz"))


def parse_settings(text: str, default: Any, budget: int) -> list[dict[str, Any]]:
    """``"lr=0.1,tv=0.5;tv=0.01"`` -> one dict per setting, values typed as the attack's parameters, iterations
    filling ``budget``; raises ``ValueError`` naming an unknown parameter and the choices."""
    settings = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        setting: dict[str, Any] = {}
        for pair in filter(None, (p.strip() for p in part.split(","))):
            name, _, value = pair.partition("=")
            name = name.strip()
            if not hasattr(default, name) or name == "iterations":
                choices = ", ".join(f.name for f in dataclasses.fields(default) if f.name != "iterations")
                raise ValueError(f"setting {name!r}: choose among {choices}")
            kind = type(getattr(default, name))
            try:
                setting[name] = kind(value.strip())
            except ValueError:
                raise ValueError(f"setting {name}={value.strip()!r}: not a {kind.__name__}") from None
        setting["iterations"] = budget // setting.get("restarts", default.restarts)
        settings.append(setting)
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="ig-lenet", choices=sorted(STUDY_CASES))
    parser.add_argument("--uploads", type=int, default=8)
    budgets = ", ".join(f"{name} {budget}" for name, budget in DEFAULT_BUDGET.items())
    parser.add_argument("--budget", type=int, help=f"job-iterations per upload (default: {budgets})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--settings", help="only these settings, e.g. 'lr=0.1,tv=0.5;tv=0.01' (default: the grid)")
    parser.add_argument("--precision", default="float32", choices=list(PRECISIONS))
    parser.add_argument("--compile", default="auto", choices=COMPILE_MODES, help="the attack's compile parameter")
    parser.add_argument("--generator", help="ggl's generator (.npz); default: one trained here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    case = STUDY_CASES[args.case]
    attack = case.fedguard
    budget = args.budget or DEFAULT_BUDGET[attack]
    default = ATTACKS.get(attack).params()
    if hasattr(default, "generator"):
        default = dataclasses.replace(default, generator=study_generator(args.generator))
    if hasattr(default, "precision"):
        default = dataclasses.replace(default, precision=args.precision)
    try:
        grid = parse_settings(args.settings, default, budget) if args.settings else list(GRIDS[attack](budget))
        runs = [dataclasses.replace(default, device="cpu", compile=args.compile, **setting) for setting in grid]
    except ValueError as error:
        parser.error(str(error))
    inputs = capture(case, args.uploads, args.seed)
    print(
        f"{attack} on {case.model_label}, {case.data}, {args.uploads} uploads of batch {case.batch}, budget "
        f"{budget} job-iterations per upload, {args.threads} thread(s)",
        flush=True,
    )
    rows = []
    for setting, params in zip(grid, runs):
        run = run_fedguard(attack, params, inputs.observations, True, args.seed)
        row = score("fedguard", case, attack, params.iterations, run.seconds, run.result, inputs.truth)
        is_default = all(getattr(default, k) == v for k, v in setting.items() if k != "iterations")
        rows.append((setting, row, is_default))
        print(
            f"  {setting}: PSNR {row['psnr_db']:.2f} dB, SSIM {row['ssim']:.3f}, "
            f"{row['ssim_over_0.9']} > 0.9, {run.seconds:.1f} s",
            flush=True,
        )
    print("\nsorted by mean SSIM (* current default):")
    for setting, row, is_default in sorted(rows, key=lambda r: -r[1]["ssim"]):
        text = ", ".join(f"{k}={v}" for k, v in setting.items())
        print(
            f"{'*' if is_default else ' '} {row['psnr_db']:6.2f} dB  SSIM {row['ssim']:.3f}  "
            f"{row['ssim_over_0.9']}/{row['uploads'] * case.batch} > 0.9  {row['seconds']:6.1f} s  {text}"
        )


if __name__ == "__main__":
    main()
