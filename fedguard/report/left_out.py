"""The clients a round went without, from ``rounds.jsonl``: those that failed (their ClientApp raised or their
process died), that sent no reply within ``server.round-timeout`` (stragglers), whose upload the server rejected,
and whose detectors made them decline the round; each with its round, client and reason, for the run report."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

from fedguard.store.rows import RoundRow

FAILED, STRAGGLER, REJECTED, DECLINED = "failed", "straggler", "rejected", "declined"


@dataclass(frozen=True)
class LeftOut:
    """A client left out of a round: ``how`` (``FAILED``, ``STRAGGLER``, ``REJECTED``, ``DECLINED``) and why;
    ``count`` client-rounds (more than 1 only for failures a row counts without naming their clients)."""

    round: int
    client: str
    how: str
    reason: str
    count: int = 1


def _client(entry: dict[str, Any]) -> str:
    client = entry.get("client")
    return "?" if client is None else str(client)


def left_out(rounds: list[RoundRow]) -> list[LeftOut]:
    """Every client left out of a round, in round order, failures first."""
    found: list[LeftOut] = []
    for row in rounds:
        round_ = int(row.get("round") or 0)
        for entry in row.get("failed") or []:
            node = f" (node {entry['node']})" if entry.get("node") is not None else ""
            found.append(LeftOut(round_, _client(entry) + node, FAILED, str(entry.get("reason", ""))))
        unnamed = int(row.get("failures") or 0) - len(row.get("failed") or [])
        if unnamed > 0:  # a row written before failures carried their clients
            found.append(LeftOut(round_, "?", FAILED, f"{unnamed} client(s); no reason recorded", unnamed))
        for client in row.get("stragglers") or []:
            found.append(LeftOut(round_, str(client), STRAGGLER, "no reply within server.round-timeout"))
        for entry in row.get("rejected") or []:
            found.append(LeftOut(round_, _client(entry), REJECTED, str(entry.get("reason", ""))))
        for entry in row.get("detect") or []:
            if entry.get("action") in ("skip", "refuse"):
                reason = f"{entry['action']}: its detectors flagged the model it received"
                found.append(LeftOut(round_, _client(entry), DECLINED, reason))
    return found


def left_out_counts(found: list[LeftOut]) -> dict[str, int]:
    """How many client-rounds were left out, per ``how``."""
    return {how: sum(f.count for f in found if f.how == how) for how in (FAILED, STRAGGLER, REJECTED, DECLINED)}


def left_out_summary(found: list[LeftOut]) -> str:
    """How many client-rounds were left out, by how: '3 failed, 1 rejected'."""
    return ", ".join(f"{n} {how}" for how, n in left_out_counts(found).items() if n)


def left_out_html(found: list[LeftOut]) -> str:
    """A panel listing every client left out of a round (``left_out``), or '' when none was."""
    if not found:
        return ""
    counts = left_out_summary(found)
    css = {FAILED: "error", STRAGGLER: "timeout", REJECTED: "error", DECLINED: "timeout"}
    body = "".join(
        f"<tr><td>{f.round}</td><td>{escape(f.client)}</td>"
        f'<td><span class="badge {css[f.how]}">{f.how}</span></td><td><code>{escape(f.reason)}</code></td></tr>'
        for f in found
    )
    return (
        '<section class="panel"><h2>Clients left out of a round</h2>'
        f'<p class="lead">Client-rounds whose upload the server did not aggregate: {escape(counts)}.</p>'
        '<table class="data compact"><thead><tr><th>round</th><th>client</th><th>how</th><th>why</th></tr></thead>'
        f"<tbody>{body}</tbody></table></section>"
    )
