"""MkDocs hook: reference pages written at build time from fedguard's own sources, never typed by hand.

A page line ``<!-- fedguard:config-keys -->`` becomes a table of every configuration key with its type, default and
meaning, read from ``fedguard.config.schema()``: the source ``fedguard config --keys`` prints.
A page line ``<!-- fedguard:cli -->`` becomes the ``--help`` text of ``fedguard`` and of each of its commands,
from ``fedguard.commands.cli.build_parser()``.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout's fedguard, whichever folder mkdocs runs from
    sys.path.insert(0, str(ROOT))

CONFIG_MARKER = "<!-- fedguard:config-keys -->"
CLI_MARKER = "<!-- fedguard:cli -->"
HELP_COLUMNS = "100"  # argparse wraps to $COLUMNS; a fixed width keeps the page the same on every machine


def _cell(text: str) -> str:
    """``text`` as literal table-cell Markdown: HTML and Markdown's special characters escaped."""
    text = html.escape(text, quote=False)
    for char in "\\`*_[]|":
        text = text.replace(char, "\\" + char)
    return text


def _group(key: str) -> tuple[str, str]:
    """(section, subsection) of a key: ``seed`` -> ('', ''), ``train.lr`` -> ('train', ''),
    ``defense.dp.clip`` -> ('defense', 'defense.dp')."""
    parts = key.split(".")
    if len(parts) == 1:
        return "", ""
    if len(parts) == 2:
        return parts[0], ""
    return parts[0], f"{parts[0]}.{parts[1]}"


def _table(rows: list[tuple[str, type, Any, str]]) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, kind, default, help_text in rows:
        lines.append(f"| `{key}` | {kind.__name__} | `{json.dumps(default)}` | {_cell(help_text)} |")
    return lines


def config_reference() -> str:
    """Every key of ``fedguard.config.schema()``, grouped by section, then by component."""
    from fedguard.config import schema

    keys = schema()
    sections: dict[str, dict[str, list[tuple[str, type, Any, str]]]] = {}
    for key, (kind, default, help_text) in keys.items():
        section, sub = _group(key)
        sections.setdefault(section, {}).setdefault(sub, []).append((key, kind, default, help_text))
    lines = [f"{len(keys)} keys, as `fedguard config --keys` prints them.", ""]
    for section, subsections in sections.items():
        lines += [f"## `{section}`" if section else "## Top-level keys", ""]
        for sub, rows in subsections.items():
            if sub:
                lines += [f"### `{sub}`", ""]
            lines += [*_table(rows), ""]
    return "\n".join(lines)


def _parsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and each of its sub-commands' parsers, with their command lines."""
    found = [(parser.prog, parser)]
    for action in parser._actions:  # argparse keeps sub-parsers here only
        if isinstance(action, argparse._SubParsersAction):
            found += [(sub.prog, sub) for sub in action.choices.values()]
    return found


def cli_reference() -> str:
    """``fedguard --help`` and ``fedguard COMMAND --help`` for every command."""
    from fedguard.commands.cli import build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        lines = []
        for prog, parser in _parsers(build_parser()):
            heading = "`fedguard`" if prog == "fedguard" else f"`{prog}`"
            lines += [f"## {heading}", "", "```text", f"$ {prog} --help", parser.format_help().rstrip(), "```", ""]
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the markers of a page with what they stand for."""
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown
