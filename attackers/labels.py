"""Label inference from the gradient of the last linear layer (cross-entropy).

For the mean cross-entropy of a batch of B, the last layer's bias gradient is ``g_c = (Q_c - n_c) / B``:
``n_c`` samples of class c and ``Q_c = sum_i p_ic``, the softmax mass the batch puts on c. With batch
size 1 the label is the only negative entry (iDLG, Zhao et al. 2020).

Larger batches, ``method="offset"`` (the default), count ``n_c = Q_c - B g_c``: the softmax offset ``Q_c``
is added back to what the samples took away (LLG+, Wainakh et al., "User-Level Label Leakage from
Gradients in Federated Learning", PETS 2022). ``Q`` is estimated

- without the model, for an untrained one whose softmax is about uniform: ``Q_c = B / C``;
- with the global model's parameters (``weights``) as iLRG does (Ma et al., "Instance-wise Batch Label
  Restoration via Gradients in Federated Learning", ICLR 2023): ``dW_c / g_c`` is an average penultimate
  embedding of class c, the last layer's softmax there the probabilities ``p_c`` of its samples, and the
  counts solve ``sum_j n_j p_j - n = B g`` with ``sum_c n_c = B`` (least squares). With ten classes
  ``Q_c`` often nearly equals ``n_c``, and the ratio then amplifies the spread of the class's samples:
  it is first damped towards the zero embedding, ``dW_c g_c / (g_c^2 + (Q_c / 2B)^2)``, then, where the
  class's own term dominates, re-solved from ``B dW_c = sum_{j != c} n_j p_jc e_j - n_c (1 - p_cc) e_c``
  with the other classes' embeddings known.

Measured on untrained models and real digits (``tests/test_labels.py``: uneven batches with four or five
singletons): the uniform offset restores the MLP's counts exactly at batch 16 and 32. The DLG LeNet's
softmax is far from uniform (one class often takes over 0.7), and only the model's own probabilities
come close: total count error at most 2 at batch 16 and 4 at batch 32 (means 0.3 and 0.6), where the
plain rule and the uniform offset both err by 5 and 11 on average. Undamped iLRG misses more on both.

Each sample lowers its class's bias entry by exactly 1/B. Without a bias the signal is the weight
gradient's row sums, where a sample's impact is the sum of its (non-negative, after ReLU or sigmoid)
inputs to the last layer over B: estimated as the smallest impact that leaves no class a negative count
under the uniform offset (exact for the mean sample when a class is absent; the counts stay approximate,
as the sums vary). The estimates are rounded to counts that sum to B by largest remainders; a class with
a clearly negative entry is present (``Q_c >= 0``) and keeps at least one sample.

``method="plain"``: ``round(-B g_c)`` over the negative classes (the counting rule of LLG), which leaves
the offset in: on untrained models from about batch 16 on, classes with few samples vanish.

An upload that sent only some entries (``sparse``: pruning, DGP; the others arrive as zeros) may lack exactly the
entries these rules read: DGP removes the largest of every tensor, the true classes' bias entries among them
(batch 1: the label's own). ``fill_unsent_bias`` then estimates the missing bias entries from the weight rows:
every sample adds ``(p_ic - y_ic) h_i`` to the weight's row c and ``p_ic - y_ic`` to the bias, so with one
embedding the row is the bias entry times it, ``dW_c = g_c h``; ``h`` is fitted from the classes whose bias and
weight entries were both sent and each unsent ``g_c`` is the least-squares factor of its sent row on ``h``
(exact for a batch of one). A class whose row shares no entry with ``h`` stays unknown and counts as absent;
without any bias entry sent the weight rows' sums over their sent entries are the signal.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from fedguard.observation import Observation
from fedguard.wire.declared import Declared

Method = Literal["offset", "plain"]
METHODS: tuple[str, ...] = get_args(Method)
DAMPED_ROUNDS = 3  # rounds of damped iLRG embeddings, each damped with the previous round's masses Q
REFINEMENTS = 5  # rounds re-solving the embeddings that the iLRG ratio leaves ill-conditioned
PRESENT = 1e-3  # an entry below -PRESENT of one sample's impact names a present class
COMPLETION_ROUNDS = 2000  # at most, of the alternating least squares fitting a sparse upload's last layer


def last_layer(tensors: list[torch.Tensor], num_classes: int) -> tuple[int | None, int | None]:
    """Indices (weight, bias) of the last layer with ``num_classes`` outputs among gradients or parameters
    in ``state_dict`` order; None for a part it lacks."""
    for index in range(len(tensors) - 1, -1, -1):
        t = tensors[index]
        if t.dim() == 2 and t.shape[0] == num_classes:
            return index, None
        if t.dim() == 1 and t.shape[0] == num_classes:
            before = tensors[index - 1] if index > 0 else None
            paired = before is not None and before.dim() == 2 and before.shape[0] == num_classes
            return (index - 1 if paired else None), index
    raise ValueError(f"no last-layer gradient with {num_classes} rows among shapes {[tuple(t.shape) for t in tensors]}")


def last_layer_signal(grads: list[torch.Tensor], num_classes: int) -> torch.Tensor:
    """(classes,) per-class signal: the last bias gradient, or the last weight gradient's row sums."""
    weight, bias = last_layer(grads, num_classes)
    if bias is not None:
        return grads[bias].detach().float()
    assert weight is not None  # last_layer finds a weight where it finds no bias
    return grads[weight].detach().float().sum(1)


def infer_labels(
    grads: list[torch.Tensor],
    num_classes: int,
    batch_size: int,
    method: Method = "offset",
    weights: list[torch.Tensor] | None = None,
    sparse: bool = False,
) -> torch.Tensor:
    """Estimated labels (batch_size,) int64, sorted by class.

    ``weights``: the global model's trainable parameters, in the order of ``grads``; with them the
    ``offset`` method takes the softmax offset from the model (iLRG) instead of assuming 1/C. ``sparse``: the
    upload's zeros are entries a defense did not send (``fill_unsent_bias``).
    """
    if method not in METHODS:
        raise ValueError(f"unknown label inference method {method!r}; expected one of {METHODS}")
    if sparse:  # the model's softmax (iLRG) would read class embeddings from the fit: the uniform offset does better
        grads, weights = fill_unsent_bias(grads, num_classes), None
    signal = last_layer_signal(grads, num_classes)
    if batch_size == 1:
        return signal.argmin().reshape(1).long()
    if method == "plain":
        return plain_labels(signal, batch_size)
    estimate, impact = offset_counts(grads, num_classes, batch_size, weights)
    counts = round_counts(estimate, batch_size, signal.double().cpu() < -PRESENT * impact)
    return torch.repeat_interleave(torch.arange(num_classes), counts)


def offset_counts(
    grads: list[torch.Tensor], num_classes: int, batch_size: int, weights: list[torch.Tensor] | None
) -> tuple[torch.Tensor, float]:
    """Real-valued counts (classes,) float64 with the softmax offset added back, and one sample's impact
    on the signal."""
    weight, bias = last_layer(grads, num_classes)
    if weights is not None:
        if weight is None or bias is None:
            raise ValueError("the model's softmax offset (iLRG) needs the last layer's weight and bias gradients")
        return ilrg_counts(grads[weight], grads[bias], weights[weight], weights[bias], batch_size), 1 / batch_size
    signal = last_layer_signal(grads, num_classes).double().cpu()
    impact = 1 / batch_size if bias is not None else row_sum_impact(signal, batch_size)
    return batch_size / num_classes - signal / impact, impact


def row_sum_impact(sums: torch.Tensor, batch_size: int) -> float:
    """One sample's mean impact on the weight gradient's row sums (classes,): the smallest that gives no
    class a negative count under the uniform offset, ``C max_c sums_c / B``."""
    return max(len(sums) * float(sums.max()) / batch_size, torch.finfo(torch.float64).tiny)


def fill_unsent_bias(grads: list[torch.Tensor], num_classes: int) -> list[torch.Tensor]:
    """``grads`` with the last bias's unsent (zero) entries estimated. The weight and the bias side by side,
    ``[dW | g]`` (C, d + 1), are fitted on their sent entries by the rank-one matrix ``u [h | 1]``
    (alternating least squares until it settles, at most ``COMPLETION_ROUNDS``; exact for a batch of one), and an
    unsent ``g_c`` is read
    as ``u_c``. A class whose sent weight entries share no column with another class's has no scale in that fit
    (DGP removed the largest entries of its row, leaving only those where ``h`` is small, which the other rows
    lost to the bottom band): such classes share what the bias lacks to sum to zero, as the softmax's gradient
    always does. Unchanged without a bias, when every bias entry was sent, or when none was."""
    weight, bias = last_layer(grads, num_classes)
    if weight is None or bias is None:
        return grads
    b = grads[bias].detach().double().cpu()
    unsent = b == 0
    if bool(unsent.all()) or not bool(unsent.any()):
        return grads
    w = grads[weight].detach().double().cpu().flatten(1)
    matrix = torch.cat([w, b[:, None]], dim=1)  # (C, d + 1)
    known = (matrix != 0).double()
    tiny = torch.finfo(torch.float64).tiny
    v = torch.ones(matrix.shape[1], dtype=torch.float64)
    u = torch.zeros(matrix.shape[0], dtype=torch.float64)
    for round_ in range(COMPLETION_ROUNDS):
        previous = u
        u = (known * matrix * v).sum(1) / (known * v**2).sum(1).clamp_min(tiny)
        v = (known * matrix * u[:, None]).sum(0) / (known * u[:, None] ** 2).sum(0).clamp_min(tiny)
        v = v / v[-1] if abs(float(v[-1])) > tiny else v  # the bias column's factor is 1
        if round_ % 50 == 49 and bool(((u - previous).abs() <= 1e-12 * u.abs().max()).all()):
            break
    shared = (known * ((known.sum(0, keepdim=True) - known) > 0)).sum(1)  # (C,) columns known in another row too
    alone = unsent & (shared == 0)
    filled = torch.where(unsent, u, b)
    if bool(alone.any()):
        filled = torch.where(alone, -filled[~alone].sum() / int(alone.sum()), filled)
    out = list(grads)
    out[bias] = filled.to(grads[bias].dtype).to(grads[bias].device)
    return out


def ilrg_counts(
    weight_grad: torch.Tensor, bias_grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, batch_size: int
) -> torch.Tensor:
    """Real-valued counts (classes,) float64 from the last layer's gradients (C, d), (C,) and weights (C, d),
    (C,): class embeddings, their softmax and a linear solve (iLRG), from the uniform-offset counts on."""
    dw, g, w, b = (torch.as_tensor(t).detach().double().cpu() for t in (weight_grad, bias_grad, weight, bias))
    classes = len(g)
    counts = batch_size / classes - batch_size * g
    probabilities = torch.full((classes, classes), 1 / classes, dtype=torch.float64)
    for _ in range(DAMPED_ROUNDS):
        mass = (counts.clamp(min=0)[:, None] * probabilities).sum(0)  # Q (C,)
        embeddings = damped_embeddings(dw, g, mass, batch_size)
        probabilities = torch.softmax(embeddings @ w.T + b, 1)
        counts = solve_counts(probabilities, g, batch_size)
    for _ in range(REFINEMENTS):
        embeddings = refine_embeddings(embeddings, probabilities, counts, batch_size * dw)
        probabilities = torch.softmax(embeddings @ w.T + b, 1)
        counts = solve_counts(probabilities, g, batch_size)
    return counts


def damped_embeddings(
    weight_grad: torch.Tensor, bias_grad: torch.Tensor, mass: torch.Tensor, batch_size: int
) -> torch.Tensor:
    """Class embeddings (C, d): iLRG's ratio ``dW_c / g_c``, damped to ``dW_c g_c / (g_c^2 + t_c^2)`` with
    ``t_c = Q_c / 2B`` (``mass``: Q (C,)), which pulls toward 0 a class whose ratio would amplify the spread
    of its samples more than twofold (``Q_c / |B g_c| > 2``)."""
    damping = (mass.clamp(min=1e-6) / (2 * batch_size)) ** 2
    return weight_grad * (bias_grad / (bias_grad**2 + damping))[:, None]


def solve_counts(probabilities: torch.Tensor, bias_grad: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Counts (classes,) solving ``sum_j n_j p_j - n = B g`` and ``sum n = B`` in least squares; row j of
    ``probabilities`` (C, C) is the softmax of class j's samples."""
    classes = len(bias_grad)
    system = torch.cat([torch.ones(1, classes, dtype=torch.float64), probabilities.T - torch.eye(classes)])
    target = torch.cat([torch.tensor([float(batch_size)], dtype=torch.float64), batch_size * bias_grad])
    return torch.linalg.lstsq(system, target[:, None], driver="gelsd").solution[:, 0]


def refine_embeddings(
    embeddings: torch.Tensor, probabilities: torch.Tensor, counts: torch.Tensor, scaled_grad: torch.Tensor
) -> torch.Tensor:
    """Class embeddings (C, d) re-solved from ``B dW_c = sum_{j != c} n_j p_jc e_j - n_c (1 - p_cc) e_c``
    where the class's own term is more than half the others' mass (the iLRG ratio divides by their
    difference, which is then the smaller); ``scaled_grad`` is ``B dW`` (C, d)."""
    n = counts.clamp(min=0)
    kept = n * probabilities.diagonal()
    own = n - kept
    mass = n[:, None] * probabilities
    others = mass.sum(0) - kept
    others_sum = mass.T @ embeddings - kept[:, None] * embeddings
    solvable = own > others / 2
    resolved = (others_sum - scaled_grad) / torch.where(solvable, own, torch.ones_like(own))[:, None]
    return torch.where(solvable[:, None], resolved, embeddings)


def round_counts(estimate: torch.Tensor, batch_size: int, required: torch.Tensor) -> torch.Tensor:
    """Counts (classes,) int64 summing to ``batch_size``, from ``estimate`` (classes,) by largest remainders;
    the ``required`` classes (bool (classes,)) keep one sample each, the largest estimates first. The estimate is
    clipped to [0, batch_size] (non-finite entries count 0) first: a noisy upload (DP) can estimate millions of
    samples for one class, which the unit steps below would otherwise take as many iterations to bring back."""
    estimate = torch.nan_to_num(estimate, nan=0.0, posinf=batch_size, neginf=0.0).clamp(0, batch_size)
    chosen = required.nonzero().flatten()
    chosen = chosen[torch.argsort(estimate[chosen], descending=True)][:batch_size]
    minimum = torch.zeros(len(estimate), dtype=torch.long)
    minimum[chosen] = 1
    counts = torch.maximum(estimate.floor().long(), minimum)
    while int(counts.sum()) < batch_size:
        counts[torch.argmax(estimate - counts)] += 1
    while int(counts.sum()) > batch_size:
        counts[torch.argmin((estimate - counts).masked_fill(counts <= minimum, float("inf")))] -= 1
    return counts


def plain_labels(signal: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Labels (batch_size,) int64 by the plain rule: ``round(-B g_c)`` for the negative classes, at least one
    each, then fixed to sum to ``batch_size``."""
    order = torch.argsort(signal)
    negative = [int(c) for c in order if signal[c] < 0]
    if not negative:
        negative = [int(order[0])]
    counts = {c: max(1, round(-batch_size * float(signal[c]))) for c in negative[:batch_size]}
    while sum(counts.values()) > batch_size:
        smallest = min(counts, key=lambda c: (counts[c] <= 1, -signal[c].item()))
        counts[smallest] -= 1
        if counts[smallest] == 0:
            del counts[smallest]
    while sum(counts.values()) < batch_size:
        counts[max(counts, key=lambda c: -signal[c].item() - counts[c] / batch_size)] += 1
    labels = [c for c, n in sorted(counts.items()) for _ in range(n)]
    return torch.tensor(labels, dtype=torch.long)


def upload_labels_inferred(
    obs: Observation, grads: list[torch.Tensor], batch_size: int, sparse: bool = False
) -> torch.Tensor:
    """Labels (batch_size,) inferred from an upload's gradient ``grads`` (trainable parameters in order), with
    the softmax offset taken from the global model the client started from where its last layer has a bias;
    ``sparse``: the upload's zeros are entries its defense did not send."""
    weights = [torch.tensor(a) for a, trainable in zip(obs.global_arrays, obs.trainable) if trainable]
    _, bias = last_layer(weights, obs.spec.num_classes)
    return infer_labels(
        grads, obs.spec.num_classes, batch_size, weights=weights if bias is not None else None, sparse=sparse
    )


def declared_labels(declared: Declared) -> torch.Tensor | None:
    """The labels a client declared with its upload (only when the threat model grants them), or None."""
    labels = declared.labels
    if not labels:
        return None
    return torch.tensor(labels, dtype=torch.long)
