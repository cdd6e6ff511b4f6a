"""Sets of rounds or clients written as text: 'all', 'none', '1,3,5-7'."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Selection:
    """Integers chosen by a spec; ``members`` is None when every integer is chosen."""

    spec: str
    members: frozenset[int] | None

    @classmethod
    def parse(cls, spec: str, key: str = "selection") -> Selection:
        """Parse 'all', 'none' or comma-separated integers and inclusive ranges 'a-b' (>= 0)."""
        text = spec.strip().lower()
        if text == "all":
            return cls(spec, None)
        if text in ("none", ""):
            return cls(spec, frozenset())
        members: set[int] = set()
        for piece in text.split(","):
            part = piece.strip()
            try:
                if "-" in part:
                    low, high = (int(v) for v in part.split("-", 1))
                    if low > high:
                        raise ValueError
                    members.update(range(low, high + 1))
                else:
                    members.add(int(part))
            except ValueError:
                raise ValueError(
                    f"{key}: cannot read {spec!r}; write 'all', 'none' or integers and ranges like '1,3,5-7'"
                ) from None
        if any(m < 0 for m in members):
            raise ValueError(f"{key}: {spec!r} has a negative number")
        return cls(spec, frozenset(members))

    def __contains__(self, item: object) -> bool:
        return self.members is None or item in self.members

    def is_empty(self) -> bool:
        """True when nothing is chosen."""
        return self.members is not None and not self.members
