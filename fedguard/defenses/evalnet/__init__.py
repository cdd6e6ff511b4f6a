"""The evaluation network D of the Refiner defense: a noise-ratio regressor for images.

Pure torch. ``fedguard train-evalnet`` trains one on public data and saves it
as one ``.npz`` (no pickles); the ``refiner`` defense loads it.
"""

from fedguard.defenses.evalnet.model import EvalNet
from fedguard.defenses.evalnet.store import TrainedEvalNet, default_evalnet_path, load_evalnet, save_evalnet
from fedguard.defenses.evalnet.train import EvalNetOptions, blend, train_evalnet, train_regressor
from fedguard.trained.fitting import SPLITS, EpochStats

__all__ = [
    "SPLITS",
    "EpochStats",
    "EvalNet",
    "EvalNetOptions",
    "TrainedEvalNet",
    "blend",
    "default_evalnet_path",
    "load_evalnet",
    "save_evalnet",
    "train_evalnet",
    "train_regressor",
]
