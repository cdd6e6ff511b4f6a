"""Selections of rounds or clients ('all', 'none', '1,3,5-7') read as intervals, so that bounding and counting
them allocates nothing however large their numbers: '1-1000000000' is one interval, not a billion integers.

A spec reads exactly as ``fedguard.selection.Selection.parse`` (the run's reader, which expands it) reads it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from fedguard.limits import shown

Interval = tuple[int, int]


@dataclass(frozen=True)
class Spans:
    """The integers a spec chooses, as sorted, disjoint inclusive ``intervals`` (None: every integer), and
    ``listed``: the integers the spec lists, repeats counted (what expanding it costs)."""

    spec: str
    intervals: tuple[Interval, ...] | None
    listed: int

    @classmethod
    def parse(cls, spec: str, key: str) -> Spans:
        """Read ``spec``; raises ``ValueError`` naming ``key``, the spec and what it may hold."""
        text = spec.strip().lower()
        if text == "all":
            return cls(spec, None, 0)
        if text in ("none", ""):
            return cls(spec, (), 0)
        pieces = [_piece(part.strip(), spec, key) for part in text.split(",")]
        return cls(spec, _merged(pieces), sum(high - low + 1 for low, high in pieces))

    def __contains__(self, number: int) -> bool:
        if self.intervals is None:
            return True
        index = bisect.bisect_right(self.intervals, (number, float("inf"))) - 1
        return index >= 0 and self.intervals[index][0] <= number <= self.intervals[index][1]

    def count(self, low: int, high: int) -> int:
        """How many chosen integers lie in [``low``, ``high``]."""
        if self.intervals is None:
            return max(high - low + 1, 0)
        return sum(max(min(b, high) - max(a, low) + 1, 0) for a, b in self.intervals)

    def is_empty(self) -> bool:
        """True when nothing is chosen."""
        return self.intervals == ()

    def outside(self, low: int, high: int) -> tuple[Interval, ...]:
        """The chosen intervals, or their parts, outside [``low``, ``high``] (for 'all': none)."""
        if self.intervals is None:
            return ()
        below = [(a, min(b, low - 1)) for a, b in self.intervals if a < low]
        above = [(max(a, high + 1), b) for a, b in self.intervals if b > high]
        return tuple(below + above)


def describe(intervals: tuple[Interval, ...], most: int = 4) -> str:
    """'3, 5-7, ...': the first ``most`` intervals as a spec would write them."""
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in intervals[:most]]
    return ", ".join(parts + (["..."] if len(intervals) > most else []))


def _piece(part: str, spec: str, key: str) -> Interval:
    """One comma-separated piece, 'n' or 'a-b' with 0 <= a <= b."""
    try:
        if "-" in part:
            low, high = (int(v) for v in part.split("-", 1))
            if low > high:
                raise ValueError
        else:
            low = high = int(part)
    except ValueError:
        raise ValueError(
            f"{key} = {shown(spec)}: cannot read {shown(part)}; write 'all', 'none' or integers "
            f"and ranges like '1,3,5-7'"
        ) from None
    if low < 0:
        raise ValueError(f"{key} = {shown(spec)}: {shown(part)} is negative")
    return low, high


def _merged(pieces: list[Interval]) -> tuple[Interval, ...]:
    """Sorted, disjoint intervals covering the same integers as ``pieces``."""
    merged: list[Interval] = []
    for low, high in sorted(pieces):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return tuple(merged)
