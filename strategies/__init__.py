"""Server strategies: FedSGD, the honest-but-curious and malicious capture wrappers, sparse-upload decoding."""

from strategies.delegating import DelegatingStrategy
from strategies.fedsgd import FedSGD
from strategies.honest_but_curious import HonestButCurious
from strategies.malicious import Malicious
from strategies.sparse_uploads import SparseUploads

__all__ = ["DelegatingStrategy", "FedSGD", "HonestButCurious", "Malicious", "SparseUploads"]
