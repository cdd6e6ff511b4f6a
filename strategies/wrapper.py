"""A Strategy that hands every call to another one: the base of the wrappers that change one step.

The wrappers follow Flower's own (``DifferentialPrivacyFixedClipping*``): they subclass
``flwr.serverapp.strategy.Strategy``, hold the wrapped strategy and override the steps they change, so
that ``start(grid, initial_arrays, ...)`` of the outermost one runs the whole federation.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy


class StrategyWrapper(Strategy):
    """Every method calls the same method of ``strategy``; subclasses override the steps they change."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.strategy!r})"

    def innermost(self) -> Strategy:
        """The strategy that really aggregates, under every wrapper."""
        inner = self.strategy
        while isinstance(inner, StrategyWrapper):
            inner = inner.strategy
        return inner

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def wrappers(self) -> list[str]:
        """The wrappers' class names, outermost first, down to the strategy that aggregates."""
        names: list[str] = []
        inner: Strategy = self
        while isinstance(inner, StrategyWrapper):
            names.append(type(inner).__name__)
            inner = inner.strategy
        return names

    def summary(self) -> None:
        """Name the strategy that aggregates and how it weighs the uploads (Flower's banner names the outermost
        wrapper), then its own summary."""
        log(INFO, "\t├──> %s", aggregation_line(self))
        self.strategy.summary()


def aggregation(strategy: Strategy) -> str:
    """How ``strategy`` combines the uploads: its own ``aggregation()`` where it has one (fedguard's FedSGD),
    ``mean weighted by '<key>'`` for Flower's FedAvg family, else nothing known."""
    own = getattr(strategy, "aggregation", None)
    if callable(own):
        return str(own())
    key = getattr(strategy, "weighted_by_key", None)
    return f"mean weighted by {key!r}" if key else "as its own aggregate_train does"


def aggregation_line(strategy: Strategy) -> str:
    """``<innermost> aggregates (<how>), behind <wrappers>``: the strategy that really aggregates."""
    inner = strategy.innermost() if isinstance(strategy, StrategyWrapper) else strategy
    behind = f", behind {' > '.join(strategy.wrappers())}" if isinstance(strategy, StrategyWrapper) else ""
    named = repr(inner) if type(inner).__repr__ is not object.__repr__ else type(inner).__name__  # Flower's have none
    return f"{named} aggregates ({aggregation(inner)}){behind}"
