"""Label recovery: how many of a batch's labels an attack got right, order ignored."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

Labels = torch.Tensor | np.ndarray | Sequence[int]


def as_label_list(labels: Labels, name: str) -> list[int]:
    """``labels`` as a list of Python ints; ``ValueError`` unless it is 1-D and integral."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    array = np.asarray(labels)
    if array.ndim != 1:
        raise ValueError(f"{name} labels must be 1-D; got shape {array.shape}")
    if array.size and not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.bool_)):
        raise ValueError(f"{name} labels must be integers; got dtype {array.dtype}")
    return [int(label) for label in array]


def label_accuracy(predicted: Labels, true: Labels) -> float:
    """Fraction of the true labels recovered, as multisets: |predicted ∩ true| / len(true), in [0, 1].

    Order is ignored and each predicted label counts at most as often as it
    occurs in ``true``: true [1, 1, 2] and predicted [1, 2, 2] score 2/3.
    """
    wanted = as_label_list(true, "true")
    if not wanted:
        raise ValueError("true labels are empty; accuracy is undefined")
    overlap = Counter(as_label_list(predicted, "predicted")) & Counter(wanted)
    return sum(overlap.values()) / len(wanted)
