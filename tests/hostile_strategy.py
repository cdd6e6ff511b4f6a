"""Hostile server-side code as a plugin (``server.plugins=tests.hostile_strategy``), used by
``tests/test_plugin_faults.py``: Flower's FedAvg whose ``aggregate_train`` of round 2 raises (``server.strategy =
raising-fedavg``), calls ``sys.exit(0)`` (``exiting-fedavg``) or blocks for ``HANG_SECONDS`` (``hanging-fedavg``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg, Strategy

from strategies.registry import StrategyContext, register_strategy

FAILING_ROUND = 2
HANG_SECONDS = 600.0


class HostileFedAvg(FedAvg):
    """FedAvg that does ``how`` ('raise', 'exit' or 'hang') when it aggregates round ``FAILING_ROUND``."""

    def __init__(self, how: str, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.how = how

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if server_round == FAILING_ROUND:
            if self.how == "raise":
                raise RuntimeError(f"the plugin's aggregation broke in round {server_round}")
            if self.how == "exit":
                sys.exit(0)
            time.sleep(HANG_SECONDS)
        return super().aggregate_train(server_round, replies)


@register_strategy("raising-fedavg")
def build_raising(context: StrategyContext, params: object) -> Strategy:
    """FedAvg whose round-2 aggregation raises"""
    return HostileFedAvg("raise", **context.sampling())


@register_strategy("exiting-fedavg")
def build_exiting(context: StrategyContext, params: object) -> Strategy:
    """FedAvg whose round-2 aggregation calls sys.exit(0)"""
    return HostileFedAvg("exit", **context.sampling())


@register_strategy("hanging-fedavg")
def build_hanging(context: StrategyContext, params: object) -> Strategy:
    """FedAvg whose round-2 aggregation blocks"""
    return HostileFedAvg("hang", **context.sampling())
