"""A reproduction preset's table: the paper's number, ours from the sweep's runs, and how the settings differ.

A sweep preset may carry ``[sweep.paper]`` with a ``title`` and one ``[[sweep.paper.rows]]`` table per number::

    [[sweep.paper.rows]]
    what = "iDLG PSNR at epsilon 0.25 ||g|| (dB)"   # what is compared
    paper = "13.20 (Table 3, LeNet, MNIST)"         # the paper's number as printed, with where it is printed
    run = "privacy/refiner"                         # <setting>/<variant> of this sweep
    metric = "psnr"                                 # a dotted path into that run's sweep.jsonl row
    format = "{:.1f}"                               # optional: how ours is printed (default "{:.3g}")
    differs = "32x32 photo tiles, 4 uploads"        # how our setting differs from the paper's

``metric`` reads the run's row (``fedguard.commands.sweep.summarize_runs``, over its seeds): ``psnr``, ``ssim``,
``accuracy``, ``accuracy_share`` (of the sweep's baseline variant in the same setting), ``epsilon``,
``raw_fraction``, ``upload_share``, ``attacks.<attack>.<score>``, ``by_round.<round>.<score>`` (the strongest
attack's scores on the uploads of one round), ``privacy.<figure>`` (e.g. ``privacy.ssim_mean``,
``privacy.success_rate``: ``fedguard.report.leakage``), ``defense_report.<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROW_KEYS = ("what", "paper", "run", "metric", "format", "differs")
REQUIRED = ("what", "paper", "run", "metric", "differs")


@dataclass(frozen=True)
class PaperRow:
    """One compared number: ``run`` is ``<setting>/<variant>``, ``metric`` a dotted path into its row."""

    what: str
    paper: str
    run: str
    metric: str
    differs: str
    format: str = "{:.3g}"


@dataclass(frozen=True)
class PaperTable:
    """The ``[sweep.paper]`` table of a reproduction preset."""

    title: str
    rows: tuple[PaperRow, ...]


def parse_paper_table(table: Any, runs: set[str], where: str) -> tuple[PaperTable | None, list[str]]:
    """(the table, problems): every row checked for its keys, a known ``run`` and a usable ``format``."""
    if not isinstance(table, dict):
        return None, [f"{where}: [sweep.paper] must be a table with a title and [[sweep.paper.rows]]"]
    problems = [
        f"{where}: unknown key {key!r} in [sweep.paper] (choose title, rows)"
        for key in table
        if key not in ("title", "rows")
    ]
    rows: list[PaperRow] = []
    raw_rows = table.get("rows", [])
    if not isinstance(raw_rows, list) or not raw_rows:
        problems.append(f"{where}: [sweep.paper] needs at least one [[sweep.paper.rows]] table")
        raw_rows = []
    for index, row in enumerate(raw_rows, 1):
        label = f"{where}: paper row {index}"
        if not isinstance(row, dict):
            problems.append(f"{label} must be a table with {', '.join(REQUIRED)}")
            continue
        problems += [
            f"{label}: unknown key {key!r} (choose {', '.join(ROW_KEYS)})" for key in row if key not in ROW_KEYS
        ]
        problems += [f"{label}: missing {key!r}" for key in REQUIRED if not isinstance(row.get(key), str)]
        if isinstance(row.get("run"), str) and row["run"] not in runs:
            problems.append(
                f"{label}: run {row['run']!r} is not a <setting>/<variant> of this sweep "
                f"(choose {', '.join(sorted(runs))})"
            )
        fmt = row.get("format", PaperRow.format)
        try:
            str(fmt).format(1.0)
        except (ValueError, IndexError, KeyError):
            problems.append(f"{label}: format {fmt!r} cannot print a number (e.g. '{{:.1f}}', '{{:.1%}}')")
        if not any(p.startswith(label) for p in problems):
            rows.append(PaperRow(**{key: str(row[key]) for key in row}))
    return PaperTable(str(table.get("title", "")), tuple(rows)), problems


def metric_value(row: dict[str, Any], path: str, baseline: dict[str, Any] | None) -> float | None:
    """The number at dotted ``path`` in a sweep row, or None where the run did not produce it."""
    if path == "accuracy_share":
        accuracy, reference = row.get("accuracy"), (baseline or {}).get("accuracy")
        return accuracy / reference if accuracy is not None and reference else None
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def render_paper_table(table: PaperTable, rows: list[dict[str, Any]], baseline: str) -> str:
    """Markdown: one line per compared number with the paper's, ours and how the settings differ."""
    by = {f"{r['setting']}/{r['variant']}": r for r in rows}
    lines = [
        f"## {table.title}" if table.title else "## The paper and fedguard",
        "",
        "| what | paper | fedguard | run | how the setting differs |",
        "|---|---|---:|---|---|",
    ]
    for entry in table.rows:
        row = by.get(entry.run, {})
        setting = entry.run.split("/", 1)[0]
        value = metric_value(row, entry.metric, by.get(f"{setting}/{baseline}"))
        ours = "not measured" if value is None else entry.format.format(value)
        lines.append(f"| {entry.what} | {entry.paper} | {ours} | `{entry.run}` | {entry.differs} |")
    return "\n".join(lines) + "\n"
