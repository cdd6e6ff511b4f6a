"""One PNG that compares every attack of a run: per attack, the client's batch beside its reconstruction.

Bands are stacked top to bottom in the order attacks first appear in
``attacks.jsonl``; each shows the attack's name and scores, the true grid and
the reconstructed grid of the attack's first scored upload (the grids the
evaluator saved), so the figure can be rebuilt from a run folder alone. A grid
path that leads out of the run folder is refused, and a grid that is not a
readable PNG skipped: that upload is left out (the attack's next scored one is
drawn) and the note says why. A score of the wrong type is left out of the
caption (``fedguard.store.rows``).
"""

from __future__ import annotations

from io import BytesIO
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from fedguard.report.images import load_png
from fedguard.store.folder import (
    COMPARISON_FILE,
    GRID_KINDS,
    Note,
    RunFileError,
    grid_name,
    inside,
    warn,
    write_atomic,
)
from fedguard.store.rows import AttackRow, read_attacks

LABEL_WIDTH = 230  # pixels of the text column on the left of each band
GAP = 12  # pixels between and around the grids
TEXT = (17, 24, 39)
MUTED = (107, 114, 128)
Scored = tuple[AttackRow, tuple[Image.Image, Image.Image]]  # a row and its (truth, recon) grids, RGB


def _grids(run_dir: Path, row: AttackRow, note: Note) -> tuple[Image.Image, Image.Image] | None:
    """The (truth, recon) grids of a scored row inside ``run_dir``, as RGB images; None when missing, refused
    or not readable PNGs (noted)."""
    try:
        truth, recon = (inside(run_dir, grid_name(str(row["images"]), kind)) for kind in GRID_KINDS)
    except RunFileError as error:
        note(str(error))
        return None
    if not (truth.is_file() and recon.is_file()):
        return None
    grids = []
    for path in (truth, recon):
        try:
            grids.append(load_png(path.read_bytes()).convert("RGB"))
        except ValueError as error:
            note(f"{path}: {error}; not embedded")
            return None
    return grids[0], grids[1]


def _first_scored(rows: list[AttackRow], run_dir: Path, note: Note) -> dict[str, Scored]:
    """Attack name -> its first row with readable saved grids and the grids, in order of first appearance."""
    chosen: dict[str, Scored] = {}
    for row in rows:
        if row.get("status") != "ok" or not row.get("images") or str(row.get("attack")) in chosen:
            continue
        if (grids := _grids(run_dir, row, note)) is not None:
            chosen[str(row["attack"])] = (row, grids)
    return chosen


def _caption(row: AttackRow) -> list[tuple[str, tuple[int, int, int]]]:
    """Text lines for a band: name, where the upload came from, the scores."""
    floor = row.get("floor") or {}

    def number(value: Any, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        (str(row["attack"]), TEXT),
        (f"round {row.get('round')}, client {row.get('client')}, batch {row.get('batch_size')}", MUTED),
    ]
    if row.get("manipulation") not in (None, "none"):
        lines.append((f"server sent: {row['manipulation']}", MUTED))
    lines += [
        (f"PSNR {number(row.get('psnr'), 1)} dB  SSIM {number(row.get('ssim'), 3)}", TEXT),
        (f"LPIPS {number(row.get('lpips'), 3)}", TEXT),
    ]
    if floor:
        lines.append((f"flat-image floor {number(floor.get('psnr'), 1)} dB / {number(floor.get('ssim'), 2)}", MUTED))
    return lines


def render_comparison(run_dir: Path, note: Note = warn) -> bytes | None:
    """The comparison figure of ``run_dir`` as PNG bytes; None when no attack saved grids. ``note`` hears of
    a torn last line of ``attacks.jsonl`` and of refused grid paths."""
    chosen = _first_scored(read_attacks(Path(run_dir), note), Path(run_dir), note)
    if not chosen:
        return None
    pairs = [grids for _, grids in chosen.values()]
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
    for ((row, _), (truth, recon)), height in zip(zip(chosen.values(), pairs), heights):
        for index, (line, colour) in enumerate(_caption(row)):
            draw.text((GAP, top + 16 * index), line, fill=colour, font=font)
        canvas.paste(truth, (LABEL_WIDTH + GAP, top))
        canvas.paste(recon, (LABEL_WIDTH + 2 * GAP + truth.width, top))
        top += height + GAP
    out = BytesIO()
    canvas.save(out, format="PNG", optimize=True)
    return out.getvalue()


def write_comparison(run_dir: Path, note: Note = warn) -> Path | None:
    """Write ``run_dir/comparison.png``; returns its path, or None when no attack saved grids."""
    data = render_comparison(run_dir, note)
    return None if data is None else write_atomic(Path(run_dir) / COMPARISON_FILE, data)
