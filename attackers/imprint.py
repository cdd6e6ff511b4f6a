"""Robbing the Fed (Fowl et al., ICLR 2022, arXiv 2110.13057): the imprint (binning) module, built by a
malicious server from the first two Linear layers of the model it sends, and its closed-form read-out.

Manipulation. The first Linear layer on the flattened image, ``W`` (n, d) and ``b`` (n,), becomes ``K``
(``bins``) bin units that measure the mean brightness ``m(x) = (1/d) sum_j x_j`` of the input::

    W_i = (gain / d) 1_d,    b_i = -gain * e_i    for i < K,    h_i = ReLU(gain * (m(x) - e_i))
    W_i = 0,                 b_i = -gain          for i >= K    (switched off: never active)

with ascending edges ``e_i`` (``i >= 1``) the ``i / K`` quantiles of the server's prior on ``m``, so each bin
``[e_i, e_{i+1})`` holds 1/K of the inputs it expects: a normal ``N(mean, std)`` as in the paper,
``e_i = mean + std * Phi^-1(i / K)``, by default (``edges = 'public-normal'``) with ``mean`` and ``std`` those
of ``m`` over the held-out split of the run's data set (or of ``public``), with ``edges = 'normal'`` hand-set;
with ``edges = 'public'`` the empirical distribution of ``m`` there (``attackers.imprint_edges``). ``e_0``, far below
every expected measurement, stands in for ``Phi^-1(0) = -inf``: unit 0 fires for every input. The next
Linear layer's weight ``V`` (m, n) gets ``V[:, i] = V[:, 0]`` for every ``i < K``: then
``dl/dh_i(x) = V[:, i] . dl/dz(x)`` is one value ``c(x)`` for all bin units that ``x`` fires, the condition
that makes the differences below exact. Every other array is sent unchanged. With ``layout = 'one-shot'`` only
units 0 and 1 are rewritten, with the edges of the bin of the ``K`` that holds the prior's ``target`` quantile,
and only column 1 of ``V`` (made column 0); every other unit keeps its row, bias and column: the read-out gives
back the input alone in that bin, if one is.

Attack. Unit i fires for the inputs with ``m(x) > e_i``, so with ``c_k = c(x_k)``::

    dL/dW_i = (1/B) sum_{k: m(x_k) > e_i} c_k x_k,    dL/db_i = (1/B) sum_{k: m(x_k) > e_i} c_k
    x = (dL/dW_i - dL/dW_{i+1}) / (dL/db_i - dL/db_{i+1})      (the last bin: dL/dW_{K-1} / dL/db_{K-1})

is exactly the input whose measurement falls in ``[e_i, e_{i+1})`` when only one does. On FedAvg (a 'weights'
upload) the same read-out runs on the model difference ``global - uploaded = lr * sum_t dL_t/dW``: the ratio
needs no learning rate, and each input adds ``c_k x_k`` and ``c_k`` in the one step it is in. It is no longer
exact: the first step moves the bin rows (so later inputs may land one bin over) and makes the next layer's
bin columns differ slightly, so every bin difference is non-zero and the candidates carry small errors. A bin is
non-empty when
``|dL/db_i - dL/db_{i+1}|`` exceeds ``TINY`` times the largest ``|dL/db_i|``. A bin holding several inputs
returns their ``c``-weighted mean; it is counted as recovered only when consistent with one input: inside the
pixel box [0, 1] and with its measurement in its bin (both up to ``SLACK``). A mixture whose weights differ in
sign usually fails that test; one whose weights agree cannot be told from a single input. The B images
returned are the non-empty bins, consistent ones first, each group by decreasing ``|dL/db_i - dL/db_{i+1}|``
(an input's bin carries ``|c_k| / B``; the spurious bins of a FedAvg update far less); empty slots get a flat
0.5 image. On FedAvg few true inputs pass the consistency test, whose slack is exact-arithmetic tight, and the
ranking by bias difference carries the read-out. The
attacker reads the bin units and their edges from the first layer it sent.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attackers.base import Reconstruction, class_traits, images_per_upload, register_attack
from attackers.imprint_edges import EDGES, normal_edges, public_means, quantile_edges
from attackers.manipulation import register_manipulation
from attackers.trap_weights import TINY, as_images, card_input_layer, first_layer_update, in_box, upload_labels
from fedguard.data import SourceOptions
from fedguard.observation import ModelCard, Observation
from fedguard.registry import NoParams

SLACK = 1e-4  # pixel units: the tolerance of the consistency test
LAYOUTS = ("cumulative", "one-shot")


@dataclass(frozen=True)
class ImprintParams:
    """``bins``: bin units of the first layer (<= its units); ``edges``: the prior whose quantiles are the bin
    edges, 'public-normal' (the paper's normal prior with the mean and standard deviation of the mean pixels of a
    held-out split the server holds), 'normal' (that prior with hand-set ``mean`` and ``std``) or 'public' (the
    empirical distribution of those mean pixels); ``mean``: mean of the normal prior on an image's mean pixel
    (pixels in [0, 1]; edges = 'normal'); ``std``: standard deviation of the normal prior (pixel units;
    edges = 'normal'); ``public``: the data set whose held-out split the server fits the edges to, '' for the
    run's own (edges = 'public-normal' or 'public'); ``gain``: gain of the bin units; ``layout``: 'cumulative'
    (the paper's: ``bins`` bin units), or 'one-shot' (two units bounding one of ``bins`` bins of the prior, the
    others left as they were); ``target``: the quantile of the prior inside the one-shot bin (layout =
    'one-shot')."""

    bins: int = 64
    edges: str = "public-normal"
    mean: float = 0.45
    std: float = 0.2
    public: str = ""
    gain: float = 1.0
    layout: str = "cumulative"
    target: float = 0.5

    def __post_init__(self) -> None:
        if self.bins < 1:
            raise ValueError(f"bins must be >= 1, got {self.bins}")
        if self.edges not in EDGES:
            raise ValueError(f"edges {self.edges!r}: choose one of {', '.join(EDGES)}")
        if not self.std > 0:
            raise ValueError(f"std must be > 0, got {self.std}")
        if not self.gain > 0:
            raise ValueError(f"gain must be > 0, got {self.gain}")
        if not np.isfinite(self.mean):
            raise ValueError(f"mean must be finite, got {self.mean}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: choose one of {', '.join(LAYOUTS)}")
        if self.layout == "one-shot" and self.bins < 2:
            raise ValueError(f"layout = 'one-shot' bounds one of bins >= 2 bins of the prior, got bins = {self.bins}")
        if not 0 <= self.target < 1:
            raise ValueError(f"target must be a quantile in [0, 1), got {self.target}")


def public_source(params: ImprintParams, card: ModelCard | None) -> tuple[str, SourceOptions]:
    """(the data set whose held-out split the edges are fitted to, how it loads): ``params.public``, else the
    run's own (``card.data``); raises ``ValueError`` when neither names one."""
    if params.public:
        return params.public, SourceOptions()
    if card is None or not card.data:
        raise ValueError(
            f"edges = {params.edges!r} fits the bins to a held-out split, and neither public nor the model card "
            f"names a data set: set public (e.g. 'mnist-5k'), or edges = 'normal' with mean and std"
        )
    return card.data, card.source


def bin_edges(params: ImprintParams, card: ModelCard | None = None) -> np.ndarray:
    """(bins,) float64 edges of ``params``' prior, ascending (the public quantiles: non-decreasing, equal where
    public means tie), fitted where they are to the held-out split ``public_source`` names
    (``attackers.imprint_edges``)."""
    if params.edges == "normal":
        return normal_edges(params.bins, params.mean, params.std)
    means = public_means(*public_source(params, card))
    if params.edges == "public-normal":
        return normal_edges(params.bins, float(means.mean()), float(means.std()))
    return quantile_edges(params.bins, means)


def next_layer(arrays: list[np.ndarray], names: Sequence[str], trainable: Sequence[bool], index: int) -> int:
    """Index of the first trainable weight after entry ``index + 1`` that takes the ``index`` layer's units as
    input; raises ``ValueError`` naming the model's entries when there is none."""
    units = arrays[index].shape[0]
    for j in range(index + 2, len(arrays)):
        if trainable[j] and arrays[j].ndim == 2 and arrays[j].shape[1] == units:
            return j
    entries = ", ".join(f"{n} {a.shape}" for n, a in zip(names, arrays))
    raise ValueError(
        f"no trainable Linear layer takes the {units} units of {names[index]} as input "
        f"(imprint needs one); the model's entries: {entries}"
    )


class Imprint:
    """The manipulation: bin units in the first Linear layer, equal bin columns in the next one."""

    def __init__(self, params: ImprintParams) -> None:
        self.params = params

    def __call__(self, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]:
        index = card_input_layer(arrays, card)
        units, pixels = arrays[index].shape
        one_shot = self.params.layout == "one-shot"
        needed = 2 if one_shot else self.params.bins
        if needed > units:
            raise ValueError(
                f"bins = {self.params.bins} exceeds the {units} units of {card.names[index]}; choose bins <= {units}"
            )
        after = next_layer(arrays, card.names, card.trainable, index)
        edges = bin_edges(self.params, card)
        if one_shot:
            edges = one_shot_edges(edges, self.params.target)
        sent = [a.copy() for a in arrays]
        weight, bias = sent[index].astype(np.float64), sent[index + 1].astype(np.float64)
        if not one_shot:
            weight[:] = 0
            bias[:] = -self.params.gain  # switched off: never active
        weight[:needed] = self.params.gain / pixels
        bias[:needed] = -self.params.gain * edges
        sent[index] = weight.astype(arrays[index].dtype)
        sent[index + 1] = bias.astype(arrays[index + 1].dtype)
        sent[after][:, :needed] = sent[after][:, :1]
        return sent


def one_shot_edges(edges: np.ndarray, target: float) -> np.ndarray:
    """(2,) the lower and upper edge of the bin of ``edges`` (K,) that holds the prior's ``target`` quantile (the
    last bin, unbounded above, gives way to the one below it)."""
    lower = min(int(target * len(edges)), len(edges) - 2)
    return edges[lower : lower + 2]


@register_manipulation("imprint", params=ImprintParams)
def build_imprint(params: ImprintParams) -> Imprint:
    """Imprint module (Fowl et al. 2022): first-layer brightness bins with equal next-layer columns."""
    return Imprint(params)


def sent_bins(obs: Observation, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bin unit indices in ascending edge order, their edges, their measurement rows (K, d) with unit gain), all
    read from the first layer the server sent (float64): the bin units are its rows of one non-zero value
    repeated, which no trained or freshly drawn row is."""
    weight = torch.tensor(obs.global_arrays[index], dtype=torch.float64)
    bias = torch.tensor(obs.global_arrays[index + 1], dtype=torch.float64)
    constant = (weight.amax(1) == weight.amin(1)) & (weight.abs().sum(1) > 0)
    units = torch.nonzero(constant).flatten()
    if len(units) == 0:
        raise ValueError(
            f"the first layer {obs.names[index]} the server sent has no bin units (no row is one non-zero value "
            f"repeated); was the upload computed on an imprint model?"
        )
    return ordered_bins(weight, bias, units)


def ordered_bins(
    weight: torch.Tensor, bias: torch.Tensor, units: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``units`` in ascending edge order, their edges ``-b_i / g_i``, their measurement rows ``W_i / g_i``
    (K, d)) of the bin ``units`` of a first layer ``weight`` (n, d), ``bias`` (n,), with gains ``g_i``, the
    rows' sums."""
    gains = weight[units].sum(1)
    edges = -bias[units] / gains
    order = torch.argsort(edges)
    return units[order], edges[order], weight[units[order]] / gains[order, None]


class ImprintAttack:
    """Closed-form read-out of the inputs that fall alone in an imprint bin."""

    needs: frozenset[str] = frozenset()
    needs_by_upload: Mapping[str, frozenset[str]] = {}
    uploads: frozenset[str] = frozenset({"gradient", "weights"})
    sums: frozenset[str] = frozenset({"gradient", "weights"})  # the bins count the inputs of every client
    manipulation = "imprint"

    def reconstruct_one(self, obs: Observation) -> Reconstruction:
        """The inputs behind one upload (gradient or weights) of an imprint model."""
        start = time.perf_counter()
        index, weight_grad, bias_grad = first_layer_update(obs)
        units, edges, measure = sent_bins(obs, index)
        return read_bins(obs, edges, measure, weight_grad[units], bias_grad[units], start)

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        """``reconstruct_one`` of each upload (closed form: nothing to batch, nothing random: ``seed`` unused)."""
        return [self.reconstruct_one(obs) for obs in observations]


def read_bins(
    obs: Observation,
    edges: torch.Tensor,
    measure: torch.Tensor,
    weight_grad: torch.Tensor,
    bias_grad: torch.Tensor,
    start: float,
) -> Reconstruction:
    """The read-out of bins in ascending edge order (module docstring): their ``edges`` (K,), measurement rows
    ``measure`` (K, d) with unit gain, and the upload's ``weight_grad`` (K, d) and ``bias_grad`` (K,) of those
    bins, each as if its next-layer column were the first bin's (float64); ``start``: ``time.perf_counter()``
    when the read-out began (the ``seconds`` it reports)."""
    batch = images_per_upload(obs)
    delta_weight = weight_grad - torch.cat([weight_grad[1:], torch.zeros_like(weight_grad[:1])])
    delta_bias = bias_grad - torch.cat([bias_grad[1:], torch.zeros_like(bias_grad[:1])])
    scale = float(bias_grad.abs().max())
    filled = torch.nonzero(delta_bias.abs() > TINY * scale).flatten()
    candidates = delta_weight[filled] / delta_bias[filled, None]
    upper = torch.cat([edges[1:], torch.tensor([torch.inf], dtype=torch.float64)])
    measured = (measure[filled] * candidates).sum(1)
    consistent = in_box(candidates, SLACK) & (measured >= edges[filled] - SLACK) & (measured <= upper[filled] + SLACK)
    strength = delta_bias[filled].abs()
    ranked = sorted(range(len(filled)), key=lambda j: (not bool(consistent[j]), -float(strength[j])))[:batch]
    labels, inferred = upload_labels(obs, batch)
    stats: dict[str, Any] = {
        "recovered": sum(bool(consistent[j]) for j in ranked),
        "non_empty": len(filled),
        "bins": len(edges),
        "labels_inferred": inferred,
        "seconds": time.perf_counter() - start,
    }
    return Reconstruction(as_images([candidates[j] for j in ranked], batch, obs.spec), labels, stats)


@register_attack("imprint", traits=class_traits(ImprintAttack))
def build_imprint_attack(params: NoParams) -> ImprintAttack:
    """Robbing the Fed (Fowl et al. 2022): inputs read off differences of consecutive imprint bins."""
    return ImprintAttack()
