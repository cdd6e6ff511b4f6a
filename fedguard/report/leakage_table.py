"""Markdown of the leakage per attack and attacked round: one table per attacked setting of a sweep, a line per
(variant, attack), a column per round, each cell the mean SSIM over its images with the 95 % interval, the
round's best attack in bold (the one ``privacy``'s ``per_round`` names)."""

from __future__ import annotations

from typing import Any


def _ssim_cell(leak: dict[str, Any], best: bool, show_images: bool) -> str:
    if leak["ssim_mean"] is None:
        return "-"
    text = f"{leak['ssim_mean']:.2f}"
    if leak["ssim_ci95"] is not None:
        low, high = leak["ssim_ci95"]
        text += f" [{low:.2f}, {high:.2f}]"
    if best:
        text = f"**{text}**"
    return text + (f" ({leak['n_images']})" if show_images else "")


def leakage_tables(rows: list[dict[str, Any]]) -> str:
    """One table per setting whose cells (``sweep.jsonl`` rows) hold ``privacy.by_attack``; empty when none
    does. The number of images follows each cell where the cells of a setting differ in it."""
    parts = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        cells = [r for r in rows if r["setting"] == setting and (r.get("privacy") or {}).get("by_attack")]
        if not cells:
            continue
        leaks = [leak for cell in cells for leak in cell["privacy"]["by_attack"]]
        rounds = sorted({leak["round"] for leak in leaks})
        counts = {leak["n_images"] for leak in leaks}
        show_images = len(counts) > 1
        images = "" if show_images else f", {counts.pop()} images a cell"
        lines = [
            f"Mean SSIM [95% CI] per attack and attacked round, setting `{setting}`{images}; bold: the "
            "round's best attack:",
            "",
            "| variant | attack | " + " | ".join(f"round {r}" for r in rounds) + " |",
            "|---|---|" + "---:|" * len(rounds),
        ]
        for cell in cells:
            by_attack = cell["privacy"]["by_attack"]
            best = {(leak["round"], leak["attack"]) for leak in cell["privacy"]["per_round"]}
            for attack in dict.fromkeys(leak["attack"] for leak in by_attack):
                found = {leak["round"]: leak for leak in by_attack if leak["attack"] == attack}
                marks = " (adaptive)" if any(leak["adaptive"] for leak in found.values()) else ""
                lines.append(
                    f"| `{cell['variant']}` | `{attack}`{marks} | "
                    + " | ".join(
                        _ssim_cell(found[r], (r, attack) in best, show_images) if r in found else "-" for r in rounds
                    )
                    + " |"
                )
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)
