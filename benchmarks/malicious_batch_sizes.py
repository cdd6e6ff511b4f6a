"""The malicious-server attacks at large batches, and imprint on FedAvg: the share of a batch recovered.

Each case sends a manipulated MLP (``--hidden`` units per hidden layer, two hidden layers) to one client, which
computes its upload as ``fedguard.protocols`` makes it on real held-in images: a FedSGD gradient of one batch,
or a FedAvg model after one local epoch (``examples`` images of ``--fedavg`` in its batches, so several local
SGD steps at each of ``--lrs``). The attack's images are matched to the true ones by MSE as the evaluator matches
them (``fedguard.metrics.match``); a true image is recovered when its match has SSIM above 0.9
(``LEAK_SSIM``) and, stricter, MSE at most 1e-3; the shares are averaged over ``--seeds`` draws of the images
and of the model's initialisation.

Cases: imprint with ``16 x batch`` bins (at most ``--hidden``) of each prior (``edges``): the paper's normal one
fitted to the data set's held-out split (``public-normal``, the default) and hand-set (``normal``, 0.45 +- 0.2),
and that split's quantiles (``public``), and trap weights (the paper's defaults), at each of ``--batches``; imprint on
FedAvg (``--fedavg examples,batch,bins``), each prior. The table's SSIM is the mean SSIM of the matches.
``--one-shot`` runs instead the one-shot layout at each batch (two units bounding the median bin of ``batch`` bins
of the fitted prior) over ``--seeds`` draws, and tabulates the draws whose targeted image came back.

    .venv/bin/python benchmarks/malicious_batch_sizes.py [--data mnist-5k] [--batches 8,32,128,256]
        [--hidden 4096] [--lrs 0.1,0.5] [--fedavg 64,32,1024] [--seeds 3] [--one-shot] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attackers.base import Reconstruction, build_attack
from attackers.imprint import ImprintParams
from attackers.manipulation import Manipulation, build_manipulation
from fedguard.data import load_dataset
from fedguard.data.dataset import ImageData, Split
from fedguard.data.spec import DataSpec
from fedguard.metrics import match
from fedguard.metrics.image import mse, ssim
from fedguard.metrics.scoring import LEAK_SSIM
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard, Observation
from fedguard.protocols import FedAvg, FedSGD, Schedule
from fedguard.training import get_arrays, merge_by_mask, set_arrays, split_by_mask, trainable_mask

EXACT_MSE = 1e-3  # a recovered image at most this far from the truth (mean squared error, pixels in [0, 1])
BINS_PER_IMAGE = 16  # imprint bins per image of the batch (at most the hidden units)
PROTOCOLS = {"fedsgd": FedSGD(), "fedavg": FedAvg()}


@dataclass(frozen=True)
class Case:
    """One measurement: ``attack`` (also the manipulation) with ``params`` (``label`` names them) on ``protocol``
    uploads of ``batch`` samples per step, ``examples`` images in all (one local epoch; ``batch`` on FedSGD),
    local learning rate ``lr`` (FedAvg; a FedSGD gradient does not depend on it)."""

    attack: str
    label: str
    params: Any
    protocol: str
    batch: int
    examples: int
    lr: float = 0.0


def capture_upload(
    manipulation: Manipulation,
    name: str,
    local: Split,
    spec: DataSpec,
    data: str,
    protocol: str,
    schedule: Schedule,
    hidden: int,
    seed: int,
) -> tuple[Observation, torch.Tensor]:
    """(the observation of one client's upload on every image of ``local`` from the MLP ``manipulation``
    rewrote, the true images (N, C, H, W)), the run's data set named ``data``. FedSGD: one batch of all of
    ``local``; FedAvg: one local epoch."""
    torch.manual_seed(seed)
    model = build_model("mlp", spec, MLPParams(hidden=hidden, depth=2))
    mask = trainable_mask(model)
    card = ModelCard("mlp", {"hidden": hidden, "depth": 2}, spec, tuple(model.state_dict()), tuple(mask), data)
    sent = manipulation(get_arrays(model), card, np.random.default_rng(seed))
    set_arrays(model, sent)
    client = PROTOCOLS[protocol]
    rng = np.random.default_rng(seed)
    if protocol == "fedsgd":
        update = client.local_step(model, local, Schedule(schedule.lr, len(local), 1), rng)
    else:
        x, y = local.batch()
        update = FedAvg().train_on(model, x, y, schedule, schedule.local_epochs, rng, 0.0)
    uploaded = client.upload(model, update.direction)
    arrays = merge_by_mask(uploaded, split_by_mask(get_arrays(update.buffers_from), mask)[1], mask)
    declared = update.declared.record()
    obs = card.observe(1, 0, client.upload_kind, sent, arrays, len(update.y), declared, manipulation=name)
    return obs, update.x


def recovered(recon: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """Shares of the true images (N, C, H, W) whose MSE-matched reconstruction has SSIM > ``LEAK_SSIM`` and
    MSE <= ``EXACT_MSE``, the mean SSIM of the matches and the best one."""
    paired = recon[torch.as_tensor(match(recon, truth, metric="mse"))]
    structure, errors = ssim(paired, truth), mse(paired, truth)
    return {
        "ssim_share": float((structure > LEAK_SSIM).double().mean()),
        "exact_share": float((errors <= EXACT_MSE).double().mean()),
        "mean_ssim": float(structure.mean()),
        "best_ssim": float(structure.max()),
    }


def run_once(case: Case, data: ImageData, hidden: int, seed: int) -> tuple[dict[str, float], int, int]:
    """(``recovered`` scores, local steps, images the attack believes pure) of ``case`` on a draw of
    ``case.examples`` training images of ``data`` and a model initialised, both under ``seed``."""
    picked = np.random.default_rng(seed).choice(len(data.train), size=case.examples, replace=False)
    local = Split(data.train.images[picked], data.train.labels[picked])
    manipulation = build_manipulation(case.attack, case.params)
    schedule = Schedule(case.lr, case.batch, 1)
    obs, truth = capture_upload(
        manipulation, case.attack, local, data.spec, data.name, case.protocol, schedule, hidden, seed
    )
    recon: Reconstruction = build_attack(case.attack).reconstruct_many([obs], seed)[0]
    return recovered(recon.images, truth), obs.declared.local_steps or 1, int(recon.stats["recovered"])


def run_case(case: Case, data: ImageData, hidden: int, seeds: int) -> dict[str, Any]:
    """One result row of ``case``: its scores averaged over ``seeds`` draws (seeds 0 .. seeds - 1), each draw's
    shares in ``per_seed``."""
    start = time.perf_counter()
    runs = [run_once(case, data, hidden, seed) for seed in range(seeds)]
    scores = [r[0] for r in runs]
    return {
        "data": data.name,
        "attack": case.attack,
        "variant": case.label,
        "protocol": case.protocol,
        "batch": case.batch,
        "examples": case.examples,
        "lr": case.lr if case.protocol == "fedavg" else None,
        "local_steps": runs[0][1],
        "bins": getattr(case.params, "bins", None),
        "hidden": hidden,
        **{key: float(np.mean([s[key] for s in scores])) for key in scores[0]},
        "per_seed": {key: [s[key] for s in scores] for key in ("ssim_share", "exact_share")},
        "believed": [r[2] for r in runs],
        "seconds": round(time.perf_counter() - start, 3),
    }


def imprint_cases(data: str, bins: int, protocol: str, batch: int, examples: int, lr: float = 0.0) -> list[Case]:
    """Imprint with ``bins`` bins of each prior: the default ``public-normal`` fitted to the run's data set's
    held-out split, ``normal`` with the hand-set mean and std, and ``public`` fitted to ``data``'s."""
    priors = [
        ImprintParams(bins=bins),
        ImprintParams(bins=bins, edges="normal"),
        ImprintParams(bins=bins, edges="public", public=data),
    ]
    return [Case("imprint", params.edges, params, protocol, batch, examples, lr) for params in priors]


def cases(data: str, batches: list[int], fedavg: tuple[int, int, int], lrs: list[float], hidden: int) -> list[Case]:
    """Imprint (``BINS_PER_IMAGE`` bins per image, at most ``hidden``, each prior) and trap weights at each
    FedSGD batch, then imprint on FedAvg (``fedavg`` = (examples, batch, bins), each prior) at each of ``lrs``."""
    out = []
    for batch in batches:
        out += imprint_cases(data, min(BINS_PER_IMAGE * batch, hidden), "fedsgd", batch, batch)
        out.append(Case("trap-weights", "paper", None, "fedsgd", batch, batch))
    examples, batch, bins = fedavg
    for lr in lrs:
        out += imprint_cases(data, bins, "fedavg", batch, examples, lr)
    return out


def one_shot_cases(batches: list[int]) -> list[Case]:
    """The one-shot layout at each FedSGD batch: two units bounding the median bin of ``batch`` bins."""
    return [
        Case("imprint", "one-shot", ImprintParams(bins=batch, layout="one-shot"), "fedsgd", batch, batch)
        for batch in batches
    ]


def one_shot_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per data set and batch, the draws in which the targeted image came back above SSIM 0.9 (one
    image of the batch: ``ssim_share`` = 1 / batch)."""
    head = "| data | batch | bins of the prior | draws with the targeted image back | mean SSIM of the best match |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        back = sum(share * r["examples"] >= 1 for share in r["per_seed"]["ssim_share"])
        draws = len(r["per_seed"]["ssim_share"])
        lines.append(f"| {r['data']} | {r['batch']} | {r['bins']} | {back} of {draws} | {r['best_ssim']:.3f} |")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the result rows."""
    head = "| data | attack | edges | protocol | lr | batch | images | steps | bins | SSIM > 0.9 | MSE <= 1e-3 | SSIM |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['data']} | {r['attack']} | {r['variant']} | {r['protocol']} | {r['lr'] or '-'} | {r['batch']} | "
            f"{r['examples']} | "
            f"{r['local_steps']} | {r['bins'] if r['bins'] is not None else '-'} | {r['ssim_share']:.0%} | "
            f"{r['exact_share']:.0%} | {r['mean_ssim']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="mnist-5k", help="data set (the clients' train split, the server's test)")
    parser.add_argument("--batches", default="8,32,128,256", help="FedSGD batch sizes, comma-separated")
    parser.add_argument("--hidden", type=int, default=4096, help="units per hidden layer of the MLP")
    parser.add_argument("--lrs", default="0.1,0.5", help="the clients' local learning rates (FedAvg), comma-separated")
    parser.add_argument("--fedavg", default="64,32,1024", help="FedAvg case: examples,batch,bins")
    parser.add_argument("--seeds", type=int, default=3, help="draws of images and model per case (seeds 0 ..)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--one-shot", action="store_true", help="only the one-shot layout, at each of --batches")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = load_dataset(args.data)
    batches = [int(b) for b in args.batches.split(",")]
    values = [int(v) for v in args.fedavg.split(",")]
    if len(values) != 3:
        raise SystemExit(f"--fedavg {args.fedavg!r}: give examples,batch,bins (e.g. 64,32,1024)")
    fedavg = (values[0], values[1], values[2])
    rows = []
    lrs = [float(v) for v in args.lrs.split(",")]
    chosen = one_shot_cases(batches) if args.one_shot else cases(args.data, batches, fedavg, lrs, args.hidden)
    for case in chosen:
        rows.append(run_case(case, data, args.hidden, args.seeds))
        print(json.dumps(rows[-1]), flush=True)
    print(one_shot_table(rows) if args.one_shot else table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
