"""Server strategies: FedSGD, and the honest-but-curious capture wrapper."""

from strategies.fedsgd import FedSGD
from strategies.honest_but_curious import HonestButCurious

__all__ = ["FedSGD", "HonestButCurious"]
