"""FedAvg inversion: the replay with one copy of the examples per epoch is exactly the client's reshuffled
training, the running statistics' change is exactly what its steps add, the epoch-order prior vanishes on
permuted copies only, the label assignment keeps every copy's label counts, and the attack's refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad

from attackers.base import build_attack
from attackers.bn_statistics import running_change
from attackers.engine.local_schedule import LocalSchedule
from attackers.engine.objective import BatchNormInputs, batch_loss, local_update_fn
from attackers.engine.spaces import EpochCopiesSpace, sinkhorn
from attackers.engine.terms import TermInputs, epoch_order_prior
from attackers.fedavg_inversion import FedAvgInversionParams
from attackers.jobs import stateless_model, trainable_params
from fedguard.data import load_dataset
from fedguard.models.mlp import MLPParams
from fedguard.observation import Observation
from fedguard.training import get_arrays, local_sgd
from tests.untrained import untrained_mlp

EXAMPLES, BATCH, EPOCHS, LR = 13, 8, 2, 0.1
DECLARED = {"lr": LR, "local-epochs": EPOCHS, "batch-size": BATCH}


def _client(batch_norm: bool = True, seed: int = 3) -> tuple[Observation, torch.Tensor, torch.Tensor]:
    """A FedAvg upload of 13 digits (two epochs in reshuffled batches of 8 and 5, the generator of ``seed``)."""
    _, model, arrays, card = untrained_mlp("mnist-5k", MLPParams(batch_norm=batch_norm))
    x, y = load_dataset("mnist-5k").test.batch(list(range(0, 1000, 1000 // EXAMPLES))[:EXAMPLES])
    local_sgd(model, x, y, lr=LR, epochs=EPOCHS, batch_size=BATCH, generator=np.random.default_rng(seed))
    return card.observe(1, 0, "weights", arrays, get_arrays(model), EXAMPLES, DECLARED), x, y


def _replay(obs: Observation, copies: int) -> tuple:
    """The engine's FedAvg replay of ``obs`` on one job, with the running statistics when it has BatchNorm."""
    model = stateless_model(obs, torch.device("cpu"))
    layers = [n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm1d)]
    recorder = BatchNormInputs(model, layers, unbiased=True)

    def param_grad(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        def loss_of(q: dict) -> tuple:
            recorder.start()
            return batch_loss(functional_call(model, q, (x,)), y), recorder.statistics()

        return grad(loss_of, has_aux=True)(p)

    schedule = LocalSchedule.of(obs)
    momenta = [c.momentum for c in running_change(obs, schedule.steps(EXAMPLES)).values()] if layers else None
    return local_update_fn(param_grad, schedule, EXAMPLES, copies, momenta), trainable_params(obs, torch.device("cpu"))


def _target(obs: Observation) -> dict[str, np.ndarray]:
    return {n: g - u for n, g, u, t in zip(obs.names, obs.global_arrays, obs.upload, obs.trainable) if t}


def test_one_copy_per_epoch_in_the_clients_order_replays_its_update_exactly() -> None:
    obs, x, y = _client()
    generator = np.random.default_rng(3)
    orders = [generator.permutation(EXAMPLES) for _ in range(EPOCHS)]
    update, params = _replay(obs, EPOCHS)
    change, running = update(params, torch.cat([x[o] for o in orders]), torch.cat([y[o] for o in orders]))
    target = _target(obs)
    scale = max(float(np.abs(t).max()) for t in target.values())
    assert max(float(np.abs(change[n].numpy() - target[n]).max()) for n in target) < 1e-6 * scale
    in_order, _ = _replay(obs, 1)[0](params, x, y)
    assert max(float(np.abs(in_order[n].numpy() - target[n]).max()) for n in target) > 1e-2 * scale
    # what the four steps added to the running statistics, as the upload shows it
    for (mean, var), want in zip(running, running_change(obs, 4).values()):
        assert torch.allclose(mean, want.mean, atol=1e-6) and torch.allclose(var, want.var, atol=1e-6)


def test_the_running_change_is_refused_off_the_declared_schedule_and_under_fedbn() -> None:
    obs, _, _ = _client()
    assert LocalSchedule.of(obs).steps(EXAMPLES) == 4
    with pytest.raises(ValueError, match=r"counted 4 steps \(num_batches_tracked 0 -> 4\), but the declared"):
        running_change(obs, 6)
    kept = dataclasses.replace(
        obs,
        upload=[
            g if "." in n and not t else u
            for n, g, u, t in zip(obs.names, obs.global_arrays, obs.upload, obs.trainable)
        ],
    )
    with pytest.raises(ValueError, match="counted 0 steps"):
        running_change(kept, 4)
    with pytest.raises(ValueError, match="FedAvg weight uploads"):
        running_change(dataclasses.replace(obs, kind="gradient"), 4)


def test_the_epoch_order_prior_vanishes_on_permuted_copies_only() -> None:
    images = torch.rand(2, 5, 1, 4, 4)
    permuted = torch.cat([images, images[:, torch.tensor([3, 0, 4, 1, 2])]], dim=1)
    other = torch.cat([images, torch.rand(2, 5, 1, 4, 4)], dim=1)

    def prior(x: torch.Tensor, copies: int) -> torch.Tensor:
        return epoch_order_prior(TermInputs(x, x, [], [], 1, copies))

    assert torch.allclose(prior(permuted, 2), torch.zeros(2), atol=1e-6)
    assert bool((prior(other, 2) > 0.05).all())
    assert torch.equal(prior(other, 1), torch.zeros(2))  # one copy: nothing to tie
    # one image of copy 1 replaced: the prior is that image's squared distance, per pixel, over the 5 images
    changed = permuted.clone()
    changed[:, 5] = 1 - changed[:, 5]
    assert bool((prior(changed, 2) > 0).all())


def test_the_label_assignment_keeps_every_copys_label_counts() -> None:
    space = EpochCopiesSpace(epochs=2, examples=6, shape=(1, 4, 4), classes=10)
    z = torch.stack([space.start(torch.Generator().manual_seed(s)) for s in range(3)])
    z[:, space.pixels :] = 0.3 * torch.randn(3, 2 * 6 * 6, generator=torch.Generator().manual_seed(1))
    assignment = sinkhorn(3 * torch.randn(4, 6, 6, generator=torch.Generator().manual_seed(0)))
    assert torch.allclose(assignment.sum(-1), torch.ones(4, 6), atol=1e-6)  # each slot a label distribution
    assert torch.allclose(assignment.sum(-2), torch.ones(4, 6), atol=1e-2)  # each label used once
    labels = torch.tensor([[3, 3, 1, 7, 7, 7]]).expand(3, -1)
    soft = space.slot_labels(z, labels).reshape(3, 2, 6, 10)
    counts = torch.nn.functional.one_hot(labels, 10).sum(1).float()
    assert torch.allclose(soft.sum(2), counts[:, None].expand(-1, 2, -1), atol=2e-2)
    assert torch.allclose(soft.sum(-1), torch.ones(3, 2, 6), atol=1e-6)
    assert space.images(z).shape == (3, 12, 1, 4, 4) and space.final_images(z).shape == (3, 6, 1, 4, 4)


def test_the_final_images_are_copy_0_averaged_with_its_matches() -> None:
    space = EpochCopiesSpace(epochs=2, examples=4, shape=(1, 3, 3), classes=10)
    first = torch.rand(1, 4, 1, 3, 3)
    second = (first[:, torch.tensor([2, 0, 3, 1])] + 0.02).clamp(0, 1)
    z = torch.cat([torch.cat([first, second], dim=1).flatten(1), torch.zeros(1, 2 * 16)], dim=1)
    assert torch.allclose(space.final_images(z), (first + (first + 0.02).clamp(0, 1)) / 2)


def test_refusals() -> None:
    with pytest.raises(ValueError, match="shuffle 'random': choose one of in-order, per-epoch"):
        FedAvgInversionParams(shuffle="random")
    with pytest.raises(ValueError, match="order must be a finite weight >= 0"):
        FedAvgInversionParams(order=-1.0)
    obs, _, _ = _client(batch_norm=False)
    attack = build_attack("fedavg-inversion", FedAvgInversionParams(iterations=1, device="cpu"))
    with pytest.raises(ValueError, match="no BatchNorm layer with running statistics"):
        attack.reconstruct_many([obs], 0)
    with pytest.raises(ValueError, match="FedAvg weights"):
        attack.reconstruct_many([dataclasses.replace(obs, kind="gradient")], 0)
