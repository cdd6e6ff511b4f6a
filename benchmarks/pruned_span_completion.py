"""fc-span on a pruned FedAvg update, plain and after completing the first layer's update from what was sent.

The client is the defenses preset's realistic one, in this process: the MLP with BatchNorm in training mode, 16
MNIST digits (``--batches`` batches of 16 consecutive test digits from ``--first``), 2 local epochs in reshuffled
batches of 8 at lr 0.1; its update ``global - local`` goes through fedguard's ``prune`` defense (``--keep`` of each
layer's entries, the largest by magnitude). The first layer's update ``[dW | db]`` is of rank 16 before pruning;
the upload holds 20 % of its entries exactly and zeros elsewhere, and every entry not sent is at most the smallest
sent one in magnitude (``tau``, per layer). The completion alternates two projections (``--iterations``): onto the
matrices of rank 16 (the declared example count; truncated SVD) and onto those that hold the sent entries and keep
every other entry within ``[-tau, tau]``. fc-span (its defaults) then reads both the zero-filled upload and the
completed one. Prints per batch: the completion's relative error on the entries not sent (against the update
before pruning, which the attack never sees), the mean SSIM and the digits above 0.9 of each, and the seconds.

    .venv/bin/python benchmarks/pruned_span_completion.py [--batches 3] [--first 32] [--keep 0.2] [--iterations 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch

from attackers.base import build_attack
from attackers.fc_span import SpanParams
from fedguard.data import DataSpec, load_dataset
from fedguard.defenses import LocalStep, build_defense
from fedguard.defenses.pruning import PruneParams
from fedguard.metrics import score_batch
from fedguard.metrics.scoring import LEAK_SSIM
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import get_arrays, local_sgd, loss_fn, trainable_mask

EXAMPLES = 16


def realistic_mlp(data_spec: DataSpec) -> tuple[torch.nn.Module, list[np.ndarray], ModelCard]:
    """The realistic setting's MLP (hidden 256, depth 2, BatchNorm), initialized under torch seed 0; its arrays
    and card."""
    params = MLPParams(batch_norm=True)
    torch.manual_seed(0)
    model = build_model("mlp", data_spec, params)
    card = ModelCard(
        "mlp", dataclasses.asdict(params), data_spec, tuple(model.state_dict()), tuple(trainable_mask(model))
    )
    return model, get_arrays(model), card


def complete(sent: np.ndarray, mask: np.ndarray, tau: np.ndarray, rank: int, iterations: int) -> np.ndarray:
    """A rank-``rank`` matrix that holds ``sent`` where ``mask`` is True and stays within ``tau`` elsewhere, by
    alternating projections from the zero-filled ``sent``."""
    current = sent.copy()
    low_rank = sent
    for _ in range(iterations):
        left, singular, right = np.linalg.svd(current, full_matrices=False)
        low_rank = (left[:, :rank] * singular[:rank]) @ right[:rank]
        current = np.where(mask, sent, np.clip(low_rank, -tau, tau))
    return low_rank


def read(card: ModelCard, arrays: list[np.ndarray], first_layer: np.ndarray, x: torch.Tensor) -> tuple[float, int]:
    """(mean SSIM, digits above ``LEAK_SSIM``) of fc-span on the weights upload whose first layer changed by
    ``first_layer`` = ``[dW | db]``."""
    upload = [a.copy() for a in arrays]
    upload[0] = (arrays[0] - first_layer[:, :-1]).astype(np.float32)
    upload[1] = (arrays[1] - first_layer[:, -1]).astype(np.float32)
    declared = {"lr": 0.1, "local-epochs": 2, "batch-size": 8}
    obs: Observation = card.observe(1, 0, "weights", arrays, upload, EXAMPLES, declared)
    [rec] = build_attack("fc-span", SpanParams()).reconstruct_many([obs], 0)
    ssim = np.array([image["ssim"] for image in score_batch(rec.images, x)["per_image"]])
    return float(ssim.mean()), int((ssim > LEAK_SSIM).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--first", type=int, default=32)
    parser.add_argument("--keep", type=float, default=0.2)
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prune = build_defense("prune", PruneParams(keep=args.keep, error_feedback=False))
    data = load_dataset("mnist-5k")
    test = data.test
    print("| batch | unsent error | zero-filled: SSIM, > 0.9 | completed: SSIM, > 0.9 | completion (s) |")
    print("|---:|---:|---:|---:|---:|")
    for batch in range(args.batches):
        start = args.first + EXAMPLES * batch
        model, arrays, card = realistic_mlp(data.spec)
        x, y = test.batch(list(range(start, start + EXAMPLES)))
        local_sgd(model, x, y, lr=0.1, epochs=2, batch_size=8, generator=np.random.default_rng(3))
        trained = get_arrays(model)
        change = [torch.tensor(arrays[i] - trained[i], dtype=torch.float64) for i in (0, 1)]
        step = LocalStep(model, x, y, change, loss_fn, torch.Generator().manual_seed(0), 1, 0)
        weight, bias = (t.numpy() for t in prune(step, {}))
        full = np.hstack([change[0].numpy(), change[1].numpy()[:, None]])
        sent = np.hstack([weight, bias[:, None]])
        mask = sent != 0
        tau_weight, tau_bias = np.abs(weight[weight != 0]).min(), np.abs(bias[bias != 0]).min()
        tau = np.hstack([np.full(weight.shape, tau_weight), np.full((len(bias), 1), tau_bias)])
        began = time.perf_counter()
        completed = complete(sent, mask, tau, EXAMPLES, args.iterations)
        seconds = time.perf_counter() - began
        error = np.linalg.norm((completed - full)[~mask]) / np.linalg.norm(full[~mask])
        plain, plain_leaked = read(card, arrays, sent, x)
        filled, filled_leaked = read(card, arrays, completed, x)
        print(
            f"| {start}-{start + EXAMPLES - 1} | {error:.3f} | {plain:.3f}, {plain_leaked} of {EXAMPLES} | "
            f"{filled:.3f}, {filled_leaked} of {EXAMPLES} | {seconds:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
