"""Server strategies on Flower's message API: FedSGD, the registry of Flower's built-in strategies, and the
wrappers that capture uploads (honest-but-curious, malicious), decode sparse uploads, step gradients and
guard each round."""

from strategies.fedsgd import FedSGD
from strategies.gradient_step import GradientStep
from strategies.honest_but_curious import HonestButCurious
from strategies.malicious import Malicious
from strategies.registry import STRATEGIES, StrategyContext, build_strategy, register_strategy
from strategies.round_guard import AllClientsFailed, RoundGuard
from strategies.sparse_uploads import SparseUploads
from strategies.wrapper import StrategyWrapper

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
