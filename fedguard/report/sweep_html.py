"""sweep.html and its figures: a sweep's cells seen together, one panel per setting.

Per setting: privacy against utility (each variant's accuracy as a share of the baseline's, with its interval
over seeds, against the headline attack's mean SSIM with its interval over images), the leakage per attacked
round (each variant's best attack), the cost (seconds per round, and the upload's size as a share of the dense
update where a defense changes it), then ``summary.md``'s tables. Where the clients ran detectors, a detection
panel: each detector's detection and false-alarm rates with their Wilson 95 % intervals, pooled and per setting
(read from the runs' folders that ``runs.jsonl`` lists, ``fedguard.report.detection``), beside ``summary.md``'s
detection section. Each figure is also written beside the page as ``<figure>-<setting>.png`` (the detection
figure as ``detection.png``). Everything else is read from ``sweep.jsonl``; the page embeds its figures and
loads nothing from elsewhere.
"""

from __future__ import annotations

import os
import re
from html import escape
from pathlib import Path
from typing import Any

from fedguard.report.detection import (
    HEADING,
    ClientRound,
    DetectorRow,
    detector_rows,
    pooled_findings,
    setting_rows,
    sweep_runs,
)
from fedguard.report.html import CSS, DASH, EmbeddedImages, figure_png, page_html, pairs_html, plot_axes, scored_images
from fedguard.report.invocation import INVOCATION_FILE, invocation_line
from fedguard.report.leakage import SUCCESS_SSIM
from fedguard.store.folder import REPORT_FILE, RUNS_FILE, SUMMARY_FILE, SWEEP_FILE, read_json, write_atomic
from fedguard.store.invocations import own_rows
from fedguard.store.rows import CellRow, read_attacks, read_cells

SWEEP_PAGE = "sweep.html"
FIGURES = ("privacy-utility", "leakage-per-round", "cost")
DETECTION_FIGURE = "detection.png"
ALL_SETTINGS = "all settings"  # the pooled panel of the detection figure
BLUE, GREY, RED = "#2563eb", "#9ca3af", "#dc2626"


def _errors(mean: float, interval: list[float] | None, scale: float = 1.0) -> list[float]:
    """[below, above] for an error bar, 0 where there is no interval."""
    if interval is None:
        return [0.0, 0.0]
    return [max(0.0, (mean - interval[0]) * scale), max(0.0, (interval[1] - mean) * scale)]


def privacy_utility_points(cells: list[CellRow], baseline: str) -> list[dict[str, Any]]:
    """Per variant that was attacked and trained: ``ssim`` (the headline attack's mean) with ``ssim_errors``
    ([below, above], from its interval over images) and ``share``, its accuracy in % of the baseline variant's,
    with ``share_errors`` (from the interval over seeds)."""
    base = next((c for c in cells if c["variant"] == baseline), None)
    base_accuracy = (base or {}).get("accuracy")
    if not base_accuracy:
        return []
    points = []
    for c in cells:
        leak, accuracy = c.get("privacy") or {}, c.get("accuracy")
        if leak.get("ssim_mean") is None or accuracy is None:
            continue
        points.append(
            {
                "variant": c["variant"],
                "ssim": leak["ssim_mean"],
                "ssim_errors": _errors(leak["ssim_mean"], leak.get("ssim_ci95")),
                "share": 100 * accuracy / base_accuracy,
                "share_errors": _errors(accuracy, c.get("accuracy_ci95"), 100 / base_accuracy),
            }
        )
    return points


def privacy_utility_png(cells: list[CellRow], baseline: str) -> bytes | None:
    """``privacy_utility_points`` drawn: accuracy kept against the strongest attack's SSIM, with bars for the
    intervals; None without a point."""
    points = privacy_utility_points(cells, baseline)
    if not points:
        return None
    figure, [axis] = plot_axes(7.2, 4.8)
    for point in points:
        colour = GREY if point["variant"] == baseline else BLUE
        axis.errorbar(
            [point["ssim"]],
            [point["share"]],
            xerr=[[e] for e in point["ssim_errors"]],
            yerr=[[e] for e in point["share_errors"]],
            fmt="o",
            color=colour,
            ecolor=colour,
            elinewidth=1.2,
            capsize=3,
            markersize=7,
        )
        axis.annotate(
            point["variant"], (point["ssim"], point["share"]), textcoords="offset points", xytext=(6, 5), fontsize=9
        )
    axis.axvline(SUCCESS_SSIM, color=RED, linewidth=1, linestyle=":", label=f"recognisable (SSIM {SUCCESS_SSIM:g})")
    axis.set_xlim(0, 1.05)
    axis.set_ylim(bottom=0)
    axis.set_xlabel("strongest attack's mean SSIM (lower: more private)")
    axis.set_ylabel(f"accuracy, % of {baseline}'s (higher: more useful)")
    axis.legend(loc="lower left", frameon=False, fontsize=9)
    figure.tight_layout()
    return figure_png(figure)


def leakage_per_round_png(cells: list[CellRow]) -> bytes | None:
    """Each variant's best attack's mean SSIM (with its interval over images) against the attacked round; None
    when no cell has an SSIM (images without one: LPIPS-only or unscored)."""
    scored = {
        c["variant"]: [leak for leak in (c.get("privacy") or {})["per_round"] if leak["ssim_mean"] is not None]
        for c in cells
        if (c.get("privacy") or {}).get("per_round")
    }
    attacked = {variant: leaks for variant, leaks in scored.items() if leaks}
    if not attacked:
        return None
    figure, [axis] = plot_axes(7.2, 4.2)
    rounds = sorted({leak["round"] for leaks in attacked.values() for leak in leaks})
    for variant, per_round in attacked.items():
        xs, ys = [leak["round"] for leak in per_round], [leak["ssim_mean"] for leak in per_round]
        errors = [_errors(leak["ssim_mean"], leak.get("ssim_ci95")) for leak in per_round]
        axis.errorbar(
            xs,
            ys,
            yerr=[[e[0] for e in errors], [e[1] for e in errors]],
            marker="o",
            capsize=3,
            linewidth=1.6,
            label=variant,
        )
    axis.axhline(SUCCESS_SSIM, color=RED, linewidth=1, linestyle=":")
    axis.set_xticks(rounds)
    axis.set_ylim(0, 1.02)
    axis.set_xlabel("round of the attacked uploads")
    axis.set_ylabel("best attack's mean SSIM")
    axis.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=9)
    figure.tight_layout()
    return figure_png(figure)


def cost_png(cells: list[CellRow]) -> bytes | None:
    """Seconds per round per variant, and beside it the upload's size as a share of the dense update (where a
    cell reports sizes); None when no cell has a time."""
    timed = [c for c in cells if c.get("seconds_per_round") is not None]
    if not timed:
        return None
    sized = any(c.get("upload_share") is not None for c in timed)
    figure, axes = plot_axes(9.6 if sized else 6.0, 0.9 + 0.38 * len(timed), 2 if sized else 1)
    names = [c["variant"] for c in timed][::-1]
    seconds = [c["seconds_per_round"] for c in timed][::-1]
    axes[0].barh(names, seconds, color=BLUE)
    axes[0].set_xlabel("seconds per round")
    for y, value in enumerate(seconds):
        axes[0].annotate(f"{value:.2f}", (value, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    if sized:
        shares = [100 * (c.get("upload_share") or 0.0) for c in timed][::-1]
        axes[1].barh(names, shares, color=GREY)
        axes[1].set_xlabel("upload size, % of the dense update")
        axes[1].set_xlim(0, max(100.0, *shares) * 1.1)
    figure.tight_layout()
    return figure_png(figure)


def _rate_points(rows: list[DetectorRow], detected: bool) -> tuple[list[float], list[list[float]]]:
    """Per detector: the rate in % and its [below, above] error from the Wilson interval (0 where n is 0)."""
    rates = [r.detected if detected else r.false_alarms for r in rows]
    shares = [100 * (r.share or 0.0) for r in rates]
    errors = [_errors(share / 100, r.ci95, 100) for share, r in zip(shares, rates)]
    return shares, errors


def detection_png(found: list[ClientRound]) -> bytes | None:
    """Each detector's detection rate (malicious client-rounds) and false-alarm rate (honest ones), in %, with
    bars for their Wilson 95 % intervals: pooled, then one panel per setting when there are several; None
    without a client-round."""
    if not found:
        return None
    panels = {ALL_SETTINGS: detector_rows(found)}
    per_setting = setting_rows(found)
    if len(per_setting) > 1:
        panels.update(per_setting)
    figure, axes = plot_axes(3.2 * len(panels) + 1.4, 3.6, len(panels))
    for axis, (title, rows) in zip(axes, panels.items()):
        xs = list(range(len(rows)))
        for detected, colour, marker, offset, label in (
            (True, BLUE, "o", -0.12, "detected"),
            (False, RED, "s", 0.12, "false alarms"),
        ):
            shares, errors = _rate_points(rows, detected)
            axis.errorbar(
                [x + offset for x in xs],
                shares,
                yerr=[[e[0] for e in errors], [e[1] for e in errors]],
                fmt=marker,
                color=colour,
                capsize=3,
                label=label,
            )
        axis.set_xticks(xs, [r.detector for r in rows])
        axis.set_ylim(-3, 103)
        axis.set_title(title, fontsize=10)
    axes[0].set_ylabel("client-rounds flagged, %")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=9)
    figure.tight_layout()
    return figure_png(figure)


def _inline(text: str) -> str:
    """Markdown's ``code`` and **bold** in escaped text."""
    text = escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def markdown_html(markdown: str) -> str:
    """The subset of markdown ``summary.md`` uses: ``##`` headings, pipe tables, list items and paragraphs."""
    blocks: list[str] = []
    table: list[list[str]] = []
    items: list[str] = []

    def flush() -> None:
        if table:
            header, rows = table[0], table[2:]
            align = ["num" if cell.endswith(":") else "" for cell in table[1]]
            head = "".join(f'<th class="{a}">{_inline(c)}</th>' for c, a in zip(header, align))
            body = "".join(
                "<tr>" + "".join(f'<td class="{a}">{_inline(c)}</td>' for c, a in zip(row, align)) + "</tr>"
                for row in rows
            )
            blocks.append(
                f'<div class="scroll"><table class="data"><thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table></div>"
            )
            table.clear()
        if items:
            blocks.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in items) + "</ul>")
            items.clear()

    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("|"):
            table.append([cell.strip() for cell in stripped.strip("|").split("|")])
        elif stripped.startswith("- "):
            items.append(stripped[2:])
        elif stripped.startswith("## "):
            flush()
            blocks.append(f"<h3>{_inline(stripped[3:])}</h3>")
        else:
            flush()
            if stripped:
                blocks.append(f"<p>{_inline(stripped)}</p>")
    flush()
    return "\n".join(blocks)


def _setting_panel(folder: Path, setting: str, cells: list[CellRow], baseline: str, images: EmbeddedImages) -> str:
    kind = cells[0].get("setting_kind", "diagnostic")
    seeds = sorted({s for c in cells for s in c.get("seeds") or []})
    parts = [
        f'<section class="panel"><h2>Setting <code>{escape(setting)}</code> <span class="badge ok">'
        f"{escape(kind)}</span></h2>",
        f'<p class="lead">{len(cells)} variants' + (f", seeds {', '.join(map(str, seeds))}" if seeds else "") + "</p>",
    ]
    figures = dict(zip(FIGURES, (privacy_utility_png(cells, baseline), leakage_per_round_png(cells), cost_png(cells))))
    captions = {
        "privacy-utility": "Privacy against utility: up and to the left is better",
        "leakage-per-round": "Leakage per attacked round (each variant's best attack)",
        "cost": "Cost per defense",
    }
    shown = []
    for name, png in figures.items():
        path = folder / f"{name}-{setting}.png"
        if png is None:
            path.unlink(missing_ok=True)
            continue
        write_atomic(path, png)
        shown.append(
            f'<figure class="curve"><h3>{captions[name]}</h3>'
            f"{images.tag(png, f'{captions[name]}, setting {setting}', 'plot')}</figure>"
        )
    parts.append(f'<div class="figures">{"".join(shown)}</div>')
    failed = [c["variant"] for c in cells if c.get("status") == "failed"]
    if failed:
        parts.append(f'<p class="warn">Failed in every seed (no figure): {escape(", ".join(failed))}</p>')
    parts.append("</section>")
    return "\n".join(parts)


STRIP_IMAGES = 8  # true images, each above its reconstruction, shown per variant


def best_round(cell: CellRow) -> int | None:
    """The attacked round where the cell's strongest attack scored its highest mean SSIM (None: no such)."""
    scored = {r: v.get("ssim") for r, v in (cell.get("by_round") or {}).items() if isinstance(v, dict)}
    numbers = {int(r): float(v) for r, v in scored.items() if isinstance(v, (int, float)) and str(r).isdigit()}
    return max(numbers, key=lambda r: (numbers[r], -r)) if numbers else None


def _strip(cell: CellRow, runs: list[CellRow], images: EmbeddedImages) -> str:
    """The images of the cell's strongest attack in its best round, from the lowest seed whose run has them: the
    upload it reconstructed best, each true image above its reconstruction."""
    attack, round_ = cell.get("strongest_attack"), best_round(cell)
    if attack is None or round_ is None:
        return ""
    for run in sorted(runs, key=lambda r: int(r.get("seed", 0))):
        rows = [
            a
            for a in own_rows(read_attacks(Path(run["folder"])))
            if a.get("attack") == attack and a.get("round") == round_ and a.get("status") == "ok" and a.get("images")
        ]
        for row in sorted(rows, key=lambda a: -float(a.get("ssim") or 0.0)):
            found = scored_images(Path(run["folder"]), row)
            if found is not None:
                where = f"{attack}, round {round_}, client {row.get('client')}, seed {run.get('seed')}"
                pairs = pairs_html(*found, row.get("per_image") or [], images, STRIP_IMAGES)
                return f'<div class="strip"><div class="where">{escape(where)}</div>{pairs}</div>'
    return ""


def _report_links(folder: Path, runs: list[CellRow]) -> str:
    """A link to each seed's run report (relative to the sweep folder), or why there is none."""
    links = []
    for run in sorted(runs, key=lambda r: int(r.get("seed", 0))):
        seed = escape(str(run.get("seed", "?")))
        report = Path(run["folder"]) / REPORT_FILE
        if run.get("status") != "ok":
            links.append(f'<span class="badge error">seed {seed} failed</span>')
        elif report.is_file():
            href = os.path.relpath(report, folder)
            links.append(f'<a href="{escape(Path(href).as_posix())}">seed {seed}</a>')
        else:
            links.append(f"seed {seed}: no report")
    return " ".join(links)


def _runs_panel(folder: Path, setting: str, cells: list[CellRow], runs: list[CellRow], images: EmbeddedImages) -> str:
    """Per variant of ``setting``: what its strongest attack recovered in its best round, and its runs' reports."""
    rows = []
    for cell in cells:
        mine = [r for r in runs if r.get("setting") == setting and r.get("variant") == cell.get("variant")]
        strip = _strip(cell, mine, images) or '<span class="empty">no reconstruction</span>'
        rows.append(
            f"<tr><td><code>{escape(str(cell.get('variant')))}</code></td><td>{strip}</td>"
            f"<td>{_report_links(folder, mine) or DASH}</td></tr>"
        )
    return (
        f'<section class="panel"><h2>Reconstructions in <code>{escape(setting)}</code></h2><p class="lead">Each '
        "variant's strongest attack in its best round (the upload it reconstructed best, first seed), each true "
        "image above its reconstruction, and every run's report.</p>"
        '<table class="data"><thead><tr><th>variant</th><th>the clients\' images and their reconstructions</th>'
        f"<th>run reports</th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def split_section(markdown: str, title: str) -> tuple[str, str]:
    """(``markdown`` without its ``## title`` section, the section's lines after the heading); a section runs to
    the next ``##`` heading or the end; ``(markdown, "")`` without one."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == f"## {title}"), None)
    if start is None:
        return markdown, ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[:start] + lines[end:]), "\n".join(lines[start + 1 : end])


def sweep_findings(folder: Path) -> list[ClientRound]:
    """The detectors' client-rounds of the sweep's completed runs (none without ``runs.jsonl``)."""
    return pooled_findings(sweep_runs(folder))[0] if (folder / RUNS_FILE).is_file() else []


def _detection_panel(folder: Path, found: list[ClientRound], tables: str, images: EmbeddedImages) -> str:
    """The detection figure (written beside the page as ``DETECTION_FIGURE``) and ``summary.md``'s detection
    section ``tables``; empty when there is neither."""
    png = detection_png(found)
    path = folder / DETECTION_FIGURE
    if png is None:
        path.unlink(missing_ok=True)
    else:
        write_atomic(path, png)
    if png is None and not tables.strip():
        return ""
    caption = "Detection and false-alarm rates per detector, with Wilson 95% intervals"
    shown = "" if png is None else f'<figure class="curve">{images.tag(png, caption, "plot")}</figure>'
    return (
        f'<section class="panel"><h2>{HEADING}</h2><p class="lead">What the clients\' detectors flagged: a '
        "client-round is one client's check of the model of one round, malicious when the run's "
        "<code>threat.malicious</code> schedules a manipulation in that round; bars and columns: Wilson 95% "
        f"intervals.</p>{shown}{markdown_html(tables)}</section>"
    )


def _invocation_html(folder: Path) -> str:
    """The command the sweep ran as (``invocation.json``: preset, its digest, --only, --seeds, --set); a note
    where the folder holds no readable record."""
    try:
        line = invocation_line(read_json(folder / INVOCATION_FILE) or {})
    except (OSError, ValueError, KeyError, TypeError):
        return '<p class="lead">No readable invocation.json: the preset and options it ran with are unknown.</p>'
    return f'<p class="lead">{markdown_html(line).removeprefix("<p>").removesuffix("</p>")}</p>'


def render_sweep(folder: Path, baseline: str | None = None) -> str:
    """The HTML of ``folder``'s sweep page (see ``build_sweep_page``)."""
    cells = read_cells(folder)
    if not cells:
        raise FileNotFoundError(f"{folder} holds no {SWEEP_FILE} rows; is it a sweep folder (see `fedguard sweep`)?")
    baseline = baseline or cells[0].get("baseline") or cells[0]["variant"]
    images = EmbeddedImages()
    settings = list(dict.fromkeys(c["setting"] for c in cells))
    runs = read_cells(folder, RUNS_FILE) if (folder / RUNS_FILE).is_file() else []
    panels = []
    for setting in settings:
        chosen = [c for c in cells if c["setting"] == setting]
        panels.append(_setting_panel(folder, setting, chosen, baseline, images))
        panels.append(_runs_panel(folder, setting, chosen, runs, images))
    summary = folder / SUMMARY_FILE
    rest, detection = split_section(summary.read_text(), HEADING) if summary.is_file() else ("", "")
    tables = markdown_html(rest) if summary.is_file() else '<p class="empty">No summary.md.</p>'
    name = folder.name
    body = "\n".join(
        [
            f'<header class="top"><div class="eyebrow">fedguard sweep</div><h1>{escape(name)}</h1>'
            f'<div class="folder">{escape(str(folder))}</div>{_invocation_html(folder)}</header>',
            *panels,
            _detection_panel(folder, sweep_findings(folder), detection, images),
            f'<section class="panel"><h2>Tables</h2><p class="lead">As in summary.md; baseline '
            f"<code>{escape(baseline)}</code>.</p>{tables}</section>",
            f"<footer>Written by <code>fedguard sweep</code>; {images.count} embedded image"
            f"{'s' if images.count != 1 else ''}, no external resources.</footer>",
        ]
    )
    css = CSS + (
        ".scroll { overflow-x:auto; } .curve h3 { margin-top:14px; } code { font-size:90%; }\n"
        ".figures { display:grid; grid-template-columns:repeat(auto-fit, minmax(460px, 1fr)); gap:0 24px; }\n"
        ".strip .where { font-size:12.5px; color:var(--muted); }\n"
    )
    return page_html(f"{name} \u2014 fedguard sweep", css, body, images.count)


def build_sweep_page(folder: Path, baseline: str | None = None) -> Path:
    """Write ``folder/sweep.html`` (and the figures' PNGs) from its ``sweep.jsonl`` and ``summary.md``; returns
    the page's path. ``baseline``: the variant accuracy is measured against (default: the one the rows name,
    else the first). ``FileNotFoundError`` when the folder holds no sweep."""
    folder = Path(folder)
    return write_atomic(folder / SWEEP_PAGE, render_sweep(folder, baseline))
