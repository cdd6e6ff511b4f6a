"""fc-span beside fc-span-adaptive on the same defended FedAvg uploads of realistic clients, in this process.

Each client is the defenses preset's realistic one: the MLP with BatchNorm in training mode (initialized under torch
seed 0), ``--examples`` MNIST test digits drawn at random (seeded per client), 2 local epochs in reshuffled batches
of 8 at lr 0.1; its update ``global - local`` goes through each defense of ``--defenses`` (round 1: pruning and DGP
without an error-feedback residual, quantization at 4 bits, as the preset) and its weights are uploaded. Both
attacks read every upload, fc-span-adaptive knowing the defense. Prints per defense and attack the mean SSIM over
every digit with its 95 % interval, the digits above SSIM 0.9, and the seconds per upload; and, per defense, the
relative error of the first-layer update fc-span-adaptive rebuilt, on the entries it reads, against the update
before the defense (which the attack never sees).

    .venv/bin/python benchmarks/fc_span_adaptive.py [--clients 3] [--examples 16] [--defenses prune,dgp,quantize]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np
import torch

from attackers.base import build_attack
from attackers.fc_span import SpanParams
from attackers.fc_span_adaptive import AdaptiveSpanAttack, AdaptiveSpanParams
from fedguard.data import load_dataset
from fedguard.defenses import LocalStep, build_defense
from fedguard.defenses.dgp import DGPParams
from fedguard.defenses.pruning import PruneParams
from fedguard.defenses.quantization import QuantizeParams
from fedguard.metrics import score_batch
from fedguard.metrics.scoring import LEAK_SSIM
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard, Observation
from fedguard.report.statistics import t_interval
from fedguard.training import get_arrays, local_sgd, loss_fn, trainable_mask

DEFENSES: dict[str, Any] = {
    "prune": PruneParams(error_feedback=False),
    "dgp": DGPParams(error_feedback=False),
    "quantize": QuantizeParams(bits=4),
}
DECLARED = {"lr": 0.1, "local-epochs": 2, "batch-size": 8}


def defended_upload(client: int, examples: int, defense: str) -> tuple[Observation, torch.Tensor, float]:
    """(the weights upload of ``client`` through ``defense``, its digits, the relative error of fc-span-adaptive's
    rebuilt first-layer update on the entries it reads, against the update before the defense)."""
    data = load_dataset("mnist-5k")
    test, params = data.test, MLPParams(batch_norm=True)
    torch.manual_seed(0)
    model = build_model("mlp", data.spec, params)
    names, trainable = tuple(model.state_dict()), tuple(trainable_mask(model))
    card = ModelCard("mlp", dataclasses.asdict(params), data.spec, names, trainable)
    arrays = get_arrays(model)
    picked = np.random.default_rng(client).choice(len(test), examples, replace=False)
    x, y = test.batch([int(i) for i in picked])
    local_sgd(model, x, y, lr=0.1, epochs=2, batch_size=8, generator=np.random.default_rng(3))
    change = [torch.tensor(a - b, dtype=torch.float64) for a, b in zip(arrays, get_arrays(model), strict=True)]
    protect = build_defense(defense, DEFENSES[defense])
    sent = protect(LocalStep(model, x, y, change, loss_fn, torch.Generator().manual_seed(client), 1, client), {})
    upload = [(a - s.numpy()).astype(np.float32) for a, s in zip(arrays, sent, strict=True)]
    obs = card.observe(1, client, "weights", arrays, upload, examples, DECLARED)
    attack = AdaptiveSpanAttack(AdaptiveSpanParams())
    attack.know_defense(protect)
    rebuilt, _ = attack.rebuild(obs)
    assert rebuilt is not None
    full, read = torch.cat([change[0], change[1][:, None]], 1), rebuilt != 0
    return obs, x, float((rebuilt - full)[read].norm() / full[read].norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--defenses", default=",".join(DEFENSES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.clients} clients x {args.examples} digits, realistic MLP with BatchNorm, round 1")
    print("| defense | attack | mean SSIM [95% CI] | > 0.9 | s/upload | rebuild error |")
    print("|---|---|---:|---:|---:|---:|")
    for defense in args.defenses.split(","):
        uploads = [defended_upload(client, args.examples, defense) for client in range(args.clients)]
        error = np.mean([e for _, _, e in uploads])
        for name, params in (("fc-span", SpanParams()), ("fc-span-adaptive", AdaptiveSpanParams())):
            attack = build_attack(name, params, defense=(defense, DEFENSES[defense]))
            began = time.perf_counter()
            ssim: list[float] = []
            for obs, x, _ in uploads:
                [rec] = attack.reconstruct_many([obs], 0)
                ssim += [image["ssim"] for image in score_batch(rec.images, x)["per_image"]]
            seconds = (time.perf_counter() - began) / len(uploads)
            scores = np.array(ssim)
            low, high = t_interval(scores)
            leaked = int((scores > LEAK_SSIM).sum())
            rebuild = f"{error:.2e}" if name == "fc-span-adaptive" else "-"
            print(
                f"| {defense} | {name} | {scores.mean():.3f} [{low:.3f}, {high:.3f}] | {leaked} of {len(ssim)} | "
                f"{seconds:.1f} | {rebuild} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
