"""Generators for generative-prior attacks: a small convolutional VAE whose decoder maps z ~ N(0, I) to images.

Pure torch. ``fedguard train-generator`` trains one on public data and saves it
as one ``.npz`` (no pickles); the ``ggl`` attack loads it.
"""

from attackers.generators.model import Decoder, Encoder
from attackers.generators.store import TrainedGenerator, default_generator_path, load_generator, save_generator
from attackers.generators.train import TrainOptions, train_generator, train_vae
from fedguard.trained.fitting import SPLITS, EpochStats

__all__ = [
    "SPLITS",
    "Decoder",
    "Encoder",
    "EpochStats",
    "TrainOptions",
    "TrainedGenerator",
    "default_generator_path",
    "load_generator",
    "save_generator",
    "train_generator",
    "train_vae",
]
