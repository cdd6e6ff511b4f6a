"""Soteria: prune the representation behind one fully connected layer's weight gradient.

Source: Sun, Li, Wang, Yang, Li, Chen, "Soteria: Provable Defense against Privacy Leakage in Federated
Learning from Representation Perspective", CVPR 2021 (arXiv 2012.06043), Algorithms 1 and 2.

The protected layer computes ``b = W r`` from the representation ``r = f(X)`` (L features) that the
network ``f`` before it extracts from the input X. Its weight gradient is ``dl/dW = (dl/db) r^T``: every
column is one feature of r, scaled, which is what gradient inversion feeds on. Soteria replaces r by a
perturbed r' that moves the reconstruction as far as possible from X (L2, p = 2) while changing at most
eps features (L0, q = 0), Eqs. 3-8:

    r' = argmax ||(d f / d X)^(-1) (r - r')||_2   s.t.  ||r - r'||_0 <= eps,

whose solution zeroes the eps features with the largest ``||r_i (d r_i / d X)^(-1)||_2``. With the
pseudo-inverse of the row ``g_i = d r_i / d X`` (a vector over all pixels of X) this score is

    score_i = |r_i| / ||d r_i / d X||_2                      (0 when r_i = 0 or g_i = 0),

and ``dl/dW' = (dl/db) r'^T`` is the raw weight gradient with the columns of those features zeroed.
The bias gradient, every other layer's gradient and the forward pass are unchanged (Algorithm 2).

Per call: one forward pass of ``step.model`` on ``step.x`` with a forward hook on the protected Linear's
input captures r (B, L); the L rows of the Jacobian d r / d X come from batched backward passes
(``torch.autograd.grad(..., is_grads_batched=True)``: cotangent ``e_i`` on every sample's feature i,
``max(1, chunk // B)`` features per pass). The forward runs through ``torch.func.functional_call`` on
detached parameters and cloned buffers, so the model's parameters and BatchNorm statistics are untouched.

Decisions where the paper is silent or its published code differs (notes: mjolnir-soteria.md, B.4, B.12):

* Score: ``|r_i| / ||g_i||_2``, the per-feature pseudo-inverse (notes B.12 #2). The pseudo-inverse of a
  zero row is zero, so a feature that does not depend on X, or is 0 (a dead ReLU), scores 0 and is pruned
  last; its column of a FedSGD gradient is already zero. Pruning then never spends its budget on dead
  features before live ones (the published GS code scores them first).
* Batch of B samples: one mask per batch from the summed per-sample scores ``s_i = sum_b score_bi`` (notes
  B.12 #3). The published code sums the inverse ratio ``||g|| / r`` and keeps the largest; summing the
  paper's ratio instead prunes every feature that is highly revealing for any one sample.
* Per-sample Jacobian: the cotangent ``e_i`` is set on feature i of all samples at once and sample b reads
  its own input gradient, as the published code does. This is exactly ``d r_bi / d X_b`` when samples do
  not interact (no BatchNorm in training mode, or B = 1, the attack setting). With train-mode BatchNorm and
  B > 1 it is ``d (sum_b' r_b'i) / d X_b``, the code's quantity; the notes' alternatives cost more or score
  another representation: eval-mode BatchNorm changes r itself (running, not batch, statistics), and exact
  per-sample blocks need B times the backward passes. The model runs in the mode the client used.
* Count: ``ceil(percent * L / 100)`` columns are zeroed (eps of the paper as a percentage of L, rounded up
  so that at least ``percent`` % of the features are pruned). Default 60 %, the code's GS setting; the
  paper reports images unrecognizable at 50-60 %. Ties are broken by the lower feature index.
* Layer (``layer``): a Linear module name from ``named_modules`` (its weight is ``<layer>.weight``); empty:
  the model's last Linear layer, i.e. the classifier fed by the deepest representation. For lenet, convnet
  and resnet18 this is their only Linear, the first FC after the conv stack (notes B.12 #4); for the mlp it
  is the hidden -> logits layer ("5"): its first Linear reads raw pixels (r = X, score = |x_i|), which
  Soteria's representation argument does not cover.
* Algorithm 2 defends every local SGD step. A defense here sees one upload, so the mask is computed once,
  at the global parameters on ``step.x``, and applied to the upload: the FedSGD gradient, or the FedAvg
  pseudo-gradient ``global - local`` (whose columns are sums of per-step columns).
* The mask depends on the private batch, so an attacker cannot re-apply the defense: no ``simulate``.
  The adaptive attack is Inverting Gradients that leaves ``<layer>.weight`` out (``attack.ig.skip``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.func import functional_call

from fedguard.defenses.base import DefenseTraits, LocalStep, register_defense
from fedguard.defenses.revealed import AlteredLayer


@dataclass(frozen=True)
class SoteriaParams:
    """``percent``: share of the protected layer's input features pruned, in [0, 100];
    ``layer``: Linear module name to protect ('' = the last Linear layer);
    ``chunk``: sample-feature pairs per batched backward pass, i.e. max(1, chunk // B) features (memory bound, >= 1)."""

    percent: float = 60.0
    layer: str = ""
    chunk: int = 256

    def __post_init__(self) -> None:
        if not (math.isfinite(self.percent) and 0 <= self.percent <= 100):
            raise ValueError(f"percent must be in [0, 100], got {self.percent}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's Linear modules by ``named_modules`` name, in module order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def resolve_layer(model: nn.Module, layer: str) -> str:
    """The Linear module name ``layer`` refers to ('' = the last one); ValueError naming the choices."""
    linears = linear_layers(model)
    if not linears:
        raise ValueError(f"soteria needs a Linear layer; {type(model).__name__} has none")
    name = layer.removesuffix(".") if layer else list(linears)[-1]
    if name not in linears:
        raise ValueError(
            f"layer {layer!r} is not a Linear layer of this model; its Linear layers: {', '.join(linears)}"
        )
    return name


def weight_index(model: nn.Module, name: str) -> int:
    """Position of ``<name>.weight`` among the trainable parameters (the order of ``step.grads``)."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    try:
        return trainable.index(f"{name}.weight")
    except ValueError:
        raise ValueError(
            f"layer {name!r} has no trainable weight; trainable parameters: {', '.join(trainable)}"
        ) from None


def representation(model: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """Input (B, L) of Linear ``name`` when ``model`` runs on ``x``, in the graph of ``x``.

    Parameters are detached and buffers cloned, so the model's state does not change."""
    captured: list[torch.Tensor] = []
    handle = linear_layers(model)[name].register_forward_hook(lambda m, inputs, out: captured.append(inputs[0]))
    state = {n: p.detach() for n, p in model.named_parameters()}
    state.update({n: b.clone() for n, b in model.named_buffers()})
    try:
        functional_call(model, state, (x,))
    finally:
        handle.remove()
    r = captured[0]
    if r.dim() != 2:
        raise ValueError(f"soteria needs a (batch, features) input to layer {name!r}, got shape {tuple(r.shape)}")
    return r


def input_gradient_norms(r: torch.Tensor, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, L): ``||d r_bi / d X_b||_2`` over the pixels of sample b; ``max(1, chunk // B)`` features per
    batched backward pass, each with cotangent ``e_i`` on feature i of every sample."""
    batch, features = r.shape
    step = max(1, chunk // batch)
    eye = torch.eye(features, dtype=r.dtype, device=r.device)
    norms = []
    for start in range(0, features, step):
        cotangents = eye[start : start + step, None, :].expand(-1, batch, -1)
        (g,) = torch.autograd.grad(r, x, cotangents, retain_graph=True, is_grads_batched=True)
        norms.append(torch.linalg.vector_norm(g.flatten(2), dim=2))
    return torch.cat(norms).T


def feature_scores(model: nn.Module, name: str, x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """(L,) batch score ``sum_b |r_bi| / ||d r_bi / d X_b||_2`` of each input feature of Linear ``name``."""
    param = next(model.parameters())
    x = x.detach().to(param.device, param.dtype).requires_grad_(True)
    r = representation(model, name, x)
    norms = input_gradient_norms(r, x, chunk)
    r = r.detach()
    inverse = torch.where(norms > 0, 1 / norms, torch.zeros_like(norms))
    return (r.abs() * inverse).sum(0)


def pruned_count(percent: float, features: int) -> int:
    """Number of features pruned: ``ceil(percent * features / 100)``."""
    return math.ceil(percent * features / 100)


def top_features(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest scores; ties go to the lower index."""
    return torch.argsort(scores, descending=True, stable=True)[:count]


class Soteria:
    """Zero the columns of one Linear layer's weight gradient whose input features score highest."""

    def __init__(self, params: SoteriaParams) -> None:
        self.params = params

    def revealed(self) -> AlteredLayer:
        """The protected Linear layer's weight gradient altered, the rest exact."""
        return AlteredLayer(self.params.layer)

    def pruned_features(self, model: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
        """Indices of the pruned input features of Linear ``name`` for the batch ``x``."""
        count = pruned_count(self.params.percent, linear_layers(model)[name].in_features)
        if count == 0:
            return torch.zeros(0, dtype=torch.long)
        return top_features(feature_scores(model, name, x, self.params.chunk), count)

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        name = resolve_layer(step.model, self.params.layer)
        index = weight_index(step.model, name)
        pruned = self.pruned_features(step.model, name, step.x)
        sent = list(step.grads)
        sent[index] = sent[index].index_fill(1, pruned.to(sent[index].device), 0)
        return sent


def check_layer(model: nn.Module, layer: str) -> None:
    """Raise ``ValueError`` naming the choices unless ``layer`` is a Linear layer of ``model`` with a trainable
    weight."""
    weight_index(model, resolve_layer(model, layer))


def soteria_traits(params: SoteriaParams) -> DefenseTraits:
    """The class's traits, with the model check that the protected layer exists (run when the configuration is
    checked)."""
    return DefenseTraits.of(Soteria, check_model=functools.partial(check_layer, layer=params.layer))


@register_defense("soteria", params=SoteriaParams, traits=soteria_traits)
def build_soteria(params: SoteriaParams) -> Soteria:
    """Soteria (Sun et al. 2021): prune the most revealing input features of one Linear layer's gradient."""
    return Soteria(params)
