"""Which configuration of an optimization attack reconstructs best at a fixed budget: the evidence behind its defaults.

On the inputs of ``vs_breaching.py`` (U batch-1 FedSGD gradients of distinct
held-out 32x32 photos, one model built with ``--seed``), every configuration of
the attack's grid runs with the same budget of job-iterations per upload
(``restarts x iterations``) and is scored against the true images: mean PSNR
(dB), mean SSIM, uploads with SSIM > 0.9, seconds. The row marked ``*`` is the
attack's current default; the table is sorted by mean SSIM.

    .venv/bin/python benchmarks/attack_defaults.py [--case ig-lenet|ig-convnet|dlg-lenet]
        [--uploads 8] [--budget N] [--seed 0] [--threads N] [--settings "lr=0.1,tv=0.5;tv=0.01"]
        [--precision float32|bfloat16]

Grids: ig varies lr, the TV weight and restarts (iterations = budget / restarts);
dlg (L-BFGS) varies the line search, the history and restarts (6,000 iterations:
the 300 steps of ``torch.optim.LBFGS``, 20 iterations each, of the DLG code).
``--settings`` runs only the given settings (``;`` between settings, ``,``
between parameters; restarts default to 1) instead of the grid; ``--precision``
sets the attack's ``precision`` (attacks that have one).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
from typing import Any, Iterator

import torch

from attackers.base import ATTACKS
from attackers.engine.spec import PRECISIONS
from vs_breaching import CASES, capture, run_fedguard, score

DEFAULT_BUDGET = {"ig": 2000, "dlg": 6000}


def ig_grid(budget: int) -> Iterator[dict[str, Any]]:
    """lr x TV weight x restarts, iterations filling the budget."""
    for lr, tv, restarts in itertools.product((0.025, 0.1), (1e-4, 1e-2, 0.2, 0.5), (1, 2)):
        yield {"lr": lr, "tv": tv, "restarts": restarts, "iterations": budget // restarts}


def dlg_grid(budget: int) -> Iterator[dict[str, Any]]:
    """Line search x history x restarts, iterations filling the budget."""
    for search, history, restarts in (("none", 10, 1), ("none", 100, 1), ("fractions", 10, 1), ("fractions", 100, 1),
                                      ("fractions", 10, 4)):
        yield {"line_search": search, "history": history, "restarts": restarts, "iterations": budget // restarts}


GRIDS = {"ig": ig_grid, "dlg": dlg_grid}


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
        setting["iterations"] = budget // setting.get("restarts", 1)
        settings.append(setting)
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="ig-lenet", choices=sorted(CASES))
    parser.add_argument("--uploads", type=int, default=8)
    parser.add_argument("--budget", type=int, help="job-iterations per upload (default: ig 2000, dlg 6000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--settings", help="only these settings, e.g. 'lr=0.1,tv=0.5;tv=0.01' (default: the grid)")
    parser.add_argument("--precision", default="float32", choices=list(PRECISIONS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    case = CASES[args.case]
    attack = case.fedguard
    budget = args.budget or DEFAULT_BUDGET[attack]
    default = ATTACKS.get(attack).params()
    if hasattr(default, "precision"):
        default = dataclasses.replace(default, precision=args.precision)
    try:
        grid = parse_settings(args.settings, default, budget) if args.settings else list(GRIDS[attack](budget))
    except ValueError as error:
        parser.error(str(error))
    inputs = capture(case, args.uploads, args.seed)
    print(f"{attack} on {case.model_label}, {args.uploads} uploads, budget {budget} job-iterations per "
          f"upload, {args.threads} thread(s)", flush=True)
    rows = []
    for setting in grid:
        params = dataclasses.replace(default, device="cpu", **setting)
        seconds, recon = run_fedguard(attack, params, inputs.observations, True, args.seed)
        row = score("fedguard", case, attack, params.iterations, seconds, recon, inputs.truth)
        is_default = all(getattr(default, k) == v for k, v in setting.items() if k != "iterations")
        rows.append((setting, row, is_default))
        print(f"  {setting}: PSNR {row['psnr_db']:.2f} dB, SSIM {row['ssim']:.3f}, "
              f"{row['ssim_over_0.9']} > 0.9, {seconds:.1f} s", flush=True)
    print("\nsorted by mean SSIM (* current default):")
    for setting, row, is_default in sorted(rows, key=lambda r: -r[1]["ssim"]):
        text = ", ".join(f"{k}={v}" for k, v in setting.items())
        print(f"{'*' if is_default else ' '} {row['psnr_db']:6.2f} dB  SSIM {row['ssim']:.3f}  "
              f"{row['ssim_over_0.9']}/{row['uploads']} > 0.9  {row['seconds']:6.1f} s  {text}")


if __name__ == "__main__":
    main()
