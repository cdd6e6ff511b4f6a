"""fc-span beside Inverting Gradients on the same captured uploads of the defenses preset's realistic setting.

The uploads are those of real runs: ``fedguard sweep experiments/defenses.toml --only realistic/none`` at
``--seeds`` for one round, every client of the round captured (``capture.per-round`` = ``--per-round``), FedAvg with
2 local epochs in reshuffled batches of 8 over at most 16 digits, the MLP with BatchNorm in training mode. The sweep
is run into ``--capture`` unless that folder already holds it. Both attacks then run in this process on the same
observations, each scored against the clients' true batches (the vault, which neither attack reads): fc-span with
its defaults, IG with the realistic setting's parameters (``--ig-iterations`` 500, one restart, TV 1e-4, replaying
the declared local epochs; ``--ig-uploads`` caps how many uploads IG attacks, its slowest part). Prints, per
attack: uploads, images, mean SSIM with its 95 % bootstrap interval over images, the share of images above SSIM
0.9, seconds per upload, and fc-span's speed-up over IG.

    .venv/bin/python benchmarks/fc_span_vs_ig.py [--capture runs/bench-fc-span] [--seeds 0,1,2] [--per-round 16]
        [--ig-uploads 6] [--ig-iterations 500] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from attackers.base import build_attack
from attackers.fc_span import SpanParams
from attackers.inverting_gradients import InvertingGradientsParams
from fedguard.metrics import score_batch
from fedguard.metrics.scoring import LEAK_SSIM
from fedguard.observation import Observation
from fedguard.store.observation_files import load_observations
from fedguard.store.vault import read_truth

PRESET = Path(__file__).resolve().parents[1] / "experiments" / "defenses.toml"


def capture(folder: Path, seeds: list[int], per_round: int) -> list[Path]:
    """The run folders of the realistic/none cell at ``seeds``, one round, ``per_round`` clients captured (the sweep
    is run when a seed's folder is missing)."""
    runs = [folder / "realistic" / "none" / f"seed-{seed}" for seed in seeds]
    if not all((run / "status.json").exists() for run in runs):
        command = [sys.executable, "-m", "fedguard", "sweep", str(PRESET), "--only", "realistic/none"]
        command += ["--seeds", ",".join(map(str, seeds)), "--out", str(folder)]
        for key in ("train.rounds=1", "capture.rounds=1", f"capture.per-round={per_round}", "attack.name=fc-span"):
            command += ["--set", key]
        subprocess.run(command, check=True)
    return runs


def attacked(name: str, params: Any, uploads: list[tuple[Path, Observation]]) -> dict[str, Any]:
    """SSIM per true image and seconds per upload of attack ``name`` on ``uploads`` (run folder, observation)."""
    attack = build_attack(name, params)
    ssim: list[float] = []
    seconds: list[float] = []
    for run, obs in uploads:
        truth = read_truth(run / "vault", obs.round, obs.client)
        if truth is None:
            raise SystemExit(f"{run}: no true batch for round {obs.round} client {obs.client} in its vault")
        start = time.perf_counter()
        [rec] = attack.reconstruct_many([obs], 0)
        seconds.append(time.perf_counter() - start)
        ssim += [image["ssim"] for image in score_batch(rec.images, truth[0])["per_image"]]
    return {"attack": name, "uploads": len(uploads), "ssim": ssim, "seconds": seconds}


def interval(values: np.ndarray, draws: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of the mean of ``values``."""
    rng = np.random.default_rng(0)
    means = rng.choice(values, size=(draws, len(values))).mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capture", type=Path, default=Path("runs/bench-fc-span"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--per-round", type=int, default=16)
    parser.add_argument("--ig-uploads", type=int, default=6)
    parser.add_argument("--ig-iterations", type=int, default=500)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = capture(args.capture, [int(s) for s in args.seeds.split(",")], args.per_round)
    uploads = [(run, obs) for run in runs for obs in load_observations(run / "observations")]
    rows = [attacked("fc-span", SpanParams(), uploads)]
    ig = InvertingGradientsParams(iterations=args.ig_iterations, restarts=1, tv=1e-4)
    rows.append(attacked("ig", ig, uploads[: args.ig_uploads]))
    print(f"{len(runs)} seeds, {len(uploads)} uploads of the realistic setting, round 1, undefended")
    print(f"{'attack':<8} {'uploads':>7} {'images':>6} {'mean SSIM [95% CI]':>22} {'> 0.9':>6} {'s/upload':>9}")
    for row in rows:
        ssim = np.array(row["ssim"])
        low, high = interval(ssim)
        print(
            f"{row['attack']:<8} {row['uploads']:>7} {len(ssim):>6} {ssim.mean():>8.3f} [{low:.3f}, {high:.3f}] "
            f"{(ssim > LEAK_SSIM).mean():>6.0%} {np.mean(row['seconds']):>9.2f}"
        )
    speed = np.mean(rows[1]["seconds"]) / np.mean(rows[0]["seconds"])
    print(f"ig's seconds per upload over fc-span's: {speed:.2f} (ig's first upload includes its compilation)")
    if args.out:
        args.out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
