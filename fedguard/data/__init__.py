"""Datasets by name, partitioning, and the shapes models are built for.

Importing this package registers every dataset source.
"""

from fedguard.data import local, offline  # noqa: F401  (registration)
from fedguard.data.dataset import ImageData, Split
from fedguard.data.registry import DATASETS, DatasetNotFoundError, SourceOptions, load_dataset
from fedguard.data.spec import DataSpec

__all__ = ["DATASETS", "DataSpec", "DatasetNotFoundError", "ImageData", "SourceOptions", "Split", "load_dataset"]
