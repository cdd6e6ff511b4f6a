"""Which invocation of an attack wrote a row of ``attacks.jsonl``: the run's own attacks (``run``) or one
``fedguard attack`` on the saved uploads (``attack-1``, ``attack-2``, ...), so that two budgets of one attack on
one upload stay two rows the readers tell apart and never average.

A row written before invocations were recorded is the run's own, or ``offline`` when its ``source`` says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

RUN_INVOCATION = "run"
LEGACY_OFFLINE = "offline"
_NUMBERED = re.compile(r"attack-(\d+)")


def invocation_of(row: Mapping[str, Any]) -> str:
    """The invocation that wrote ``row``."""
    recorded = row.get("invocation")
    if isinstance(recorded, str) and recorded:
        return recorded
    return LEGACY_OFFLINE if row.get("source") == LEGACY_OFFLINE else RUN_INVOCATION


def next_invocation(rows: Iterable[Mapping[str, Any]]) -> str:
    """The id of a new ``fedguard attack`` on a run holding ``rows``: ``attack-<n>``, one past the highest."""
    numbers = [int(m.group(1)) for row in rows if (m := _NUMBERED.fullmatch(invocation_of(row)))]
    return f"attack-{max(numbers, default=0) + 1}"


def own_rows(rows: Iterable[Mapping[str, Any]]) -> list[Any]:
    """The rows of the run's own attacks (those a sweep's verdict is made of)."""
    return [row for row in rows if invocation_of(row) == RUN_INVOCATION]


def attack_label(row: Mapping[str, Any]) -> str:
    """How the report names the attack of ``row``: its name for the run's own, ``<name> (<invocation>)`` else."""
    invocation = invocation_of(row)
    name = str(row.get("attack"))
    return name if invocation == RUN_INVOCATION else f"{name} ({invocation})"


def image_label(attack: str, invocation: str) -> str:
    """The part of an attacked upload's image files that names the attack: ``<attack>`` for the run's own,
    ``<attack>-<invocation>`` else."""
    return attack if invocation == RUN_INVOCATION else f"{attack}-{invocation}"
