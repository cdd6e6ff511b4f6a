"""CENSOR: cold-posterior sampling of an update orthogonal to the true gradient.

Zhang et al., "CENSOR: Defense Against Gradient Inversion via Orthogonal Subspace Bayesian Sampling",
NDSS 2025 (Algorithm 1, Eq. 11-12, Section IV). Instead of its gradient G^0 = {g_l} (one tensor g_l per trainable
parameter, in ``model.parameters()`` order) the client uploads one of T random directions that carry none of
g_l's direction:

1. Phase 1, proposals (Eq. 12), per layer l and trial t = 1..T: draw r_l^t ~ N(0, I) of g_l's shape and remove its
   component along g_l:  o_l^t = r_l^t - (<r_l^t, g_l> / <g_l, g_l>) g_l,  so <o_l^t, g_l> = 0 exactly.
2. Phase 2, normalisation: G_l^t = o_l^t * ||g_l|| / ||o_l^t||, so every layer keeps its gradient norm.
3. Phase 3, scoring: the loss of the probe model theta^t = theta - probe_lr * G^t on the local batch,
   l_t = L(f_{theta^t}(x), y), against l_0 = L(f_theta(x), y) at the current parameters.
4. Selection (cold posterior P(theta | D)^{1/M}, Section IV-A): among the candidates that improve the loss
   (l_t < l_0, strict as in Algorithm 1) pick the one of least loss (temperature M = 0, the paper's best-of-T),
   or, for M > 0, sample candidate t with probability proportional to exp(-n l_t / M), n = batch size (n l_t is
   the negative log-likelihood of the batch). When no candidate improves the loss, the *fallback* applies.

The uploaded update is exactly orthogonal to the true gradient layer by layer (hence as a whole) and has the
same per-layer norms; what leaks is those norms and, through the selection, the loss landscape of the batch.

Decisions where the paper is silent, inconsistent or its code is wrong:

* Fallback: Algorithm 1 initialises G* = G^0, so when no candidate improves the loss the client uploads its raw
  gradient, the very leak the defense removes; ``fallback`` = 'raw' (the default) does exactly that. How often
  is reported: every upload reports ``upload.raw`` (1 when the raw gradient went out), so ``rounds.jsonl`` holds
  each round's raw fraction and which clients sent raw, and every attack row can be matched to it. The
  leak-free options: 'best' uploads the candidate the selection rule picks among all T anyway (the least-loss
  one at M = 0), 'zero' uploads zeros. An exactly orthogonal step has no first-order effect and best-of-T is
  sign-symmetric, so with 'best' training random-walks (8.5 % on the MNIST MLP where 'raw' reaches 89 %).
  Every fallback adds 1 to ``state['censor_fallbacks']`` and every defended step 1 to ``state['censor_steps']``.
* Projection: ``projection`` = 'exact' (the default) is Eq. 12, evaluated as <r, u> u with the unit vector
  u = g / ||g|| (the same as dividing by <g, g>, without squaring tiny gradients). 'published' is the published
  code's: r is scaled to unit norm, then r - (<r, g> / ||g||) g, which divides by ||g|| instead of ||g||^2 and
  is orthogonal only when ||g_l|| = 1 (residual <o, g> = <r, g>(1 - ||g||)); a zero o_l is left as it is. Both
  rescale o_l to ||g_l||. A zero g_l uploads zeros; a zero-norm o_l (r parallel to g) likewise under 'exact'.
* Temperature: the paper writes P(D|theta)^M, which flattens rather than sharpens for M < 1; its intent (M -> 0
  is the greedy MAP-like choice) is implemented as exp(-n l_t / M). Sampling with M > 0 is an extension: the
  paper only uses best-of-T.
* Probe step: the paper uses the server learning rate (the default 0.5 is fedguard's default ``train.lr``), the
  code a fixed 1e-4. With exact orthogonality the loss change is second order, (probe_lr^2 / 2) G^T H G, so a
  probe step as small as 1e-4 ranks the candidates by float32 rounding noise. For FedAvg uploads
  (``global - local``, already scaled by the local learning rate) use probe_lr = 1.
* Model mode: candidates are scored in the mode the client left the model in (fedguard computes G^0 in train
  mode, BatchNorm on batch statistics), through ``torch.func.functional_call`` on copies of the buffers, so the
  model's parameters and running statistics never change. The code scores in eval mode because its G^0 is
  computed in eval mode too.
* Active rounds: the code defends only the first 10 epochs and uploads raw gradients afterwards. ``active_rounds``
  = k defends rounds 1..k only and uploads the raw update later; the default 0 defends every round.
* Subspace: Algorithm 1's one vector per layer, not Eq. 11's span of all per-sample, per-label gradients.
* Cost: T Gaussian draws of the model's size and one forward pass of T + 1 parameter sets on the batch, batched
  with ``torch.func.vmap``; memory about 2T + 1 times the model (candidates and probe parameters).

``simulate`` (for EOT attacks, Section V-D) draws one proposal per job through phases 1-2: an attacker who lacks
the client's batch cannot score candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.func import functional_call, vmap

from fedguard.defenses.base import LocalStep, class_traits, register_defense
from fedguard.defenses.revealed import OrthogonalPerTensor
from fedguard.limits import MAX_LR

FALLBACKS = ("raw", "best", "zero")
PROJECTIONS = ("exact", "published")
FALLBACKS_KEY = "censor_fallbacks"
STEPS_KEY = "censor_steps"
RAW_KEY = "censor_raw"  # whether the latest upload was the raw gradient


@dataclass(frozen=True)
class CensorParams:
    """``trials``: candidates T per step; ``probe_lr``: step of the probe model theta - probe_lr * candidate;
    ``temperature``: M, 0 = least loss, > 0 = sample by exp(-n loss / M); ``fallback``: raw | best | zero, what
    is uploaded when no candidate improves the loss (raw: Algorithm 1's G* = G^0); ``projection``: exact |
    published (Eq. 12, or the published code's division by ||g||); ``active_rounds``: defend rounds 1..k only
    (0 = all)."""

    trials: int = 20
    probe_lr: float = 0.5
    temperature: float = 0.0
    fallback: str = "raw"
    projection: str = "exact"
    active_rounds: int = 0

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"trials must be >= 1, got {self.trials}")
        if not 0 < self.probe_lr < MAX_LR:
            raise ValueError(f"probe-lr must be > 0 and < {MAX_LR:g} (fedguard.limits.MAX_LR), got {self.probe_lr}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback {self.fallback!r}: choose one of {', '.join(FALLBACKS)}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection {self.projection!r}: choose one of {', '.join(PROJECTIONS)}")
        if self.active_rounds < 0:
            raise ValueError(f"active-rounds must be >= 0 (0 = every round), got {self.active_rounds}")


def orthogonal_rescaled(grad: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Rows of ``noise`` (K, n) minus their component along ``grad`` ((K or 1), n), rescaled to ||grad|| per row.

    Eq. 12 and Phase 2 of Algorithm 1; a zero ``grad`` row gives a zero row. Differentiable in ``grad`` when
    autograd tracks it; otherwise ``noise`` (the caller's scratch draw) is overwritten with the result, since a
    fresh allocation of T x the model costs more than the arithmetic.
    """
    tiny = torch.finfo(grad.dtype).tiny
    norm = torch.linalg.vector_norm(grad, dim=-1, keepdim=True)
    unit = grad / norm.clamp_min(tiny)
    along = torch.einsum("kn,kn->k", noise, unit.expand_as(noise)).unsqueeze(-1)
    tracked = torch.is_grad_enabled() and grad.requires_grad
    orth = noise - along * unit if tracked else noise.addcmul_(along, unit, value=-1)
    scale = norm / torch.linalg.vector_norm(orth, dim=-1, keepdim=True).clamp_min(tiny)
    return orth * scale if tracked else orth.mul_(scale)


def published_orthogonal_rescaled(grad: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The published code's Phases 1-2 on rows of ``noise`` (K, n) against ``grad`` ((K or 1), n).

    r = noise / ||noise||, o = r - (<r, g> / ||g||) g (orthogonal only when ||g|| = 1), then o rescaled to ||g||
    per row; a zero o is left as it is. Not in place.
    """
    tiny = torch.finfo(grad.dtype).tiny
    unit_noise = noise / torch.linalg.vector_norm(noise, dim=-1, keepdim=True).clamp_min(tiny)
    norm = torch.linalg.vector_norm(grad, dim=-1, keepdim=True)
    scalar = torch.einsum("kn,kn->k", unit_noise, grad.expand_as(unit_noise)).unsqueeze(-1) / norm.clamp_min(tiny)
    orth = unit_noise - scalar * grad
    orth_norm = torch.linalg.vector_norm(orth, dim=-1, keepdim=True)
    return torch.where(orth_norm > 0, orth * norm / orth_norm.clamp_min(tiny), orth)


PROJECT = {"exact": orthogonal_rescaled, "published": published_orthogonal_rescaled}


def choose_candidate(
    losses: torch.Tensor, base: torch.Tensor, batch_size: int, temperature: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the chosen candidate, whether no candidate improves on ``base``) as 0-d tensors.

    ``losses`` (T,) are the candidates' losses, ``base`` the loss at the current parameters. The choice is among
    the improving candidates (all T when none improves): the least loss at temperature 0, else a draw with
    probabilities proportional to exp(-batch_size * loss / temperature). Non-finite losses never improve.
    """
    losses = torch.nan_to_num(losses, nan=math.inf)
    improves = losses < base
    fell_back = ~improves.any()
    if temperature == 0:
        return losses.argmin(), fell_back
    eligible = (improves | fell_back) & losses.isfinite()
    # exp(-n (loss - least) / M): the least eligible loss has logit 0, so a small M sharpens the draw towards it
    # instead of overflowing every logit to -inf (a NaN softmax)
    least = torch.where(eligible, losses.double(), math.inf).min()
    logits = torch.where(eligible, -batch_size * (losses.double() - least) / temperature, -math.inf)
    logits = torch.where(eligible.any(), logits, torch.zeros_like(logits))
    probs = torch.softmax(logits, 0).to(generator.device)
    index = torch.multinomial(probs, 1, generator=generator)[0]
    return index.to(losses.device), fell_back


class Censor:
    """Upload a norm-matched direction orthogonal to each layer's gradient, chosen by the local loss."""

    def __init__(self, params: CensorParams) -> None:
        self.params = params

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        grads = [g.detach() for g in step.grads]
        if self.params.active_rounds and step.round > self.params.active_rounds:
            state[RAW_KEY] = torch.ones((), dtype=torch.long)
            return grads
        candidates = self.candidates(grads, step.generator)
        losses, base = probe_losses(step, candidates, self.params.probe_lr)
        index, fell_back = choose_candidate(losses, base, len(step.y), self.params.temperature, step.generator)
        chosen = [c.index_select(0, index.reshape(1)).squeeze(0) for c in candidates]
        if self.params.fallback == "zero":
            chosen = [c * (~fell_back).to(c.dtype) for c in chosen]
        elif self.params.fallback == "raw":
            chosen = [torch.where(fell_back, g, c) for g, c in zip(grads, chosen)]
        device = grads[0].device
        raw = fell_back.long() if self.params.fallback == "raw" else torch.zeros((), dtype=torch.long)
        state[RAW_KEY] = raw.to(device)
        for key, increment in ((FALLBACKS_KEY, fell_back.long()), (STEPS_KEY, torch.ones((), dtype=torch.long))):
            state[key] = state.get(key, torch.zeros((), dtype=torch.long)).to(device) + increment.to(device)
        return chosen

    def revealed(self) -> OrthogonalPerTensor:
        """Each tensor orthogonal to the gradient's and norm-matched, or the raw gradient under ``fallback`` raw."""
        return OrthogonalPerTensor(raw_fallback=self.params.fallback == "raw")

    def report(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """This client's fallback count and defended steps so far (rounds.jsonl keeps the largest per round),
        and ``upload.raw``: 1 when this upload is the raw gradient (a fallback to it, or an inactive round)."""
        return {
            "censor-fallbacks": float(state.get(FALLBACKS_KEY, 0)),
            "censor-steps": float(state.get(STEPS_KEY, 0)),
            "upload.raw": float(state.get(RAW_KEY, 0)),
        }

    def candidates(self, grads: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """The T proposals after phases 1-2: per gradient tensor of shape S, a tensor (T, *S).

        Draws, from ``generator``, one N(0, I) tensor (T, *S) per layer in order.
        """
        trials = self.params.trials
        project = PROJECT[self.params.projection]
        noises = [_normal((trials, g.numel()), g, generator) for g in grads]
        return [project(g.reshape(1, -1), r).reshape(trials, *g.shape) for g, r in zip(grads, noises)]

    def simulate(self, grads: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """One proposal per job of (J, ...) updates: a fresh direction orthogonal to each layer, norm-matched."""
        project = PROJECT[self.params.projection]
        return [
            project(g.flatten(1), _normal((g.shape[0], g[0].numel()), g, generator)).reshape(g.shape) for g in grads
        ]


def _normal(shape: tuple[int, int], like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Standard normal draws of ``shape`` from ``generator``, typed and placed like ``like``."""
    return torch.randn(shape, generator=generator, dtype=like.dtype, device=generator.device).to(like.device)


def probe_losses(step: LocalStep, candidates: list[torch.Tensor], probe_lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses (T,) at theta - probe_lr * candidate t, loss at theta) on the step's batch, in one batched call.

    The T + 1 parameter sets go through ``functional_call`` under ``vmap``, each with its own copy of the
    buffers, so BatchNorm in train mode leaves the model's running statistics untouched.
    """
    model = step.model
    trials = candidates[0].shape[0]
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    if len(trainable) != len(candidates):
        raise ValueError(
            f"the step has {len(candidates)} gradient tensors, the model {len(trainable)} trainable parameters"
        )
    batched = {}
    for (name, p), c in zip(trainable.items(), candidates):
        batched[name] = torch.empty((trials + 1, *p.shape), dtype=p.dtype, device=p.device)
        torch.add(p, c, alpha=-probe_lr, out=batched[name][:trials])
        batched[name][trials] = p
    buffers = {n: b.detach().unsqueeze(0).expand(trials + 1, *b.shape).clone() for n, b in model.named_buffers()}

    def loss(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        return step.loss_fn(functional_call(model, {**frozen, **params, **buffers}, (step.x,)), step.y)

    with torch.no_grad():
        losses = vmap(loss)(batched, buffers)
    return losses[:trials], losses[trials]


@register_defense("censor", params=CensorParams, traits=class_traits(Censor))
def build_censor(params: CensorParams) -> Censor:
    """CENSOR: norm-matched update orthogonal to each layer's gradient, chosen by the local loss."""
    return Censor(params)
