"""The local training a FedAvg client declares with its upload, as the attacks replay it."""

from __future__ import annotations

from dataclasses import dataclass

from fedguard.observation import Observation
from fedguard.wire.declared import wire_key


@dataclass(frozen=True)
class LocalSchedule:
    """The local training a FedAvg client declared: SGD step ``lr``, ``epochs`` over its examples in
    minibatches of ``batch_size``."""

    lr: float
    epochs: int
    batch_size: int

    def steps(self, examples: int) -> int:
        """How many SGD steps the schedule takes over ``examples`` (the last minibatch of an epoch may be short)."""
        return self.epochs * -(-examples // self.batch_size)

    @classmethod
    def of(cls, obs: Observation) -> LocalSchedule:
        declared = obs.declared
        if declared.lr is None or declared.local_epochs is None or declared.batch_size is None:
            missing = next(name for name in ("lr", "local_epochs", "batch_size") if getattr(declared, name) is None)
            raise ValueError(f"a weights upload without the declared local hyper-parameter {wire_key(missing)!r}")
        return cls(declared.lr, declared.local_epochs, declared.batch_size)
