"""The loss and gradient that clients and attackers share, and model <-> array conversion.

A model's wire format is its ``state_dict`` in order: parameters and buffers
(BatchNorm running statistics) as numpy arrays. ``trainable_mask`` tells which
entries are parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (B, classes) against int64 ``labels`` (B,)."""
    return F.cross_entropy(logits, labels)


def parameters(model: nn.Module) -> list[torch.Tensor]:
    """The trainable parameters, in ``state_dict`` order."""
    return [p for p in model.parameters() if p.requires_grad]


def compute_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    """Gradient of the mean batch loss w.r.t. each trainable parameter, and the loss.

    The model is put in training mode: BatchNorm uses batch statistics and
    updates its running statistics, as a client's local step does.
    """
    model.train()
    loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, parameters(model))
    return [g.detach() for g in grads], float(loss.detach())


StepGradient = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[list[torch.Tensor], float]]
"""``(model, x, y) -> (one gradient per trainable parameter, the batch's loss)``: what one local step follows."""


def minibatches(num_samples: int, batch_size: int, generator: np.random.Generator) -> Iterator[np.ndarray]:
    """Shuffled positions 0..num_samples-1 in batches of at most ``batch_size``."""
    order = generator.permutation(num_samples)
    for start in range(0, num_samples, batch_size):
        yield order[start : start + batch_size]


def local_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    epochs: int,
    batch_size: int,
    generator: np.random.Generator,
    proximal_mu: float = 0.0,
    gradient: StepGradient | None = None,
) -> tuple[int, float]:
    """SGD on (x, y) for ``epochs`` epochs in place; returns (steps taken, last cross-entropy loss).

    With ``proximal_mu > 0`` the loss gains FedProx's proximal term ``mu/2 ||w - w_0||^2`` (``w_0``: the
    parameters at the start), whose gradient ``mu (w - w_0)`` is added to each step's. ``gradient(model, x, y)``
    gives each step's (gradients, loss) in place of ``compute_gradients`` (a defense of every step: DP-SGD)."""
    if proximal_mu < 0:
        raise ValueError(f"proximal_mu must be >= 0, got {proximal_mu}")
    anchor = [p.detach().clone() for p in parameters(model)] if proximal_mu > 0 else []
    steps, last = 0, float("nan")
    for _ in range(epochs):
        for batch in minibatches(len(y), batch_size, generator):
            grads, last = (gradient or compute_gradients)(model, x[batch], y[batch])
            with torch.no_grad():
                for i, (p, g) in enumerate(zip(parameters(model), grads)):
                    p.sub_(lr * (g + proximal_mu * (p - anchor[i])) if anchor else lr * g)
            steps += 1
    return steps, last


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> tuple[float, float]:
    """Mean loss and accuracy (fraction in [0, 1]) of ``model`` in eval mode on (x, y)."""
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model(x[start : start + batch_size])
        labels = y[start : start + batch_size]
        total_loss += float(F.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(1) == labels).sum())
    return total_loss / len(y), correct / len(y)


def trainable_mask(model: nn.Module) -> list[bool]:
    """For each ``state_dict`` entry: True for a trainable parameter, False for a buffer."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return [name in trainable for name in model.state_dict()]


def get_arrays(model: nn.Module) -> list[np.ndarray]:
    """The model's ``state_dict`` as numpy arrays (copies)."""
    return [t.detach().cpu().numpy().copy() for t in model.state_dict().values()]


def set_arrays(model: nn.Module, arrays: list[np.ndarray]) -> None:
    """Load ``state_dict``-ordered arrays into ``model``; shapes must match."""
    state = model.state_dict()
    if len(arrays) != len(state):
        raise ValueError(f"expected {len(state)} arrays for this model, got {len(arrays)}")
    new_state = {}
    for (name, current), array in zip(state.items(), arrays):
        if tuple(array.shape) != tuple(current.shape):
            raise ValueError(
                f"array for {name!r} has shape {tuple(array.shape)}, the model needs {tuple(current.shape)}"
            )
        new_state[name] = torch.as_tensor(np.asarray(array), dtype=current.dtype)
    model.load_state_dict(new_state)


def split_by_mask(arrays: list[np.ndarray], mask: list[bool]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(parameter entries, buffer entries) of a ``state_dict``-ordered list."""
    return [a for a, m in zip(arrays, mask) if m], [a for a, m in zip(arrays, mask) if not m]


def merge_by_mask(params: list[np.ndarray], buffers: list[np.ndarray], mask: list[bool]) -> list[np.ndarray]:
    """Inverse of ``split_by_mask``."""
    p, b = iter(params), iter(buffers)
    return [next(p) if m else next(b) for m in mask]


def gradient_upload(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[np.ndarray]:
    """The FedSGD upload of the batch (x, y) in ``state_dict`` order: the mean-loss gradient of each trainable
    entry, and each buffer as the training-mode forward pass leaves it (BatchNorm's running statistics)."""
    grads, _ = compute_gradients(model, x, y)
    mask = trainable_mask(model)
    return merge_by_mask([g.numpy() for g in grads], split_by_mask(get_arrays(model), mask)[1], mask)
