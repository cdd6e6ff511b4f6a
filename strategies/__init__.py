"""Server strategies on Flower's message API: FedSGD, the registry of Flower's built-in strategies, and the
wrappers that capture uploads (honest-but-curious, malicious), decode sparse uploads, step gradients and
guard each round.

Each name is imported from its module on first use (PEP 562), so that a process that needs only the registry (a
client validating or rebuilding its configuration) loads none of the capture wrappers and the attack code they
hand uploads to.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strategies.fedsgd import FedSGD
    from strategies.gradient_step import GradientStep
    from strategies.honest_but_curious import HonestButCurious
    from strategies.malicious import Malicious
    from strategies.registry import STRATEGIES, StrategyContext, build_strategy, register_strategy
    from strategies.round_guard import AllClientsFailed, RoundGuard
    from strategies.sparse_uploads import SparseUploads
    from strategies.wrapper import StrategyWrapper

MODULE_OF = {
    "FedSGD": "strategies.fedsgd",
    "GradientStep": "strategies.gradient_step",
    "HonestButCurious": "strategies.honest_but_curious",
    "Malicious": "strategies.malicious",
    "STRATEGIES": "strategies.registry",
    "StrategyContext": "strategies.registry",
    "build_strategy": "strategies.registry",
    "register_strategy": "strategies.registry",
    "AllClientsFailed": "strategies.round_guard",
    "RoundGuard": "strategies.round_guard",
    "SparseUploads": "strategies.sparse_uploads",
    "StrategyWrapper": "strategies.wrapper",
}

__all__ = [
    "STRATEGIES",
    "AllClientsFailed",
    "FedSGD",
    "GradientStep",
    "HonestButCurious",
    "Malicious",
    "RoundGuard",
    "SparseUploads",
    "StrategyContext",
    "StrategyWrapper",
    "build_strategy",
    "register_strategy",
]


def __getattr__(name: str) -> Any:
    if name not in MODULE_OF:
        raise AttributeError(f"module 'strategies' has no attribute {name!r}")
    return getattr(importlib.import_module(MODULE_OF[name]), name)
