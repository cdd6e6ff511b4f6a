"""SEER's disaggregation signal-to-noise ratio (Garov et al., "Hiding in Plain Sight: Disguising Data Stealing
Attacks in Federated Learning", ICLR 2024, Eq. 1) of the received model on the client's own batch.

With ``g_{i,W} = dL(x_i, y_i)/dW`` the gradient of example i's loss with respect to weight ``W``::

    D-SNR = max_W  max_i ||g_{i,W}|| / sum_{j != i*} ||g_{j,W}||,    i* the example of the largest norm

over the model's trainable weights ``W`` (the paper takes its linear layers; here convolution kernels too) and
the ``B`` examples of the batch. An honest model spreads the batch gradient over its examples (about
``1 / (B - 1)`` for equal norms); a model built to make one example dominate a layer's gradient, so that the
batch gradient discloses it, has a large D-SNR. Per-example gradients are taken with the model in evaluation
mode (BatchNorm on its running statistics, no dropout), one example at a time. The model is flagged at
``threshold``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fedguard.detect.base import Finding, Received, register_detector


@dataclass(frozen=True)
class DSNRParams:
    """``threshold``: flag at this D-SNR (dimensionless; about 1 / (B - 1) for a batch of B equal norms)."""

    threshold: float = 2.0

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"threshold must be > 0, got {self.threshold}")


def example_norms(received: Received) -> torch.Tensor:
    """(B, L): the norm of each example's loss gradient with respect to each of the L trainable weights (two or
    more dimensions), float64; the model's training mode is restored."""
    model: nn.Module = received.model
    weights = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    training = model.training
    model.eval()
    try:
        norms = []
        for x, y in zip(received.x, received.y):
            loss = received.loss_fn(model(x[None]), y[None])
            grads = torch.autograd.grad(loss, weights)
            norms.append(torch.stack([g.detach().to(torch.float64).norm() for g in grads]))
    finally:
        model.train(training)
    return torch.stack(norms)


def dsnr(norms: torch.Tensor) -> float:
    """D-SNR of per-example gradient norms (B, L), B >= 2; infinite when only one example has a gradient in a
    layer."""
    if norms.shape[0] < 2:
        raise ValueError(f"D-SNR needs a batch of 2 or more examples, got {norms.shape[0]}")
    largest = norms.max(0).values
    rest = norms.sum(0) - largest
    ratios = torch.where(rest > 0, largest / rest.clamp(min=torch.finfo(rest.dtype).tiny), torch.inf)
    ratios = torch.where(largest > 0, ratios, 0.0)
    return float(ratios.max())


class DSNRDetector:
    """Flags a received model whose gradient on the client's batch is dominated by one example."""

    def __init__(self, params: DSNRParams) -> None:
        self.params = params

    def __call__(self, received: Received, state: dict[str, torch.Tensor]) -> Finding:
        score = dsnr(example_norms(received))
        return Finding({"dsnr": score}, score >= self.params.threshold)


@register_detector("dsnr", params=DSNRParams)
def build_dsnr(params: DSNRParams) -> DSNRDetector:
    """SEER's disaggregation signal-to-noise ratio (Garov et al. 2024) on the client's batch."""
    return DSNRDetector(params)
