"""A cold ``fedguard.run`` beside warm ones (``warm=True``: one Ray cluster and runner kept for the process) of the
same small configuration, in one script.

The configuration: the quickstart preset cut to ``--clients`` clients, ``--rounds`` rounds and ``--iterations`` IG
iterations (one restart), so that start-up is a large part of a run. It runs cold once, then warm ``--warm``
times, each into its own folder under ``--out``; the first warm run pays for the runtime's start, the next ones
show what a researcher's loop costs. Per run it prints the wall time and the seconds outside its rounds and
attacks (before its first round and after its last round or attack, from its rows' ``at``); then the
cold run's wall time over the median of the warm runs after the first, and whether every run's accuracy, loss
and attack scores equal the cold run's.

    .venv/bin/python benchmarks/warm_run.py [--out runs/bench-warm-run] [--warm 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

from warm_sweep import outside, results  # this folder's: the same measures of a run

import fedguard

PRESET = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.toml"


def timed_run(folder: Path, overrides: list[str], warm: bool) -> tuple[float, float]:
    """Run the configuration into ``folder``; its wall seconds and its seconds outside rounds and attacks."""
    shutil.rmtree(folder, ignore_errors=True)
    begun = time.perf_counter()
    fedguard.run(PRESET, out=folder, overrides=overrides, progress=None, warm=warm)
    wall = time.perf_counter() - begun
    return wall, outside(folder, wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-warm-run"))
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warm", type=int, default=3, help="warm runs (at least 2: the first starts the runtime)")
    args = parser.parse_args()
    overrides = [f"partition.num-clients={args.clients}", f"train.clients-per-round={args.clients}"]
    overrides += [f"train.rounds={args.rounds}", f"attack.ig.iterations={args.iterations}", "attack.ig.restarts=1"]
    out = args.out.absolute()
    cold, cold_outside = timed_run(out / "cold", overrides, warm=False)
    print(f"cold:   {cold:5.1f} s; outside rounds and attacks {cold_outside:4.1f} s")
    warm_walls = []
    for index in range(1, max(2, args.warm) + 1):
        wall, wall_outside = timed_run(out / f"warm-{index}", overrides, warm=True)
        warm_walls.append(wall)
        print(f"warm {index}: {wall:5.1f} s; outside rounds and attacks {wall_outside:4.1f} s")
    fedguard.close()
    kept = statistics.median(warm_walls[1:])
    print(f"cold / warm (median of the warm runs after the first): {cold / kept:.2f}x")
    equal = all(results(out / f"warm-{i}") == results(out / "cold") for i in range(1, len(warm_walls) + 1))
    print(f"every warm run's accuracy, loss and attack scores equal the cold run's: {equal}")


if __name__ == "__main__":
    main()
