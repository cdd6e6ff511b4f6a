"""fedavg-inversion beside Inverting Gradients on the same FedAvg uploads of realistic clients, in this process.

Each client holds ``--examples`` MNIST test digits (a seeded draw per client), trains 2 local epochs in
reshuffled batches of 8 at lr 0.1 from the model initialized under torch seed 0 (``--model``: the realistic
setting's MLP with BatchNorm, or the FedAvg paper's CNN with BatchNorm at ``--channels`` and ``--hidden``), and
uploads its weights. Both attacks read every upload at ``--iterations`` with their defaults otherwise (IG's TV
at the realistic setting's 1e-4). Prints per attack the mean SSIM over every digit with its 95 % interval, the
digits above SSIM 0.5 and 0.9, and the seconds per upload.

    .venv/bin/python benchmarks/fedavg_inversion_vs_ig.py [--model mlp|cnn] [--clients 3] [--iterations 1000]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np
import torch

from attackers.base import build_attack
from attackers.fedavg_inversion import FedAvgInversionParams
from attackers.inverting_gradients import InvertingGradientsParams
from fedguard.data import load_dataset
from fedguard.metrics import score_batch
from fedguard.models import build_model
from fedguard.models.cnn import CNNParams
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard, Observation
from fedguard.report.statistics import t_interval
from fedguard.training import get_arrays, local_sgd, trainable_mask

DECLARED = {"lr": 0.1, "local-epochs": 2, "batch-size": 8}


def uploads(model_name: str, params: Any, clients: int, examples: int) -> list[tuple[Observation, torch.Tensor]]:
    """Each client's weights upload with its digits."""
    data = load_dataset("mnist-5k")
    out = []
    for client in range(clients):
        torch.manual_seed(0)
        model = build_model(model_name, data.spec, params)
        card = ModelCard(
            model_name, dataclasses.asdict(params), data.spec, tuple(model.state_dict()), tuple(trainable_mask(model))
        )
        arrays = get_arrays(model)
        chosen = np.random.default_rng(client).choice(len(data.test), examples, replace=False)
        x, y = data.test.batch(sorted(chosen.tolist()))
        local_sgd(model, x, y, lr=0.1, epochs=2, batch_size=8, generator=np.random.default_rng(100 + client))
        out.append((card.observe(1, client, "weights", arrays, get_arrays(model), examples, DECLARED), x))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(2)
    params: Any = (
        MLPParams(batch_norm=True)
        if args.model == "mlp"
        else CNNParams(channels=args.channels, hidden=args.hidden, batch_norm=True)
    )
    captured = uploads(args.model, params, args.clients, args.examples)
    attacks = {
        "ig": InvertingGradientsParams(iterations=args.iterations, tv=1e-4, device="cpu"),
        "fedavg-inversion": FedAvgInversionParams(iterations=args.iterations, device="cpu"),
    }
    print(f"{args.model} with BatchNorm, {args.clients} clients x {args.examples} digits, {args.iterations} iterations")
    print("| attack | mean SSIM [95% CI] | > 0.5 | > 0.9 | s/upload |")
    print("|---|---:|---:|---:|---:|")
    for name, attack_params in attacks.items():
        attack = build_attack(name, attack_params)
        ssim: list[float] = []
        began = time.perf_counter()
        for obs, x in captured:
            [rec] = attack.reconstruct_many([obs], 0)
            ssim += [image["ssim"] for image in score_batch(rec.images, x)["per_image"]]
        seconds = (time.perf_counter() - began) / len(captured)
        above = np.array(ssim)
        mean, (low, high) = float(above.mean()), t_interval(above)
        print(
            f"| {name} | {mean:.3f} [{low:.3f}, {high:.3f}] | {(above > 0.5).mean():.0%} | "
            f"{(above > 0.9).mean():.0%} | {seconds:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
