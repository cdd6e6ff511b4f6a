"""Class fishing against batch size: the best SSIM of the images the attack returns per batch.

Per model and batch size, ``--batches`` batches of held-out 32x32 photo tiles (or of ``--data``'s held-out images;
drawn at random, seeded); the
server fishes the class of a tile drawn from each batch (the paper's attacker targets a user's image), the
client computes its FedSGD gradient on the fished model, and the ``fishing`` attack inverts it as that of one
image (``--images one``, the paper's) or of as many as it counts (``--images counted``). A row per batch: how
many tiles of the target class it held, how many the attack counted and inverted, and the evaluator's scores
of the reconstruction (``score_batch``: the best-matching true tile counts). The table gives the mean best
SSIM and the share of batches with an image above SSIM 0.6 (``RECOVERED_SSIM``), how many of those matched a
tile of the target class (the others are chance likenesses among the batch's tiles), and the same over the
batches holding one tile of the target class.

    python benchmarks/fishing_batch_sizes.py --models lenet,convnet --batch-sizes 8,32 --batches 4 --out rows.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attackers.base import build_attack
from attackers.fishing import FishingAttackParams, FishingParams, build_fishing
from fedguard.data import load_dataset
from fedguard.data.dataset import ImageData
from fedguard.metrics import score_batch
from fedguard.models import build_model
from fedguard.models.convnet import ConvNetParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import (
    get_arrays,
    gradient_upload,
    set_arrays,
    trainable_mask,
)

MODELS = ("lenet", "convnet")
RECOVERED_SSIM = 0.6  # a batch counts as leaking when its best-matched tile scores above this SSIM


def fished_upload(
    data: ImageData, model_name: str, width: int, indices: np.ndarray, target: int, seed: int
) -> Observation:
    """The FedSGD upload of the test tiles ``indices`` on a fresh model (``seed``) fished for ``target``."""
    torch.manual_seed(seed)
    params = ConvNetParams(width=width) if model_name == "convnet" else None
    model_params = {"width": width} if model_name == "convnet" else {}
    model = build_model(model_name, data.spec, params)
    card = ModelCard(model_name, model_params, data.spec, tuple(model.state_dict()), tuple(trainable_mask(model)))
    sent = build_fishing(FishingParams(target=target))(get_arrays(model), card, np.random.default_rng(seed))
    set_arrays(model, sent)
    x, y = data.test.batch(indices)
    arrays = gradient_upload(model, x, y)
    return card.observe(1, seed, "gradient", sent, arrays, len(y), {"batch-size": len(y)}, manipulation="fishing")


def measure(args: argparse.Namespace, model_name: str, batch_size: int) -> list[dict[str, Any]]:
    """One row per batch of ``batch_size`` tiles: the attack's reconstruction scored against the batch."""
    data = load_dataset(args.data)
    rng = np.random.default_rng([args.seed, batch_size])
    draws = [rng.choice(len(data.test), batch_size, replace=False) for _ in range(args.batches)]
    _, labels = data.test.batch()
    targets = [int(labels[rng.choice(d)]) for d in draws]
    uploads = [
        fished_upload(data, model_name, args.width, d, t, args.seed + b) for b, (d, t) in enumerate(zip(draws, targets))
    ]
    attack = build_attack(
        "fishing",
        FishingAttackParams(
            iterations=args.iterations,
            lr=args.lr,
            tv=args.tv,
            schedule=args.schedule,
            device=args.device,
            compile=args.compile,
            images=args.images,
            max_images=args.max_images,
        ),
    )
    start = time.perf_counter()
    recons = attack.reconstruct_many(uploads, args.seed)
    seconds = (time.perf_counter() - start) / len(uploads)
    rows = []
    for b, (d, target, recon) in enumerate(zip(draws, targets, recons)):
        x, y = data.test.batch(d)
        scores = score_batch(recon.images, x)
        best = max(range(batch_size), key=lambda i: scores["per_image"][i]["ssim"])
        rows.append(
            {
                "model": (model_name if model_name != "convnet" else f"convnet-{args.width}")
                + ("" if args.data == "photos" else f" on {args.data}"),
                "images": args.images,
                "batch_size": batch_size,
                "batch": b,
                "target_class": target,
                "target_examples": int((y == target).sum()),
                "counted": recon.stats["target_examples"],
                "inverted": recon.stats["images_inverted"],
                "best_ssim": round(scores["per_image"][best]["ssim"], 4),
                "best_psnr": round(scores["per_image"][best]["psnr"], 2),
                "best_is_target_class": int(y[best]) == target,
                "iterations": args.iterations,
                "seconds": round(seconds, 1),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per model, ``images`` option and batch size, mean best SSIM and the share of batches above
    ``RECOVERED_SSIM``, over all batches and over those with one tile of the target class."""

    def summary(part: list[dict[str, Any]]) -> str:
        if not part:
            return "-"
        best = [r["best_ssim"] for r in part]
        return f"{np.mean(best):.3f} / {sum(s > RECOVERED_SSIM for s in best)} of {len(best)}"

    def of_class(part: list[dict[str, Any]]) -> int:
        return sum(r["best_ssim"] > RECOVERED_SSIM and r["best_is_target_class"] for r in part)

    lines = [
        f"| model | images | batch | best SSIM, mean / batches above {RECOVERED_SSIM:g} "
        "| of those, a tile of the class | the same, one tile of the class | tiles of the class (mean) | s per batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, images, size in sorted({(r["model"], r["images"], r["batch_size"]) for r in rows}):
        part = [r for r in rows if (r["model"], r["images"], r["batch_size"]) == (model, images, size)]
        alone = [r for r in part if r["target_examples"] == 1]
        examples = np.mean([r["target_examples"] for r in part])
        lines.append(
            f"| {model} | {images} | {size} | {summary(part)} | {of_class(part)} | {summary(alone)} | {examples:.1f} "
            f"| {part[0]['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="lenet,convnet", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--width", type=int, default=16, help="ConvNet width (64: the paper's)")
    parser.add_argument("--data", default="photos", help="data set whose held-out images make the batches")
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--batches", type=int, default=4, help="batches per model and batch size")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=0.025)
    parser.add_argument("--tv", type=float, default=0.01)
    parser.add_argument("--schedule", default="step")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--images", default="one", help="what the attack inverts: one, counted")
    parser.add_argument("--max-images", type=int, default=8, help="the most images 'counted' inverts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"models {unknown}: choose from {', '.join(MODELS)}")
    torch.set_num_threads(1) if args.device == "cpu" else None
    rows = []
    for model in models:
        for size in (int(s) for s in args.batch_sizes.split(",")):
            part = measure(args, model, size)
            for row in part:
                print(json.dumps(row), flush=True)
            rows += part
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
