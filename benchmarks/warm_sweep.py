"""A sweep whose runs run one after another in one warm runner on one Ray cluster (``fedguard.runtime.warm``)
beside the same sweep whose runs are each their own ``fedguard run`` with its own Ray cluster (``--cold``), in one
script on the same runs.

The runs: ``experiments/defenses.toml``'s trained setting, ``--variants`` (none, prune, dgp) at ``--seeds``, cut to
``--rounds`` rounds with the attack in round 1 at ``--iterations`` IG iterations, so that start-up is a large part of
each run. Each sweep runs into its own folder under ``--out``; the warm one first (``warm=True``), then the
cold one (``warm=False, share_ray=False``). Per sweep it prints the wall time, the seconds per run outside its
rounds and attacks (the run's wall time, from the sweep's progress lines, less the span from its first round's
start to its last round or attack row, from the rows' ``at``: the median over the runs), and the ratio of the
two; then whether every run's accuracy, loss and attack scores are equal in both.

    .venv/bin/python benchmarks/warm_sweep.py [--out runs/bench-warm-sweep] [--seeds 0] [--rounds 3]
    .venv/bin/python benchmarks/warm_sweep.py --as-is --warm-only --only trained/none --only realistic/none ...

With ``--as-is`` the runs are the preset's own (``--only`` chooses them), each with its attacks and rounds as a
sweep of the preset runs them; ``--warm-only`` skips the cold sweep.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from fedguard.commands.sweep import load_sweep, run_sweep
from fedguard.store.rows import busy_span, read_attacks, read_rounds

PRESET = Path(__file__).resolve().parents[1] / "experiments" / "defenses.toml"


def timed_sweep(folder: Path, args: argparse.Namespace, warm: bool) -> tuple[float, dict[Path, float]]:
    """Run the sweep into ``folder``: its wall seconds, and each run folder's wall seconds."""
    shutil.rmtree(folder, ignore_errors=True)
    overrides = [f"train.rounds={args.rounds}", "capture.rounds=1", f"attack.ig.iterations={args.iterations}"]
    overrides += [f"attack.ig-adaptive.iterations={args.iterations}"]
    only = args.only or [f"trained/{v}" for v in args.variants]
    sweep = load_sweep(PRESET, folder, [] if args.as_is else overrides, only, args.seeds)
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
    run_sweep(sweep, progress, share_ray=warm, warm=warm)
    return time.perf_counter() - begun, walls


def outside(folder: Path, wall: float) -> float:
    """Seconds of a run before its first round and after its last round or attack: its wall time less its rows'
    span (``fedguard.store.rows.busy_span``), during which attacks run beside the rounds."""
    span = busy_span(folder)
    assert span is not None, f"{folder}: no round rows with their time"
    return wall - (span[1] - span[0])


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
    parser.add_argument("--only", action="append", default=[], metavar="SETTING/VARIANT", help="instead of --variants")
    parser.add_argument("--as-is", action="store_true", help="the runs as the preset has them: no cut")
    parser.add_argument("--warm-only", action="store_true", help="the warm sweep alone (no cold one, no ratio)")
    args = parser.parse_args()
    measured = {}
    for name, share in (("warm", True), ("cold", False))[: 1 if args.warm_only else 2]:
        wall, walls = timed_sweep(args.out / name, args, share)
        measured[name] = (wall, {run.relative_to(args.out / name): outside(run, w) for run, w in walls.items()})
        for run, seconds in sorted(measured[name][1].items()):
            print(f"  {run}: {walls[args.out / name / run]:.1f} s, outside rounds and attacks {seconds:.1f} s")
        median = statistics.median(measured[name][1].values())
        print(f"{name}: {len(walls)} runs in {wall:.1f} s; outside rounds and attacks {median:.1f} s a run (median)")
    if args.warm_only:
        return
    (warm, warm_runs), (cold, cold_runs) = measured["warm"], measured["cold"]
    print(
        f"cold / warm: {cold / warm:.2f}x the wall time; "
        f"{statistics.median(cold_runs.values()) / statistics.median(warm_runs.values()):.2f}x the time outside"
    )
    equal = all(results(args.out / "warm" / run) == results(args.out / "cold" / run) for run in warm_runs)
    print(f"every run's accuracy, loss and attack scores equal in both: {equal}")


if __name__ == "__main__":
    main()
