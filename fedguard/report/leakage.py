"""The ``privacy`` object of a sweep row: what the attacks recovered, image by image, over a cell's seeds.

The scored images of one attack in one round are pooled over the cell's seeds and clients (each image once)
and summarized by ``fedguard.report.statistics``: mean, median and bootstrap 95 % interval of PSNR (dB, capped
as in ``attacks.jsonl``), SSIM and LPIPS, and the success rate, the share of images with SSIM above
``SUCCESS_SSIM`` (recognisable; ``recovered_rate``: above ``RECOVERED_SSIM``, recovered). ``by_attack`` holds
them for every attack in every attacked round, ``per_round`` for each attacked round its best attack (highest
mean SSIM; on a tie the adaptive one); the headline is the best of those (the client's worst case, with its
round). That choice is the evaluator's, made after the fact over attacks that each chose their own restarts by
their own objective; no ground truth enters an attack.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedguard.metrics.scoring import LEAK_SSIM
from fedguard.report.statistics import over_images, success_rate
from fedguard.store.rows import AttackRow

SUCCESS_SSIM = 0.5
"""An image whose reconstruction has SSIM above this is recognisable (EVALUATION.md, point 3)."""
RECOVERED_SSIM = LEAK_SSIM
"""An image whose reconstruction has SSIM above this is recovered (0.9, the run's leaked-image count)."""
SCORES = ("psnr", "ssim", "lpips")


def image_leakage(attack: str, round_: int, rows: list[AttackRow], adaptive: bool) -> dict[str, Any]:
    """The statistics of every image that ``rows`` (scored ``attacks.jsonl`` rows of one attack in one round,
    from one or several seeds) scored: ``adaptive`` (the attack's trait, unless a row says it did not adapt:
    ``stats.adaptive`` false), ``n_images``, the ``seeds`` they came from, ``<score>_mean``,
    ``_median`` and ``_ci95`` ([low, high]) per score, success rates, and ``missing``: images without a score,
    per score (e.g. LPIPS without its weights)."""
    images = [image for row in rows for image in row.get("per_image") or []]
    result: dict[str, Any] = {
        "attack": attack,
        "adaptive": adaptive and all((row.get("stats") or {}).get("adaptive", True) for row in rows),
        "round": round_,
        "n_images": len(images),
        "seeds": sorted({row["seed"] for row in rows if isinstance(row.get("seed"), int)}),
    }
    missing = {}
    for score in SCORES:
        summary = over_images(image.get(score) for image in images)
        result.update({f"{score}_mean": summary.mean, f"{score}_median": summary.median, f"{score}_ci95": summary.ci95})
        missing[score] = summary.missing
    ssim = [image.get("ssim") for image in images]
    result.update(
        success_rate=success_rate(ssim, SUCCESS_SSIM),
        success_metric="ssim",
        success_threshold=SUCCESS_SSIM,
        recovered_rate=success_rate(ssim, RECOVERED_SSIM),
        recovered_threshold=RECOVERED_SSIM,
        missing=missing,
    )
    return result


def _ssim_key(leakage: dict[str, Any]) -> tuple[float, bool]:
    """Higher mean SSIM first; on a tie, the attack that knows the defense (it did as well, knowing it)."""
    return (leakage["ssim_mean"] if leakage["ssim_mean"] is not None else float("-inf"), leakage["adaptive"])


def privacy(rows: list[AttackRow], adaptive: Mapping[str, bool]) -> dict[str, Any] | None:
    """The headline leakage of a cell, its ``image_leakage`` with ``per_round`` and ``by_attack`` (every
    attack's ``image_leakage`` in every round it scored, by round then attack), from the scored rows (status
    'ok') of its runs; ``adaptive`` maps an attack's name to its trait. None when no image was scored."""
    groups: dict[int, dict[str, list[AttackRow]]] = {}
    for row in rows:
        if isinstance(row.get("round"), int) and row.get("per_image"):
            groups.setdefault(row["round"], {}).setdefault(str(row.get("attack")), []).append(row)
    by_attack = [
        image_leakage(attack, round_, group, adaptive.get(attack, False))
        for round_ in sorted(groups)
        for attack, group in groups[round_].items()
    ]
    per_round = [
        max((leak for leak in by_attack if leak["round"] == round_), key=_ssim_key) for round_ in sorted(groups)
    ]
    if not per_round:
        return None
    best = max(per_round, key=_ssim_key)
    return {**best, "per_round": per_round, "by_attack": by_attack}
