"""Server strategies: FedSGD, and the honest-but-curious and malicious capture wrappers."""

from strategies.fedsgd import FedSGD
from strategies.honest_but_curious import HonestButCurious
from strategies.malicious import Malicious

__all__ = ["FedSGD", "HonestButCurious", "Malicious"]
