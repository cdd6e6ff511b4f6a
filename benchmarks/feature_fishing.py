"""Feature fishing across rounds against batches of 32: rounds to isolate one image, and its inversion.

The held-out split of ``--data`` is cut in two at random (seeded): the server's public images, and the
clients' images the batches are drawn from. Per batch, a fresh DLG LeNet (seeded) and a row ``c`` drawn at
random; the server sends the model feature-fished at the thresholds ``ThresholdSearch`` picks from the public
projections and the counts, one a round, until two uploads of the batch enclose exactly one of its images or
``--rounds`` runs out. The difference of the two uploads, as one example's upload on the surrogate
(``isolated``), is inverted with the Inverting Gradients search. A row per batch: the rounds used, whether
an image was isolated, the best SSIM of the inverted image against the batch's images and whether that
image is the isolated one, and its SSIM against the isolated one. The table gives the batches with an
image above SSIM 0.6 (``RECOVERED_SSIM``) that is one of the batch's.

    python benchmarks/feature_fishing.py --data photos --batches 8 --device cpu --compile off
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attackers.engine.search import search
from attackers.feature_fishing import (
    FeatureFishingParams,
    ThresholdSearch,
    build_feature_fishing,
    isolated,
    one_example,
    projections,
    signed_count,
)
from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from fedguard.data import load_dataset
from fedguard.data.dataset import ImageData
from fedguard.metrics.image import ssim
from fedguard.models import build_model
from fedguard.observation import ModelCard, Observation
from fedguard.training import (
    get_arrays,
    gradient_upload,
    set_arrays,
    trainable_mask,
)

RECOVERED_SSIM = 0.6  # a batch counts as leaking when an image the attack returns scores above this SSIM


def upload(
    model: torch.nn.Module, card: ModelCard, sent: list[np.ndarray], x: torch.Tensor, y: torch.Tensor
) -> Observation:
    """The client's FedSGD upload of the batch (x, y) on the arrays ``sent``."""
    set_arrays(model, sent)
    arrays = gradient_upload(model, x, y)
    return card.observe(1, 0, "gradient", sent, arrays, len(y), {"batch-size": len(y)}, manipulation="feature-fishing")


def fish(
    data: ImageData, public: np.ndarray, indices: np.ndarray, seed: int, rounds: int
) -> tuple[Observation | None, dict[str, Any]]:
    """(the isolated upload or None, the batch's row so far): the server's search on the batch ``indices``
    with a fresh LeNet (``seed``), at most ``rounds`` rounds."""
    torch.manual_seed(seed)
    model = build_model("lenet", data.spec, None)
    card = ModelCard("lenet", {}, data.spec, tuple(model.state_dict()), tuple(trainable_mask(model)))
    honest = get_arrays(model)
    rng = np.random.default_rng(seed)
    target = int(rng.integers(data.spec.num_classes))
    x, y = data.test.batch(indices)
    server = ThresholdSearch(projections(model, data.test.batch(public)[0], target).numpy(), len(indices))
    truth = projections(model, x, target).numpy()
    uploads: dict[float, Observation] = {}
    while len(uploads) < rounds and (level := server.next_level()) is not None:
        params = FeatureFishingParams(target, server.threshold(level), server.scale)
        uploads[level] = upload(model, card, build_feature_fishing(params)(honest, card, rng), x, y)
        server.record(level, signed_count(uploads[level]))
    pair = server.found()
    row: dict[str, Any] = {"target": target, "rounds": len(uploads), "isolated": pair is not None}
    if pair is None:
        return None, row
    low, high = (server.threshold(u) for u in pair)
    row["isolated_index"] = int(np.flatnonzero((truth > low) & (truth <= high))[0])
    return one_example(isolated(uploads[pair[0]], uploads[pair[1]])), row


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per batch: the search's rounds and the inverted image's SSIMs against the batch."""
    data = load_dataset(args.data)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(data.test))
    public, private = order[: len(order) // 2], order[len(order) // 2 :]
    draws = [rng.choice(private, args.batch_size, replace=False) for _ in range(args.batches)]
    rows, found = [], []
    for b, d in enumerate(draws):
        start = time.perf_counter()
        obs, row = fish(data, public, d, args.seed + b, args.rounds)
        rows.append({"data": args.data, "batch": b, **row, "search_seconds": round(time.perf_counter() - start, 2)})
        found += [(b, obs)] if obs is not None else []
    params = InvertingGradientsParams(
        iterations=args.iterations, lr=args.lr, tv=args.tv, device=args.device, compile=args.compile
    )
    start = time.perf_counter()
    recons = search(InvertingGradients(params).spec, [obs for _, obs in found], args.seed)
    seconds = (time.perf_counter() - start) / max(len(found), 1)
    for (b, _), recon in zip(found, recons):
        x, _ = data.test.batch(draws[b])
        scores = ssim(recon.images[:1].expand_as(x), x)
        best = int(scores.argmax())
        rows[b].update(
            best_ssim=round(float(scores[best]), 4),
            best_is_isolated=best == rows[b]["isolated_index"],
            isolated_ssim=round(float(scores[rows[b]["isolated_index"]]), 4),
            invert_seconds=round(seconds, 1),
        )
    return rows


def table(rows: list[dict[str, Any]], iterations: int) -> str:
    """Markdown: per data set, batches, isolated, rounds, batches above ``RECOVERED_SSIM``, seconds."""
    lines = [
        f"| data | batches | isolated | rounds, median / max | best SSIM, mean / batches above {RECOVERED_SSIM:g} "
        "| of those, the isolated image | iterations | s per batch (search + inversion) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted({r["data"] for r in rows}):
        part = [r for r in rows if r["data"] == name]
        best = [r.get("best_ssim", 0.0) for r in part]
        above = [r for r in part if r.get("best_ssim", 0.0) > RECOVERED_SSIM]
        rounds = [r["rounds"] for r in part]
        seconds = np.mean([r["search_seconds"] + r.get("invert_seconds", 0.0) for r in part])
        lines.append(
            f"| {name} | {len(part)} | {sum(r['isolated'] for r in part)} | {np.median(rounds):g} / {max(rounds)} "
            f"| {np.mean(best):.3f} / {len(above)} of {len(part)} | {sum(r['best_is_isolated'] for r in above)} "
            f"| {iterations} | {seconds:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="photos", help="comma-separated data sets whose held-out images are used")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=16, help="the server's budget of rounds per batch")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=0.025)
    parser.add_argument("--tv", type=float, default=0.01)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1) if args.device == "cpu" else None
    rows = []
    for name in (n.strip() for n in args.data.split(",") if n.strip()):
        part = measure(argparse.Namespace(**{**vars(args), "data": name}))
        for row in part:
            print(json.dumps(row), flush=True)
        rows += part
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print(table(rows, args.iterations))


if __name__ == "__main__":
    main()
