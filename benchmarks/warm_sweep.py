"""A sweep whose runs share one Ray cluster (``fedguard.runtime.ray_head``) beside the same sweep whose runs each
start their own, in one script on the same runs.

The runs: ``experiments/defenses.toml``'s trained setting, ``--variants`` (none, prune, dgp) at ``--seeds``, cut to
``--rounds`` rounds with the attack in round 1 at ``--iterations`` IG iterations, so that start-up is a large part of
each run. Each sweep runs into its own folder under ``--out``; the warm one first (``share_ray=True``), then the
cold one. Per sweep it prints the wall time, the seconds per run outside its rounds and attacks (the run's wall
time, from the sweep's progress lines, less its rounds' and attacks' seconds in ``rounds.jsonl`` and
``attacks.jsonl``: the median over the runs), and the ratio of the two; then whether every run's accuracy,
loss and attack scores are equal in both.

    .venv/bin/python benchmarks/warm_sweep.py [--out runs/bench-warm-sweep] [--seeds 0] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from fedguard.commands.sweep import load_sweep, run_sweep
from fedguard.store.rows import read_attacks, read_rounds

PRESET = Path(__file__).resolve().parents[1] / "experiments" / "defenses.toml"


def timed_sweep(folder: Path, args: argparse.Namespace, share_ray: bool) -> tuple[float, dict[Path, float]]:
    """Run the sweep into ``folder``: its wall seconds, and each run folder's wall seconds."""
    shutil.rmtree(folder, ignore_errors=True)
    overrides = [f"train.rounds={args.rounds}", "capture.rounds=1", f"attack.ig.iterations={args.iterations}"]
    overrides += [f"attack.ig-adaptive.iterations={args.iterations}"]
    sweep = load_sweep(PRESET, folder, overrides, [f"trained/{v}" for v in args.variants], args.seeds)
    started: dict[str, float] = {}
    walls: dict[Path, float] = {}
    by_label = {f"{run.setting}/{run.variant} seed {run.seed}": run.folder for run in sweep.runs}

    def progress(line: str) -> None:
        label = next((name for name in by_label if f"] {name}:" in line), None)
        if label is None:
            return
        if "->" in line:
            started[label] = time.perf_counter()
        elif ": ok;" in line or ": failed" in line:
            walls[by_label[label]] = time.perf_counter() - started[label]

    begun = time.perf_counter()
    run_sweep(sweep, progress, share_ray=share_ray)
    return time.perf_counter() - begun, walls


def outside(folder: Path, wall: float) -> float:
    """Seconds of a run outside its rounds and attacks."""
    rounds = sum(float(r.get("seconds") or 0.0) for r in read_rounds(folder))
    attacks = sum(float(a.get("seconds") or 0.0) for a in read_attacks(folder))
    return wall - rounds - attacks


def results(folder: Path) -> tuple[Any, ...]:
    """What a run computed: accuracy and loss per round, SSIM and PSNR per attack row."""
    rounds = tuple((r["round"], r.get("accuracy"), r.get("loss")) for r in read_rounds(folder))
    attacks = tuple(
        sorted((a["attack"], a["round"], a["client"], a.get("ssim"), a.get("psnr")) for a in read_attacks(folder))
    )
    return rounds, attacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-warm-sweep"))
    parser.add_argument("--seeds", type=lambda text: [int(s) for s in text.split(",")], default=[0])
    parser.add_argument("--variants", type=lambda text: text.split(","), default=["none", "prune", "dgp"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    measured = {}
    for name, share in (("warm", True), ("cold", False)):
        wall, walls = timed_sweep(args.out / name, args, share)
        measured[name] = (wall, {run.relative_to(args.out / name): outside(run, w) for run, w in walls.items()})
        median = statistics.median(measured[name][1].values())
        print(f"{name}: {len(walls)} runs in {wall:.1f} s; outside rounds and attacks {median:.1f} s a run (median)")
    (warm, warm_runs), (cold, cold_runs) = measured["warm"], measured["cold"]
    print(
        f"cold / warm: {cold / warm:.2f}x the wall time; "
        f"{statistics.median(cold_runs.values()) / statistics.median(warm_runs.values()):.2f}x the time outside"
    )
    equal = all(results(args.out / "warm" / run) == results(args.out / "cold" / run) for run in warm_runs)
    print(f"every run's accuracy, loss and attack scores equal in both: {equal}")


if __name__ == "__main__":
    main()
