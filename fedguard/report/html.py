"""``report.html``: one self-contained page on a run, its training curve and every attack on it.

The page needs nothing but itself: the figure and the image grids are
embedded as base64 ``data:`` URIs, the CSS and the one small script are
inline, and a Content-Security-Policy forbids loading anything else, so the
file can be mailed, archived or opened offline and looks the same. Only grids
inside the run folder are embedded; the page lists what it left out (a torn
last line of a log, a grid path that leads out of the folder, a grid that is
not a readable PNG, a value of the wrong type in a row, named with its file and
row: ``fedguard.store.rows``).
"""

from __future__ import annotations

import base64
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from html import escape
from io import BytesIO
from pathlib import Path
from typing import Any, cast

import numpy as np
from PIL import Image

from fedguard.config import NO_ATTACK, ConfigError
from fedguard.metrics.scoring import LEAK_SSIM
from fedguard.report.comparison import write_comparison
from fedguard.report.images import grid_array, load_png
from fedguard.report.left_out import FAILED, LeftOut, left_out, left_out_counts, left_out_html, left_out_summary
from fedguard.report.recorded import RecordedConfig, read_recorded_config
from fedguard.report.run_status import read_status
from fedguard.store.folder import (
    APP_FILE,
    GRID_KINDS,
    REPORT_FILE,
    ROUNDS_FILE,
    RunFileError,
    grid_name,
    inside,
    read_json,
    recon_name,
    warn,
    write_atomic,
)
from fedguard.store.invocations import attack_label
from fedguard.store.rows import AttackRow, RoundRow, read_attacks, read_rounds
from fedguard.store.vault import read_scored_images
from strategies.registry import AUTO as AUTO_STRATEGY
from strategies.registry import resolve as resolve_strategy

DASH = "\u2014"


# ----------------------------------------------------------------------------------------------
# Reading the run folder
# ----------------------------------------------------------------------------------------------


class _Notes:
    """What the page left out, each said once: on the page and as a warning."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, message: str) -> None:
        if message not in self.lines:
            self.lines.append(message)
            warn(message)


def _ending(run_dir: Path) -> list[str]:
    """A line on how the run ended (``status.json``) when it did not complete; none while it goes on."""
    try:
        status = read_status(run_dir)
    except RunFileError as error:
        return [str(error)]
    if status is None or status.get("status") == "completed":
        return []
    why = f" ({status['error']})" if status.get("error") else ""
    return [f"Run status: {status.get('status')} after {status.get('rounds')} rounds{why}."]


def _load_config(run_dir: Path) -> tuple[RecordedConfig | None, str | None]:
    """The configuration the run recorded (no plugin imported, nothing validated again), or why there is none."""
    try:
        return read_recorded_config(run_dir), None
    except ConfigError as error:
        return None, "; ".join(error.problems)


# ----------------------------------------------------------------------------------------------
# Numbers
# ----------------------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A finite or infinite float, or None for null, NaN and anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _mean(values: Iterable[Any]) -> float | None:
    numbers = [n for n in (_number(v) for v in values) if n is not None]
    return sum(numbers) / len(numbers) if numbers else None


def _median(values: Iterable[Any]) -> float | None:
    numbers = [n for n in (_number(v) for v in values) if n is not None]
    return float(statistics.median(numbers)) if numbers else None


def _fmt(value: Any, digits: int, suffix: str = "") -> str:
    number = _number(value)
    if number is None:
        return DASH
    if math.isinf(number):
        return ("\u221e" if number > 0 else "-\u221e") + suffix
    return f"{number:.{digits}f}{suffix}"


def _pct(value: Any, digits: int = 1) -> str:
    number = _number(value)
    return DASH if number is None else _fmt(100 * number, digits, "%")


def _is_ok(row: AttackRow) -> bool:
    return row.get("status") == "ok"


def _leaked(row: AttackRow) -> bool:
    ssim = _number(row.get("ssim"))
    return _is_ok(row) and ssim is not None and ssim > LEAK_SSIM


def _sort_key(row: AttackRow) -> tuple[Any, ...]:
    def num(value: Any) -> float:
        n = _number(value)
        return math.inf if n is None else n

    return (num(row.get("round")), num(row.get("client")), str(row.get("attack", "")), str(row.get("defense", "")))


# ----------------------------------------------------------------------------------------------
# Embedded images
# ----------------------------------------------------------------------------------------------


class EmbeddedImages:
    """Numbers the embedded images, so the page can report how many the browser decoded."""

    def __init__(self) -> None:
        self.count = 0

    def tag(self, png: bytes, alt: str, css_class: str, enlarge_to: int = 0) -> str:
        """An ``<img>`` of ``png``; a small one is shown up to ``enlarge_to`` pixels wide by whole factors.
        ``ValueError`` when ``png`` is not a readable PNG."""
        width, height = load_png(png).size
        factor = max(1, enlarge_to // max(1, width))
        width, height = width * factor, height * factor
        self.count += 1
        data = base64.b64encode(png).decode("ascii")
        return (
            f'<img id="img-{self.count}" class="{escape(css_class)}" alt="{escape(alt)}" '
            f'width="{width}" height="{height}" src="data:image/png;base64,{data}">'
        )


def figure_png(figure: Any) -> bytes:
    """A matplotlib figure as PNG bytes, without the software stamp (the same figure gives the same bytes)."""
    buffer = BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def _curve_png(rounds: list[RoundRow]) -> bytes:
    """Accuracy (%) and loss against the round, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    xs: list[Any] = [row.get("round") for row in rounds]
    accuracy = [100 * a if (a := _number(row.get("accuracy"))) is not None else math.nan for row in rounds]
    loss = [v if (v := _number(row.get("loss"))) is not None else math.nan for row in rounds]

    figure = Figure(figsize=(9.6, 3.6), dpi=150)
    FigureCanvasAgg(figure)
    axis = figure.add_subplot()
    blue, orange = "#2563eb", "#ea580c"
    axis.plot(xs, accuracy, color=blue, linewidth=2.2, marker="o", markersize=3.5, label="accuracy")
    axis.fill_between(xs, accuracy, color=blue, alpha=0.07)
    axis.set_ylim(0, 100)
    axis.set_ylabel("test accuracy (%)", color=blue)
    axis.set_xlabel("round")
    axis.tick_params(axis="y", colors=blue)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.grid(True, color="#e5e7eb", linewidth=0.8)
    axis.set_axisbelow(True)
    if len(xs) > 1:
        axis.set_xlim(min(xs), max(xs))

    label = "accuracy"
    finite = [(a, -i) for i, a in enumerate(accuracy) if not math.isnan(a)]
    if finite:
        best, index = max(finite)  # the first round that reached the best accuracy
        at = xs[-index]
        axis.scatter([at], [best], s=60, color=blue, edgecolor="white", linewidth=1.5, zorder=5)
        label = f"accuracy (best {best:.1f}% at round {at})"
    axis.lines[0].set_label(label)

    second = axis.twinx()
    second.plot(xs, loss, color=orange, linewidth=1.6, linestyle="--", label="loss")
    second.set_ylabel("loss", color=orange)
    second.tick_params(axis="y", colors=orange)
    second.set_ylim(bottom=0)
    for side in ("top",):
        axis.spines[side].set_visible(False)
        second.spines[side].set_visible(False)
    handles = axis.get_legend_handles_labels()[0] + second.get_legend_handles_labels()[0]
    labels: list[Any] = [h.get_label() for h in handles]  # the handles' labels are strings
    axis.legend(
        handles,
        labels,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncol=2,
        frameon=False,
        borderaxespad=0.2,
    )
    figure.tight_layout()

    return figure_png(figure)


def leakage_by_round(attacks: list[AttackRow]) -> dict[str, list[tuple[int, float]]]:
    """Per attack, (round, mean SSIM of its scored uploads in that round), rounds ascending."""
    grouped: dict[str, dict[int, list[float]]] = {}
    for row in attacks:
        ssim, round_ = _number(row.get("ssim")), row.get("round")
        if _is_ok(row) and ssim is not None and isinstance(round_, int):
            grouped.setdefault(str(row.get("attack")), {}).setdefault(round_, []).append(ssim)
    return {attack: [(r, sum(v) / len(v)) for r, v in sorted(by_round.items())] for attack, by_round in grouped.items()}


def plot_axes(width: float, height: float, columns: int = 1) -> tuple[Any, list[Any]]:
    """A ``width`` x ``height`` inch figure at 150 dpi with ``columns`` axes side by side: light grid below the
    data, no top or right spine."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=150)
    FigureCanvasAgg(figure)
    axes = [figure.add_subplot(1, columns, index + 1) for index in range(columns)]
    for axis in axes:
        axis.grid(True, color="#e5e7eb", linewidth=0.8)
        axis.set_axisbelow(True)
        axis.spines["top"].set_visible(False)
        axis.spines["right"].set_visible(False)
    return figure, axes


def _leakage_png(curves: dict[str, list[tuple[int, float]]], rounds: list[RoundRow]) -> bytes:
    """Mean SSIM of each attack's reconstructions against the round its uploads came from, as a PNG on the
    training curve's round axis."""
    from matplotlib.ticker import MaxNLocator

    figure, [axis] = plot_axes(9.6, 2.8)
    for attack, points in curves.items():
        axis.plot([r for r, _ in points], [s for _, s in points], marker="o", linewidth=1.8, label=attack)
    axis.axhline(0.5, color="#9ca3af", linewidth=1, linestyle=":", label="recognisable (SSIM 0.5)")
    axis.set_ylim(0, 1)
    axis.set_ylabel("mean SSIM of the attack")
    axis.set_xlabel("round of the attacked uploads")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    xs: list[Any] = [row.get("round") for row in rounds if isinstance(row.get("round"), int)]
    if len(xs) > 1:
        axis.set_xlim(min(xs), max(xs))
    axis.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=4, frameon=False, borderaxespad=0.2)
    figure.tight_layout()
    return figure_png(figure)


# ----------------------------------------------------------------------------------------------
# Page sections
# ----------------------------------------------------------------------------------------------


def _strategy(recorded: RecordedConfig) -> str:
    """The strategy the run used: ``server.strategy``, with ``auto`` resolved for its protocol where this
    process knows the protocol (a protocol plugin's may not be importable here)."""
    name = str(recorded.value("server.strategy", AUTO_STRATEGY))
    try:
        return resolve_strategy(name, str(recorded.value("train.protocol", "")))
    except (KeyError, ValueError):
        return name


def _audited_app(run_dir: Path) -> dict[str, Any]:
    """What ``app.json`` says of the audited Flower app (``fedguard.flower.Audit``); empty for fedguard's own runs
    and for a file that cannot be read."""
    try:
        return read_json(run_dir / APP_FILE) or {}
    except (OSError, ValueError):
        return {}


def _chips(recorded: RecordedConfig, done: int, app: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) of the run's settings for the header, from the recorded keys (and of an audited Flower app,
    ``app``, its own strategy and nodes); ``done``: rounds logged."""
    get = recorded.value
    model = (recorded.names("model") or ["?"])[0]
    defense = (recorded.names("defense") or ["?"])[0]
    strategy = _strategy(recorded)
    attacks = [a for a in recorded.names("attack") if a != NO_ATTACK]
    planned, lr = _number(get("train.rounds")), _number(get("train.lr"))
    clients = f"{get('train.clients-per-round', '?')} of {get('partition.num-clients', '?')} per round"
    clients += f" ({get('partition.name', '?')})"
    strategy_text = recorded.described(f"server.{strategy}", strategy)
    if app:
        clients = f"{app.get('nodes', '?')} nodes, the app's own data"
        strategy_text = f"{app.get('strategy', '?')} (the app's own)"
    return [
        ("dataset", str(get("data.name", "?"))),
        ("model", recorded.described(f"model.{model}", model)),
        ("protocol", str(get("train.protocol", "?"))),
        ("rounds", f"{done} of {int(planned)}" if planned is not None and done < planned else str(done)),
        ("clients", clients),
        ("strategy", strategy_text),
        ("defense", recorded.described(f"defense.{defense}", defense)),
        ("attacks", "; ".join(recorded.described(f"attack.{a}", a) for a in attacks) or "none"),
        ("batch", f"{get('train.batch-size', '?')}" + (f", lr {lr:g}" if lr is not None else "")),
        ("seed", str(get("seed", "?"))),
    ]


def _header(run_dir: Path, recorded: RecordedConfig | None, problems: list[str], rounds: list[RoundRow]) -> str:
    name = str(recorded.value("name", run_dir.name)) if recorded else run_dir.name
    done = max((int(n) for row in rounds if (n := _number(row.get("round"))) is not None), default=0)
    chips: list[tuple[str, str]] = []
    if recorded:
        chips = _chips(recorded, done, _audited_app(run_dir))
    parts = [
        '<header class="top">',
        '<div class="eyebrow">fedguard run report</div>',
        f"<h1>{escape(name)}</h1>",
        f'<div class="folder">{escape(str(run_dir))}</div>',
    ]
    parts += [f'<p class="warn">{escape(problem)}</p>' for problem in problems]
    if chips:
        parts.append('<dl class="chips">')
        for label, value in chips:
            parts.append(f'<div class="chip"><dt>{escape(label)}</dt><dd>{escape(value)}</dd></div>')
        parts.append("</dl>")
    parts.append("</header>")
    return "\n".join(parts)


def _stats(rounds: list[RoundRow], attacks: list[AttackRow], found: list[LeftOut]) -> str:
    cards: list[tuple[str, str, str, str]] = []  # label, value, detail, css class
    scored = [row for row in rounds if _number(row.get("accuracy")) is not None]
    if scored:
        first, last = scored[0], scored[-1]
        best = max(scored, key=lambda row: row.get("accuracy") or 0.0)
        since = f"from {_pct(first['accuracy'])} at round {first.get('round')}"
        cards.append(("final accuracy", _pct(last["accuracy"]), since, ""))
        cards.append(("best accuracy", _pct(best["accuracy"]), f"at round {best.get('round')}", ""))
        cards.append(("final loss", _fmt(last.get("loss"), 4), f"from {_fmt(first.get('loss'), 4)}", ""))
    counts = left_out_counts(found)
    if found:
        total, bad = str(sum(counts.values())), "bad" if counts[FAILED] else ""
        cards.append(("clients left out", total, left_out_summary(found), bad))
    seconds = sum(n for row in rounds if (n := _number(row.get("seconds"))) is not None and math.isfinite(n))
    cards.append(("wall time", _duration(seconds), f"{len(rounds)} rows in {ROUNDS_FILE}", ""))
    if attacks:
        failed = sum(not _is_ok(row) for row in attacks)
        leaked = sum(_leaked(row) for row in attacks)
        cards.append(
            ("uploads attacked", str(len(attacks)), _not_ok(attacks) or "all finished", "bad" if failed else "")
        )
        cards.append(
            (
                f"leaked (SSIM > {LEAK_SSIM:g})",
                str(leaked),
                f"of {len(attacks) - failed} reconstructed",
                "bad" if leaked else "good",
            )
        )
    else:
        cards.append(("uploads attacked", "0", "no attack ran", ""))
    items = "".join(
        f'<div class="card {css}"><div class="label">{escape(label)}</div><div class="value">{escape(value)}</div>'
        f'<div class="detail">{escape(detail)}</div></div>'
        for label, value, detail, css in cards
    )
    return f'<section class="stats">{items}</section>'


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _training(rounds: list[RoundRow], attacks: list[AttackRow], images: EmbeddedImages) -> str:
    parts = ['<section class="panel">', "<h2>Training</h2>"]
    if not rounds:
        parts.append(f'<p class="empty">No round finished: {ROUNDS_FILE} holds no rows yet.</p>')
    else:
        png = _curve_png(rounds)
        parts.append(f'<figure class="curve">{images.tag(png, "test accuracy and loss per round", "figure")}</figure>')
        curves = leakage_by_round(attacks)
        if curves:
            leak = _leakage_png(curves, rounds)
            parts.append(
                f'<figure class="curve">{images.tag(leak, "mean SSIM of each attack per attacked round", "figure")}'
                "</figure>"
            )
        body = "".join(
            f"<tr><td>{escape(str(row.get('round', DASH)))}</td><td>{_pct(row.get('accuracy'), 2)}</td>"
            f"<td>{_fmt(row.get('loss'), 4)}</td><td>{escape(str(row.get('clients', DASH)))}</td>"
            f"<td>{_fmt(row.get('seconds'), 1)}</td></tr>"
            for row in rounds
        )
        parts.append(
            f"<details><summary>Round log ({len(rounds)} rows)</summary>"
            '<table class="data compact"><thead><tr><th>round</th><th>accuracy</th><th>loss</th>'
            "<th>uploads aggregated</th><th>seconds</th></tr></thead>"
            f"<tbody>{body}</tbody></table></details>"
        )
    parts.append("</section>")
    return "\n".join(parts)


# Badge colour of each row status: green for scored, amber for cut short (time limit, stopped run), red else.
STATUS_CSS = {"ok": "ok", "timeout": "timeout", "interrupted": "timeout"}


def _status_badge(row: AttackRow) -> str:
    status = str(row.get("status") or "unknown")
    return f'<span class="badge {STATUS_CSS.get(status, "error")}">{escape(status)}</span>'


def _not_ok(rows: list[AttackRow]) -> str:
    """How many rows did not end 'ok', by status: '2 not ok (1 error, 1 interrupted)', or '' when all did."""
    counts = Counter(str(row.get("status") or "unknown") for row in rows if not _is_ok(row))
    if not counts:
        return ""
    parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return f"{sum(counts.values())} not ok ({parts})"


def _ssim_cell(value: Any) -> str:
    number = _number(value)
    if number is None:
        return f'<td class="num">{DASH}</td>'
    width = max(0.0, min(1.0, number)) * 100
    css = " leak" if number > LEAK_SSIM else ""
    return (
        f'<td class="num ssim{css}"><span class="bar" style="width:{width:.0f}%"></span>'
        f'<span class="v">{_fmt(number, 3)}</span></td>'
    )


def _summary_table(attacks: list[AttackRow]) -> str:
    groups: dict[tuple[str, str], list[AttackRow]] = defaultdict(list)
    for row in attacks:
        groups[(str(row.get("attack", "?")), str(row.get("defense", "?")))].append(row)
    body = []
    for (attack, defense), rows in sorted(groups.items()):
        ok = [row for row in rows if _is_ok(row)]
        leaked = sum(_leaked(row) for row in ok)
        body.append(
            f"<tr><td>{escape(attack)}</td><td>{escape(defense)}</td>"
            f'<td class="num">{len(ok)}</td><td class="num{" bad" if len(rows) - len(ok) else ""}" '
            f'title="{escape(_not_ok(rows))}">{len(rows) - len(ok)}</td>'
            f'<td class="num">{_fmt(_median(r.get("psnr") for r in ok), 2)}</td>'
            f"{_ssim_cell(_mean(r.get('ssim') for r in ok))}"
            f'<td class="num">{_fmt(_mean(r.get("lpips") for r in ok), 3)}</td>'
            f'<td class="num">{_pct(_mean(r.get("label_accuracy") for r in ok))}</td>'
            f'<td class="num{" bad" if leaked else ""}">{leaked} of {len(ok)}</td>'
            f'<td class="num">{_fmt(_mean((r.get("floor") or {}).get("psnr") for r in ok), 2)} / '
            f"{_fmt(_mean((r.get('floor') or {}).get('ssim') for r in ok), 3)}</td></tr>"
        )
    return (
        '<table class="data"><thead><tr><th>attack</th><th>defense</th><th class="num">ok</th>'
        '<th class="num">not ok</th><th class="num" title="the median: one exact copy (100 dB) moves a mean by '
        'tens of dB">median PSNR (dB)</th><th class="num">mean SSIM</th>'
        '<th class="num">mean LPIPS</th><th class="num">mean label acc.</th>'
        f'<th class="num">SSIM &gt; {LEAK_SSIM:g}</th>'
        '<th class="num" title="flat images of each true image\'s mean colour">floor PSNR / SSIM</th></tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def _uploads_table(attacks: list[AttackRow], anchors: dict[int, str]) -> str:
    columns = 12
    body = []
    for index, row in enumerate(attacks):
        where = f"{escape(str(row.get('round', DASH)))}"
        client = escape(str(row.get("client", DASH)))
        if index in anchors:
            client = f'<a href="#{anchors[index]}">{client}</a>'
        body.append(
            f'<tr class="{"failed" if not _is_ok(row) else ""}"><td class="num">{where}</td>'
            f'<td class="num">{client}</td>'
            f"<td>{_attack_cell(row)}</td><td>{escape(str(row.get('defense', DASH)))}</td>"
            f'<td class="num">{escape(str(row.get("batch_size", DASH)))}</td><td>{_status_badge(row)}'
            f"{_floor_badge(row)}</td>"
            f'<td class="num">{_fmt(row.get("psnr"), 2)}</td>{_ssim_cell(row.get("ssim"))}'
            f"{_ssim_cell(row.get('best_ssim'))}"
            f'<td class="num">{_fmt(row.get("lpips"), 3)}</td><td class="num">{_pct(row.get("label_accuracy"))}</td>'
            f'<td class="num">{_fmt(row.get("seconds"), 1)}</td></tr>'
        )
        if not _is_ok(row):
            error = str(row.get("error") or f"status {row.get('status')!r} without an error message")
            body.append(f'<tr class="error-row"><td colspan="{columns}"><pre>{escape(error)}</pre></td></tr>')
    return (
        '<table class="data"><thead><tr><th class="num">round</th><th class="num">client</th><th>attack</th>'
        '<th>defense</th><th class="num">batch</th><th>status</th><th class="num">PSNR (dB)</th>'
        '<th class="num">SSIM</th><th class="num" title="the SSIM of the true image best reconstructed: a one-image '
        "attack's figure (fishing), where the mean over the batch is low by construction\">best image SSIM</th>"
        '<th class="num">LPIPS</th><th class="num">label acc.</th><th class="num">seconds</th></tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def _attack_cell(row: AttackRow) -> str:
    """The attack's name, marked "not adaptive" with the reason where an adaptive attack could not adapt."""
    name = escape(str(row.get("attack", DASH)))
    reason = (row.get("stats") or {}).get("not_adaptive")
    return f'{name} <span class="badge timeout" title="{escape(str(reason))}">not adaptive</span>' if reason else name


def _grid_cell(run_dir: Path, prefix: str, kind: str, alt: str, images: EmbeddedImages, notes: _Notes) -> str:
    """The grid ``<prefix>_<kind>.png`` embedded, or why it is not: missing, or outside the run folder."""
    name = grid_name(prefix, kind)
    try:
        path = inside(run_dir, name)
    except RunFileError as error:
        notes(str(error))
        return f'<div class="missing">{escape(name)} is outside the run folder; not embedded</div>'
    if not path.is_file():
        return f'<div class="missing">{escape(name)} is missing</div>'
    try:
        return images.tag(path.read_bytes(), alt, "grid", enlarge_to=400)
    except ValueError as error:
        notes(f"{path}: {error}; not embedded")
        return f'<div class="missing">{escape(name)} is not a readable PNG; not embedded</div>'


def _gallery_item(run_dir: Path, row: AttackRow, anchor: str, images: EmbeddedImages, notes: _Notes) -> str:
    prefix = str(row["images"])
    title = (
        f"Round {row.get('round', '?')} \u00b7 client {row.get('client', '?')} \u00b7 {row.get('attack', '?')}"
        f" \u00b7 defense {row.get('defense', '?')}"
    )
    cells = []
    for kind, label in zip(GRID_KINDS, ("client's data", "reconstruction")):
        inner = _grid_cell(run_dir, prefix, kind, f"{label}, {title}", images, notes)
        cells.append(f"<figure>{inner}<figcaption>{escape(label)}</figcaption></figure>")
    scores = [
        ("PSNR", _fmt(row.get("psnr"), 2, " dB")),
        ("SSIM", _fmt(row.get("ssim"), 3)),
        ("LPIPS", _fmt(row.get("lpips"), 3)),
        ("labels", _pct(row.get("label_accuracy"))),
        ("batch", str(row.get("batch_size", DASH))),
        ("time", _fmt(row.get("seconds"), 1, " s")),
    ]
    score_html = "".join(f"<span><b>{escape(k)}</b> {escape(v)}</span>" for k, v in scores)
    verdict = '<span class="badge error">leaked</span>' if _leaked(row) else _floor_badge(row)
    return (
        f'<article class="upload" id="{escape(anchor)}"><h3>{escape(title)} {verdict}</h3>'
        f'<div class="pair">{"".join(cells)}</div><p class="scores">{score_html}</p>'
        f"{_aligned_pairs(run_dir, row, images)}</article>"
    )


MAX_PAIRS = 32  # aligned pairs shown per attacked upload (the grids above show every image)


def _aligned_pairs(run_dir: Path, row: AttackRow, images: EmbeddedImages) -> str:
    """Each true image above the reconstruction matched to it, with that image's SSIM and PSNR (the first
    ``MAX_PAIRS``), from the vault and the reconstruction saved with the row; nothing where either is missing."""
    found = scored_images(run_dir, row)
    return "" if found is None else pairs_html(*found, row.get("per_image") or [], images, MAX_PAIRS)


def scored_images(run_dir: Path, row: AttackRow) -> tuple[np.ndarray, np.ndarray] | None:
    """(truth, reconstruction) of an attack row, (N, C, H, W) each, image i matched to image i; None where the
    files are missing, unreadable, outside the run folder or not images of one shape."""
    prefix = str(row.get("images"))
    try:
        inside(run_dir, recon_name(prefix))
        truth, recon = read_scored_images(run_dir, int(row.get("round", 0)), int(row.get("client", 0)), prefix)
    except (RunFileError, OSError, ValueError, TypeError):
        return None
    if truth is None or recon is None or truth.shape != recon.shape or truth.ndim != 4 or truth.shape[1] not in (1, 3):
        return None
    return truth, recon


def pairs_html(truth: np.ndarray, recon: np.ndarray, per_image: list[Any], images: EmbeddedImages, limit: int) -> str:
    """The first ``limit`` true images each above its reconstruction, captioned with ``per_image``'s SSIM and PSNR
    (dB), and a note of how many more there are."""
    figures = []
    for index in range(min(len(truth), limit)):
        buffer = BytesIO()
        Image.fromarray(grid_array(np.stack([truth[index], recon[index]]), columns=1, scale=None)).save(buffer, "PNG")
        scores = per_image[index] if index < len(per_image) and isinstance(per_image[index], dict) else {}
        caption = f"SSIM {_fmt(scores.get('ssim'), 2)} · {_fmt(scores.get('psnr'), 1)} dB"
        alt = f"image {index + 1}: the client's above, the reconstruction below"
        tag = images.tag(buffer.getvalue(), alt, "cell")
        figures.append(f"<figure>{tag}<figcaption>{caption}</figcaption></figure>")
    more = f'<p class="more">and {len(truth) - limit} more</p>' if len(truth) > limit else ""
    title = "each true image above its matched reconstruction"
    return f'<div class="pairs" title="{title}">{"".join(figures)}</div>{more}'


def _below_floor(row: AttackRow) -> bool:
    """Whether the attack did no better than flat images of each true image's mean colour (PSNR or SSIM)."""
    floor = row.get("floor") or {}
    psnr, ssim = _number(row.get("psnr")), _number(row.get("ssim"))
    floor_psnr, floor_ssim = _number(floor.get("psnr")), _number(floor.get("ssim"))
    return (psnr is not None and floor_psnr is not None and psnr <= floor_psnr) or (
        ssim is not None and floor_ssim is not None and ssim <= floor_ssim
    )


def _floor_badge(row: AttackRow) -> str:
    """A badge on an attack that did no better than the flat-image floor, or nothing."""
    if not (_is_ok(row) and _below_floor(row)):
        return ""
    return (
        '<span class="badge timeout" title="no better than flat images of each true image\'s mean colour: the '
        'attack recovered no more than the average colour">below the floor</span>'
    )


def _attacks(run_dir: Path, attacks: list[AttackRow], images: EmbeddedImages, notes: _Notes) -> str:
    if not attacks:
        return (
            '<section class="panel"><h2>Attacks</h2><p class="empty">No upload was attacked in this run.</p></section>'
        )
    anchors = {i: f"upload-{i + 1}" for i, row in enumerate(attacks) if _is_ok(row) and row.get("images")}
    gallery = "\n".join(_gallery_item(run_dir, attacks[i], anchor, images, notes) for i, anchor in anchors.items())
    not_ok = _not_ok(attacks)
    return "\n".join(
        [
            '<section class="panel"><h2>Attacks</h2>',
            f'<p class="lead">{len(attacks)} attacked upload{"s" if len(attacks) != 1 else ""}'
            f"{f', {not_ok}' if not_ok else ''}. Higher PSNR and SSIM and lower LPIPS mean a closer "
            f"reconstruction of the client's data; SSIM above {LEAK_SSIM:g} is marked as leaked.</p>",
            "<h3>By attack and defense</h3>",
            _summary_table(attacks),
            "<h3>Every attacked upload</h3>",
            _uploads_table(attacks, anchors),
            "</section>",
            '<section class="panel"><h2>Reconstructions</h2>',
            gallery or '<p class="empty">No attack produced images.</p>',
            "</section>",
        ]
    )


CSS = """
:root { --ink:#111827; --muted:#6b7280; --line:#e5e7eb; --bg:#f3f4f6; --card:#fff; --blue:#2563eb;
  --red:#dc2626; --red-bg:#fee2e2; --green:#15803d; --green-bg:#dcfce7; --amber:#b45309; --amber-bg:#fef3c7; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink); line-height:1.45;
  font:15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
main { max-width:1180px; margin:0 auto; padding:28px 24px 48px; }
header.top { background:linear-gradient(135deg,#1e3a8a,#2563eb); color:#fff; border-radius:14px; padding:26px 30px 22px; }
.eyebrow { text-transform:uppercase; letter-spacing:.12em; font-size:12px; opacity:.8; }
h1 { margin:4px 0 2px; font-size:30px; }
.folder { font-family:ui-monospace, "DejaVu Sans Mono", monospace; font-size:12px; opacity:.75; word-break:break-all; }
.chips { display:flex; flex-wrap:wrap; gap:8px; margin:16px 0 0; }
.chip { background:rgba(255,255,255,.14); border-radius:8px; padding:5px 10px; }
.chip dt { font-size:11px; text-transform:uppercase; letter-spacing:.08em; opacity:.75; }
.chip dd { margin:0; font-weight:600; }
.warn { background:var(--amber-bg); color:var(--amber); padding:6px 10px; border-radius:6px; }
.stats { display:grid; grid-template-columns:repeat(auto-fit, minmax(160px, 1fr)); gap:12px; margin:18px 0; }
.card { background:var(--card); border-radius:12px; padding:14px 16px; box-shadow:0 1px 2px rgba(0,0,0,.06);
  border-top:4px solid var(--blue); }
.card.bad { border-top-color:var(--red); } .card.good { border-top-color:var(--green); }
.card .label { font-size:12px; color:var(--muted); text-transform:uppercase; letter-spacing:.06em; }
.card .value { font-size:24px; white-space:nowrap; font-weight:700; font-variant-numeric:tabular-nums; }
.card .detail { font-size:12px; color:var(--muted); }
.panel { background:var(--card); border-radius:12px; padding:18px 22px 22px; margin:18px 0;
  box-shadow:0 1px 2px rgba(0,0,0,.06); }
h2 { margin:0 0 10px; font-size:20px; } h3 { font-size:15px; margin:18px 0 8px; }
.lead { color:var(--muted); margin-top:0; }
.empty { color:var(--muted); font-size:17px; padding:18px; background:var(--bg); border-radius:8px; text-align:center; }
figure { margin:0; }
.curve img { width:100%; height:auto; display:block; }
details summary { cursor:pointer; color:var(--blue); margin-top:8px; }
table.data { border-collapse:collapse; width:100%; font-size:13.5px; font-variant-numeric:tabular-nums; }
table.data th { text-align:left; font-weight:600; color:var(--muted); border-bottom:2px solid var(--line);
  padding:6px 8px; white-space:nowrap; }
table.data td { border-bottom:1px solid var(--line); padding:5px 8px; }
table.data tbody tr:nth-child(even):not(.error-row) { background:#f9fafb; }
table.compact { width:auto; margin-top:8px; }
.num { text-align:right; }
td.bad { color:var(--red); font-weight:700; }
td.ssim { position:relative; min-width:80px; }
td.ssim .bar { position:absolute; left:0; top:20%; height:60%; background:#dbeafe; border-radius:3px; }
td.ssim.leak .bar { background:#fecaca; } td.ssim.leak .v { color:var(--red); font-weight:700; }
td.ssim .v { position:relative; }
tr.failed td { color:var(--muted); }
tr.error-row td { padding:0 8px 8px; border-bottom:1px solid var(--line); }
tr.error-row pre { margin:0; padding:8px 10px; background:var(--red-bg); color:#7f1d1d; border-radius:6px;
  white-space:pre-wrap; word-break:break-word; max-height:12em; overflow:auto; font-size:12px; }
.badge { display:inline-block; border-radius:999px; padding:1px 9px; font-size:12px; font-weight:600; vertical-align:middle; }
.badge.ok { background:var(--green-bg); color:var(--green); }
.badge.error { background:var(--red-bg); color:var(--red); }
.badge.timeout { background:var(--amber-bg); color:var(--amber); }
a { color:var(--blue); }
.upload { border-top:1px solid var(--line); padding:14px 0 4px; }
.upload:first-of-type { border-top:0; }
.upload h3 { margin:0 0 10px; }
.pair { display:flex; flex-wrap:wrap; gap:18px; align-items:flex-start; }
.pair figure { background:var(--bg); padding:10px; border-radius:10px; text-align:center; max-width:100%; }
.pair img { display:block; max-width:100%; height:auto; image-rendering:pixelated; border-radius:2px; }
.pairs { display:flex; flex-wrap:wrap; gap:6px; margin-top:10px; }
.pairs figure { margin:0; text-align:center; }
.pairs img { display:block; image-rendering:pixelated; }
.pairs figcaption { font-size:11px; color:var(--muted); font-variant-numeric:tabular-nums; }
.more { font-size:12.5px; color:var(--muted); }
.pair figcaption { font-size:12.5px; color:var(--muted); margin-top:6px; text-transform:uppercase; letter-spacing:.06em; }
.missing { padding:40px 24px; color:var(--muted); font-style:italic; }
.scores { display:flex; flex-wrap:wrap; gap:6px 18px; margin:10px 0 0; font-variant-numeric:tabular-nums; }
.scores b { color:var(--muted); font-weight:600; }
footer { color:var(--muted); font-size:12px; text-align:center; margin-top:24px; }
"""  # noqa: E501 - one CSS rule a line

# Counts the embedded images the browser decoded, for tests and for anyone checking the file.
SCRIPT = """
window.addEventListener("load", function () {
  var images = document.querySelectorAll("img");
  var loaded = 0;
  for (var i = 0; i < images.length; i++) {
    if (images[i].complete && images[i].naturalWidth > 0) { loaded++; }
  }
  document.body.dataset.imagesTotal = String(images.length);
  document.body.dataset.imagesLoaded = String(loaded);
});
"""

# Nothing may come from outside the file: images only as data: URIs, inline style and script.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"


def render_report(run_dir: Path) -> str:
    """The HTML text of the report on ``run_dir`` (see ``build_report``)."""
    return _page(Path(run_dir), _Notes())


def _page(run_dir: Path, notes: _Notes) -> str:
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {run_dir} not found")
    if not (run_dir / ROUNDS_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} holds no {ROUNDS_FILE}; is it a run folder (see `fedguard run --out`)?")
    config, config_problem = _load_config(run_dir)
    rounds = sorted(
        (
            row
            for row in read_rounds(run_dir, notes)
            if (n := _number(row.get("round"))) is not None and math.isfinite(n)
        ),
        key=lambda row: row["round"],
    )
    # each invocation of an attack under a name of its own (fedguard attack's: "ig (attack-2)"), never averaged
    labelled = [cast(AttackRow, {**row, "attack": attack_label(row)}) for row in read_attacks(run_dir, notes)]
    attacks = sorted(labelled, key=_sort_key)
    images = EmbeddedImages()
    title = str(config.value("name", run_dir.name)) if config else run_dir.name
    found = left_out(rounds)
    sections = [
        _stats(rounds, attacks, found),
        _training(rounds, attacks, images),
        left_out_html(found),
        _attacks(run_dir, attacks, images, notes),
    ]
    problems = ([config_problem] if config_problem else []) + _ending(run_dir)
    body = "\n".join(
        [
            _header(run_dir, config, problems + notes.lines, rounds),
            *sections,
            f"<footer>Written by <code>fedguard report</code>; {images.count} embedded image"
            f"{'s' if images.count != 1 else ''}, no external resources.</footer>",
        ]
    )
    return page_html(f"{title} \u2014 fedguard report", CSS, body, images.count)


def page_html(title: str, css: str, body: str, images: int) -> str:
    """A self-contained page: ``body`` under ``title`` with ``css``, the CSP that lets nothing in from outside,
    and the script that counts the decoded images against the ``images`` embedded."""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n"
        f"<style>{css}</style></head>\n"
        f'<body data-images-expected="{images}"><main>\n{body}\n</main>\n'
        f"<script>{SCRIPT}</script>\n</body></html>\n"
    )


def build_report(run_dir: Path) -> Path:
    """Write ``run_dir/report.html`` and return its path.

    One self-contained page: the run name and key configuration, summary
    numbers, the accuracy and loss curve, a table per attack and defense and
    one per attacked upload (with the error text of failed attacks), and the
    client's data beside its reconstruction for every attack that produced
    images. Also writes ``comparison.png`` (``fedguard.report.comparison``). Raises ``FileNotFoundError`` when
    ``run_dir`` or its ``rounds.jsonl`` is missing, ``RunFileError`` naming the file and line of a damaged row;
    a missing ``attacks.jsonl`` means no attack ran. What is left out is listed on the page and warned once.
    """
    run_dir = Path(run_dir)
    notes = _Notes()
    text = _page(run_dir, notes)
    write_comparison(run_dir, notes)
    return write_atomic(run_dir / REPORT_FILE, text)


__all__ = ["build_report", "render_report"]
