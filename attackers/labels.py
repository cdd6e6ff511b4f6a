"""Label inference from the gradient of the last linear layer (cross-entropy).

For cross-entropy the bias gradient of the last layer is
``g_c = mean_i(p_ic - [y_i = c])``: each sample of class c pushes entry c down
by about 1/B. With batch size 1 the only negative entry is the label (iDLG,
Zhao et al. 2020). With a batch of B, the classes with negative entries are
the labels present, and ``round(-B * g_c)`` estimates how often class c occurs
(the counting rule of Wainakh et al., LLG); counts are then fixed to sum to B
(each negative class keeps at least one sample when B allows). Without a bias,
the row sums of the weight gradient are used: the inputs of the last layer are
non-negative after ReLU or sigmoid, so their signs agree with the bias
gradient's.
"""

from __future__ import annotations

import torch


def last_layer_signal(grads: list[torch.Tensor], num_classes: int) -> torch.Tensor:
    """(classes,) per-class signal: the last bias gradient, or the last weight gradient's row sums."""
    for index in range(len(grads) - 1, -1, -1):
        g = grads[index]
        if g.dim() == 1 and g.shape[0] == num_classes:
            return g.detach().float()
        if g.dim() == 2 and g.shape[0] == num_classes:
            return g.detach().float().sum(1)
    raise ValueError(f"no last-layer gradient with {num_classes} rows among shapes {[tuple(g.shape) for g in grads]}")


def infer_labels(grads: list[torch.Tensor], num_classes: int, batch_size: int) -> torch.Tensor:
    """Estimated labels (batch_size,) int64, sorted by class."""
    signal = last_layer_signal(grads, num_classes)
    if batch_size == 1:
        return signal.argmin().reshape(1).long()
    order = torch.argsort(signal)
    negative = [int(c) for c in order if signal[c] < 0]
    if not negative:
        negative = [int(order[0])]
    counts = {c: max(1, int(round(-batch_size * float(signal[c])))) for c in negative[:batch_size]}
    while sum(counts.values()) > batch_size:
        smallest = min(counts, key=lambda c: (counts[c] <= 1, -signal[c].item()))
        counts[smallest] -= 1
        if counts[smallest] == 0:
            del counts[smallest]
    while sum(counts.values()) < batch_size:
        counts[max(counts, key=lambda c: -signal[c].item() - counts[c] / batch_size)] += 1
    labels = [c for c, n in sorted(counts.items()) for _ in range(n)]
    return torch.tensor(labels, dtype=torch.long)


def declared_labels(declared: dict) -> torch.Tensor | None:
    """The labels a client declared with its upload ('3,1,4'; only when the threat model grants them), or None."""
    text = declared.get("labels")
    if text is None or text == "":
        return None
    return torch.tensor([int(v) for v in str(text).split(",")], dtype=torch.long)
