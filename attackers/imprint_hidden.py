"""An imprint module (``attackers.imprint``) written so that the clients' ``structure`` and ``drift`` detectors
(``fedguard.detect``) pass it, and its exact read-out.

Manipulation. Of the first Linear layer's ``n`` units, ``bins`` units drawn at random (not the first ones)
become bins, in ascending edge order ``u_0, ..., u_{K-1}``; every other unit keeps its row, its bias and its
next-layer column, so the model keeps most of what it learnt. Bin ``i`` keeps the norm of the row it replaces,
``r_i = ||W_{u_i}||``, with a gain ``g_i = sqrt(d) r_i``, and its next-layer column becomes a multiple of the
first bin's, with the norm of the column it replaces::

    W_{u_i} = (g_i / d) 1_d,    b_{u_i} = -g_i e_i,    V[:, u_i] = a_i V[:, u_0],    a_i = ||V_{u_i}|| / ||V_{u_0}||

Unit ``u_i`` fires when ``m(x) > e_i`` (the imprint's edges, from the same prior), and
``dl/dh_{u_i}(x) = a_i c(x)``: dividing bin i's update by ``a_i`` gives the imprint's, and its read-out is exact.
What the detectors see: no two bin rows (columns) are within ``structure``'s tolerance of each other, their
norms differing by the honest rows' spread (so no repeated rows, no bias ladder, no equal columns); the rows
are all positive, which ``trap-sign`` does not read; only ``bins`` of ``n`` rows and columns change, each to one
of its own norm, so the relative change ``drift`` scores is about ``sqrt(2 bins / n) / 2`` (0.25 for 32 of 256)
plus the honest step, under its 0.55. (A zero row or column, which has no norm to keep, gets norm 1.)
``dsnr`` flags no imprint. A detector that looked for rows whose entries are all equal, or for collinear
columns, would find these bins.

Attack. The bins are the first-layer rows the server sent whose entries are all equal and positive; their
gains are the row sums, their edges ``-b / g``, and ``a_i`` the projection of column ``u_i`` of the sent next
layer on column ``u_0`` (the bin of the lowest edge). The other units' activity does not enter the bins'
updates. Then the imprint read-out (``attackers.imprint.read_bins``) on the bins' updates divided by ``a_i``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from attackers.base import Reconstruction, class_traits, register_attack
from attackers.imprint import ImprintParams, bin_edges, next_layer, ordered_bins, read_bins
from attackers.manipulation import register_manipulation
from attackers.trap_weights import card_input_layer, first_layer_update
from fedguard.observation import ModelCard, Observation
from fedguard.registry import NoParams


@dataclass(frozen=True)
class HiddenImprintParams:
    """``bins``: bin units of the first layer (<= its units; fewer bins change less of the layer, which keeps
    ``drift`` low, and hold more collisions); ``edges``: the prior whose quantiles are the bin edges, as for
    ``imprint`` (``attackers.imprint.ImprintParams``); ``mean``: mean of the normal prior on an image's mean
    pixel (edges = 'normal'); ``std``: standard deviation of the normal prior (edges = 'normal'); ``public``: the
    data set whose held-out split the server fits the edges to, '' for the run's own (edges = 'public-normal'
    or 'public')."""

    bins: int = 32
    edges: str = "public-normal"
    mean: float = 0.45
    std: float = 0.2
    public: str = ""

    def imprint(self) -> ImprintParams:
        """The same bins and prior as ``imprint`` parameters (validated there)."""
        return ImprintParams(bins=self.bins, edges=self.edges, mean=self.mean, std=self.std, public=self.public)

    def __post_init__(self) -> None:
        self.imprint()


def nonzero(norms: np.ndarray) -> np.ndarray:
    """``norms`` (K,) with each zero replaced by 1 (a zero row or column, e.g. of an all-zero model, has no norm
    to keep)."""
    return np.where(norms > 0, norms, 1.0)


class HiddenImprint:
    """The manipulation: bins in randomly drawn first-layer units, norms kept, next-layer columns scaled."""

    def __init__(self, params: HiddenImprintParams) -> None:
        self.params = params

    def __call__(self, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]:
        index = card_input_layer(arrays, card)
        units, pixels = arrays[index].shape
        bins = self.params.bins
        if bins > units:
            raise ValueError(f"bins = {bins} exceeds the {units} units of {card.names[index]}; choose bins <= {units}")
        after = next_layer(arrays, card.names, card.trainable, index)
        edges = bin_edges(self.params.imprint(), card)
        chosen = rng.choice(units, size=bins, replace=False)
        weight, bias = arrays[index].astype(np.float64), arrays[index + 1].astype(np.float64)
        columns = arrays[after].astype(np.float64)
        gains = math.sqrt(pixels) * nonzero(np.linalg.norm(weight[chosen], axis=1))
        lengths = nonzero(np.linalg.norm(columns[:, chosen], axis=0))
        first = columns[:, chosen[0]]
        direction = first / lengths[0] if first.any() else np.full(len(first), 1 / math.sqrt(len(first)))
        weight[chosen] = gains[:, None] / pixels
        bias[chosen] = -gains * edges
        columns[:, chosen] = direction[:, None] * lengths[None, :]
        sent = [a.copy() for a in arrays]
        for i, values in ((index, weight), (index + 1, bias), (after, columns)):
            sent[i] = values.astype(arrays[i].dtype)
        return sent


@register_manipulation("imprint-hidden", params=HiddenImprintParams)
def build_hidden_imprint(params: HiddenImprintParams) -> HiddenImprint:
    """Imprint bins in random units with the replaced rows' and columns' norms: passes structure and drift."""
    return HiddenImprint(params)


def hidden_bins(obs: Observation, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bin units in ascending edge order, their edges, their measurement rows (K, d) with unit gain, their
    column scales ``a_i`` (K,)), read from the first layer and the next one the server sent (float64)."""
    weight = torch.tensor(obs.global_arrays[index], dtype=torch.float64)
    bias = torch.tensor(obs.global_arrays[index + 1], dtype=torch.float64)
    constant = (weight.amax(1) == weight.amin(1)) & (weight[:, 0] > 0)
    units = torch.nonzero(constant).flatten()
    if len(units) == 0:
        raise ValueError(
            f"the first layer {obs.names[index]} the server sent has no bin units (no row of equal positive "
            f"entries); was the upload computed on an imprint-hidden model?"
        )
    units, edges, measure = ordered_bins(weight, bias, units)
    after = next_layer(obs.global_arrays, obs.names, obs.trainable, index)
    columns = torch.tensor(obs.global_arrays[after], dtype=torch.float64)[:, units]
    first = columns[:, 0]
    scales = (first @ columns) / (first @ first)
    return units, edges, measure, scales


class HiddenImprintAttack:
    """Closed-form read-out of the inputs that fall alone in a hidden imprint bin."""

    needs: frozenset[str] = frozenset()
    needs_by_upload: Mapping[str, frozenset[str]] = {}
    uploads: frozenset[str] = frozenset({"gradient", "weights"})
    manipulation = "imprint-hidden"

    def reconstruct_one(self, obs: Observation) -> Reconstruction:
        """The inputs behind one upload (gradient or weights) of an imprint-hidden model."""
        start = time.perf_counter()
        index, weight_grad, bias_grad = first_layer_update(obs)
        units, edges, measure, scales = hidden_bins(obs, index)
        return read_bins(obs, edges, measure, weight_grad[units] / scales[:, None], bias_grad[units] / scales, start)

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        """``reconstruct_one`` of each upload (closed form: nothing to batch, nothing random: ``seed`` unused)."""
        return [self.reconstruct_one(obs) for obs in observations]


@register_attack("imprint-hidden", traits=class_traits(HiddenImprintAttack))
def build_hidden_imprint_attack(params: NoParams) -> HiddenImprintAttack:
    """The imprint read-out on the bins of an imprint-hidden model, each rescaled by its next-layer column."""
    return HiddenImprintAttack()
