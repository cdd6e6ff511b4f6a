"""Shape of a dataset's samples, all a model needs to know to be built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSpec:
    """Images of ``channels`` x ``height`` x ``width`` in [0, 1] with ``num_classes`` labels."""

    channels: int
    height: int
    width: int
    num_classes: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """One sample's shape (C, H, W)."""
        return (self.channels, self.height, self.width)
