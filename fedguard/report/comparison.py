"""One PNG that compares every attack of a run: per attack, the client's batch beside its reconstruction.

Bands are stacked top to bottom in the order attacks first appear in
``attacks.jsonl``; each shows the attack's name and scores, the true grid and
the reconstructed grid of the attack's first scored upload (the grids the
evaluator saved), so the figure can be rebuilt from a run folder alone.
"""

from __future__ import annotations

import json
from io import BytesIO
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from fedguard.report.images import write_atomic

COMPARISON_FILE = "comparison.png"
LABEL_WIDTH = 230  # pixels of the text column on the left of each band
GAP = 12  # pixels between and around the grids
TEXT = (17, 24, 39)
MUTED = (107, 114, 128)


def _first_scored(rows: list[dict[str, Any]], run_dir: Path) -> dict[str, dict[str, Any]]:
    """Attack name -> its first row with saved grids, in order of first appearance."""
    chosen: dict[str, dict[str, Any]] = {}
    for row in rows:
        prefix = row.get("images")
        if row.get("status") != "ok" or not prefix or row.get("attack") in chosen:
            continue
        if (run_dir / f"{prefix}_truth.png").is_file() and (run_dir / f"{prefix}_recon.png").is_file():
            chosen[str(row["attack"])] = row
    return chosen


def _caption(row: dict[str, Any]) -> list[tuple[str, tuple[int, int, int]]]:
    """Text lines for a band: name, where the upload came from, the scores."""
    def number(key: str, digits: int) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    floor = row.get("floor") or {}
    lines = [(str(row["attack"]), TEXT),
             (f"round {row.get('round')}, client {row.get('client')}, batch {row.get('batch_size')}", MUTED)]
    if row.get("manipulation") not in (None, "none"):
        lines.append((f"server sent: {row['manipulation']}", MUTED))
    lines += [(f"PSNR {number('psnr', 1)} dB  SSIM {number('ssim', 3)}", TEXT),
              (f"LPIPS {number('lpips', 3)}", TEXT)]
    if floor:
        lines.append((f"flat-image floor {floor.get('psnr', 0):.1f} dB / {floor.get('ssim', 0):.2f}", MUTED))
    return lines


def render_comparison(run_dir: Path) -> bytes | None:
    """The comparison figure of ``run_dir`` as PNG bytes; None when no attack saved grids."""
    path = Path(run_dir) / "attacks.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = _first_scored(rows, Path(run_dir))
    if not chosen:
        return None
    pairs = [(Image.open(Path(run_dir) / f"{row['images']}_truth.png").convert("RGB"),
              Image.open(Path(run_dir) / f"{row['images']}_recon.png").convert("RGB")) for row in chosen.values()]
    font = ImageFont.load_default()
    heights = [max(truth.height, recon.height, 16 * 7) for truth, recon in pairs]
    header = 24
    width = LABEL_WIDTH + max(t.width + r.width for t, r in pairs) + 3 * GAP
    canvas = Image.new("RGB", (width, header + sum(heights) + GAP * (len(pairs) + 1)), "white")
    draw = ImageDraw.Draw(canvas)
    first_truth = pairs[0][0].width
    draw.text((LABEL_WIDTH + GAP, 6), "client's batch (ground truth)", fill=MUTED, font=font)
    draw.text((LABEL_WIDTH + 2 * GAP + first_truth, 6), "reconstruction", fill=MUTED, font=font)
    top = header + GAP
    for (row, (truth, recon)), height in zip(zip(chosen.values(), pairs), heights):
        for index, (line, colour) in enumerate(_caption(row)):
            draw.text((GAP, top + 16 * index), line, fill=colour, font=font)
        canvas.paste(truth, (LABEL_WIDTH + GAP, top))
        canvas.paste(recon, (LABEL_WIDTH + 2 * GAP + truth.width, top))
        top += height + GAP
    out = BytesIO()
    canvas.save(out, format="PNG", optimize=True)
    return out.getvalue()


def write_comparison(run_dir: Path) -> Path | None:
    """Write ``run_dir/comparison.png``; returns its path, or None when no attack saved grids."""
    data = render_comparison(run_dir)
    return None if data is None else write_atomic(Path(run_dir) / COMPARISON_FILE, data)
