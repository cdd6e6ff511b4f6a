"""A manipulation of one's own, outside the fedguard package: the server multiplies one weight of the model it
sends by a factor.

A malicious server may send any values in the architecture the clients build. This one sends the global model
with its ``layer``-th weight (Linear matrices and convolution kernels, in parameter order) multiplied by
``factor``, to every client of the round it is scheduled in. It is an example of the interface, not an attack from
the literature: a scaled first layer scales the pre-activations after it, and with them how much of the update
the first layer carries. ``extensions/norm_jump.py`` is a detector that catches it.

Select it from the configuration (the module must be importable: this repository's root is)::

    fedguard run experiments/quickstart.toml --set server.plugins=extensions.scaled_layer \\
        --set threat.malicious=1:scaled-layer --set manipulation.scaled-layer.factor=10
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attackers.manipulation import Manipulation, register_manipulation
from fedguard.observation import ModelCard


@dataclass(frozen=True)
class ScaledLayerParams:
    """One weight of the sent model multiplied by a factor"""

    layer: int = field(default=0, metadata={"help": "which weight (0: the first matrix or kernel)"})
    factor: float = field(default=10.0, metadata={"help": "what that weight is multiplied by"})

    def __post_init__(self) -> None:
        if self.layer < 0:
            raise ValueError(f"layer = {self.layer!r}: must be >= 0")
        if not 0 < abs(self.factor) < 1e6:
            raise ValueError(f"factor = {self.factor!r}: must be non-zero and within +-1e6")


def weight_indices(arrays: list[np.ndarray], card: ModelCard) -> list[int]:
    """Indices of ``arrays`` that are trainable weights of two or more dimensions, in order."""
    return [i for i, (a, trainable) in enumerate(zip(arrays, card.trainable)) if trainable and a.ndim >= 2]


@register_manipulation("scaled-layer", params=ScaledLayerParams)
def build_scaled_layer(params: ScaledLayerParams) -> Manipulation:
    """Send the model with one weight multiplied by a factor"""

    def manipulate(arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]:
        indices = weight_indices(arrays, card)
        if params.layer >= len(indices):
            raise ValueError(f"layer = {params.layer}: this model has {len(indices)} weights (0-{len(indices) - 1})")
        sent = [a.copy() for a in arrays]
        index = indices[params.layer]
        sent[index] = (sent[index] * params.factor).astype(arrays[index].dtype)
        return sent

    return manipulate
