"""The attack engine: seeds, shared weights, FedAvg batching, the L-BFGS line search, and its pieces' maths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attackers.base import shape_key
from attackers.dlg import DeepLeakage, DLGParams
from attackers.engine import OptimizerSpec, SearchSpec, Term, register_distance, register_prior, search
from attackers.engine.objective import Objective
from attackers.engine.optimizers import lbfgs, scheduler_of
from attackers.engine.problem import Problem
from attackers.engine.terms import TermInputs, cosine_distance, group_prior, l2_distance, relative_l2_distance
from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from fedguard.training import get_arrays, local_sgd, set_arrays
from tests.devices import ATTACK_DEVICE
from tests.test_inverting_gradients import uploads
from tests.untrained import untrained_mlp


def test_the_same_seed_repeats_exactly_and_another_seed_starts_elsewhere() -> None:
    observations, _, _ = uploads()
    attack = InvertingGradients(InvertingGradientsParams(iterations=3, restarts=2, device=ATTACK_DEVICE))
    first, again, other = (attack.reconstruct_many(observations[:2], seed) for seed in (7, 7, 8))
    for a, b, c in zip(first, again, other):
        assert torch.equal(a.images, b.images) and a.stats["restart_losses"] == b.stats["restart_losses"]
        assert not torch.allclose(a.images, c.images)


def test_uploads_of_one_global_model_share_its_weights_and_match_running_alone() -> None:
    observations, _, _ = uploads()
    attack = InvertingGradients(InvertingGradientsParams(iterations=4, restarts=2, device=ATTACK_DEVICE))
    together = attack.reconstruct_many(observations[:3], 0)
    alone = [attack.reconstruct_many([obs], 0)[0] for obs in observations[:3]]
    assert all(r.stats["shared_weights"] and r.stats["batched_jobs"] == 6 for r in together)
    for a, b in zip(together, alone):
        assert torch.allclose(a.images, b.images, atol=1e-5)


def fedavg_uploads() -> list:
    """Two clients' FedAvg uploads of one round: one global model, two photos each, own losses."""
    data, model, arrays, card = untrained_mlp("photos")
    observations = []
    for client, pair in enumerate(([3, 150], [10, 200])):
        x, y = data.test.batch(pair)
        _, loss = local_sgd(model, x, y, lr=0.1, epochs=1, batch_size=1, generator=np.random.default_rng(client))
        declared = {"lr": 0.1, "local-epochs": 1, "batch-size": 1, "local-steps": 2, "loss": loss}
        observations.append(card.observe(1, client, "weights", arrays, get_arrays(model), 2, declared))
        set_arrays(model, arrays)
    return observations


def test_fedavg_uploads_of_one_round_batch_together() -> None:
    observations = fedavg_uploads()
    assert observations[0].declared.loss != observations[1].declared.loss
    assert shape_key(observations[0]) == shape_key(observations[1])
    params = InvertingGradientsParams(iterations=2, restarts=2, device=ATTACK_DEVICE)
    recons = InvertingGradients(params).reconstruct_many(observations, 0)
    assert [r.stats["batched_jobs"] for r in recons] == [4, 4] and all(r.stats["shared_weights"] for r in recons)


def test_lbfgs_never_freezes_a_job_whose_first_step_overshoots() -> None:
    """With a step 10^6 times too long every trial of the line search raises the loss: the job shrinks its own
    step until one lowers it, and then converges; its neighbour, well scaled, is not slowed down."""
    curvature = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    b = torch.ones(2, 3)

    def losses(z: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([1e6, 1.0]).reshape(2, 1)  # job 0's gradient, hence its first step, 10^6 times longer
        return (scale * (0.5 * curvature * z**2 - b * z)).sum(1)

    spec = OptimizerSpec("lbfgs", lr=1.0, box=False)
    z, resets = lbfgs(
        torch.zeros(2, 3), lambda progress: losses, 60, spec, lambda z: None, lambda jobs: torch.zeros(2, 3)
    )
    assert torch.allclose(z, b / curvature, atol=1e-4), z
    assert resets.tolist() == [0, 0]


def test_dlg_with_an_overshooting_step_still_lowers_every_restarts_loss() -> None:
    observations, _, _ = uploads()
    params = DLGParams(iterations=1, restarts=4, lr=1e4, device=ATTACK_DEVICE)
    start = DeepLeakage(params, infer=True).reconstruct_many(observations[:1], 0)[0]
    params = DLGParams(iterations=40, restarts=4, lr=1e4, device=ATTACK_DEVICE)
    later = DeepLeakage(params, infer=True).reconstruct_many(observations[:1], 0)[0]
    assert all(b < 0.5 * a for a, b in zip(start.stats["restart_losses"], later.stats["restart_losses"])), (
        start.stats["restart_losses"],
        later.stats["restart_losses"],
    )


def test_distances_and_the_group_prior() -> None:
    g = [torch.tensor([[3.0, 4.0], [1.0, 0.0]])]
    t = [torch.tensor([[6.0, 8.0], [0.0, 1.0]])]
    assert torch.allclose(cosine_distance(g, t), torch.tensor([0.0, 1.0]), atol=1e-6)
    assert torch.allclose(l2_distance(g, t), torch.tensor([25.0, 2.0]))
    assert torch.allclose(relative_l2_distance(g, t), torch.tensor([25.0 / 100.0, 2.0]))
    images = torch.arange(4.0).reshape(4, 1, 1, 1, 1)  # 2 uploads x 2 restarts
    inputs = TermInputs(images, images, [], [], restarts=2)
    assert torch.allclose(group_prior(inputs), torch.full((4,), 0.25))


def objective_at_start(precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """IG's weighted loss (J,) and its gradient w.r.t. the dummy images at the seeded starting points, for two
    batch-1 MLP uploads x 2 restarts, with the dummy gradients in ``precision``."""
    observations, _, _ = uploads()
    spec = SearchSpec(1, 2, "cpu", terms=(Term("tv", 0.01),), precision=precision)
    problem = Problem.of(spec, observations[:2], torch.device("cpu"), None)
    objective = Objective(spec, problem, None, 0)
    z = torch.stack([problem.space.start(problem.generator(0, j)) for j in range(problem.jobs)])
    losses = objective.losses_at(1.0)
    step, _value = torch.func.grad_and_value(lambda z: losses(z).sum())(z)
    return losses(z), step


def test_bfloat16_dummy_gradients_agree_with_float32_to_about_two_digits() -> None:
    exact, exact_step = objective_at_start("float32")
    rounded, rounded_step = objective_at_start("bfloat16")
    assert rounded.dtype == torch.float32 and rounded_step.dtype == torch.float32
    assert not torch.equal(exact, rounded), "bfloat16 must change the arithmetic"
    assert torch.allclose(exact, rounded, atol=0.03), (exact, rounded)  # loss in [0, 2]
    direction = torch.nn.functional.cosine_similarity(exact_step.flatten(1), rounded_step.flatten(1))
    print("bfloat16 loss", exact, rounded, "direction", direction)
    assert (direction > 0.98).all(), direction
    assert (exact_step.sign() == rounded_step.sign()).float().mean() > 0.9


def test_specs_refuse_unknown_pieces_with_the_choices() -> None:
    with pytest.raises(ValueError, match="distance 'l1': choose one of cosine, l2, relative-l2"):
        SearchSpec(10, 1, "cpu", distance="l1")
    with pytest.raises(
        ValueError, match="prior 'sparsity': choose one of tv, l2, bn, running-stats, group, epoch-order, kl"
    ):
        Term("sparsity", 1.0)
    with pytest.raises(ValueError, match="optimizer 'sgd': choose one of signed-adam, adam, lbfgs"):
        OptimizerSpec("sgd")
    with pytest.raises(ValueError, match="labels 'given': choose one of infer, joint"):
        SearchSpec(10, 1, "cpu", labels="given")
    with pytest.raises(ValueError, match="precision 'float16': choose one of float32, bfloat16"):
        SearchSpec(10, 1, "cpu", precision="float16")
    with pytest.raises(ValueError, match="precision 'half': choose one of float32, bfloat16"):
        InvertingGradientsParams(precision="half")


def test_the_docs_own_attack_is_this_module_and_it_reconstructs(tmp_path) -> None:
    from pathlib import Path

    from fedguard.config import Config
    from fedguard.metrics import psnr
    from tests.test_inverting_gradients import floor

    root = Path(__file__).resolve().parents[1]
    source = (root / "extensions" / "smooth_inversion.py").read_text()
    page = root / "docs" / "how-to" / "attack-plugin.md"
    assert f"```python\n{source}```" in page.read_text(), "the docs' example differs from the module"
    config = Config.from_flat(
        {
            "server.plugins": "extensions.smooth_inversion",
            "attack.name": "smooth-inversion",
            "attack.smooth-inversion.iterations": 300,
            "attack.smooth-inversion.device": "cpu",
        }
    )
    from attackers.base import build_attack

    attack = build_attack(config.attacks[0].name, config.attacks[0].params)
    observations, x, _ = uploads()
    images = torch.cat([r.images for r in attack.reconstruct_many(observations[:2], 0)])
    got = psnr(images, x[:2])
    print("smooth-inversion psnr", got, "floor", floor(x[:2])[0])
    assert bool((got > torch.tensor(floor(x[:2])[0]) + 6).all())


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("step", [0.1, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001, 0.0001]),
        ("cosine", [0.05 * (1 + np.cos(np.pi * i / 8)) for i in range(8)]),
        ("none", [0.1] * 8),
    ],
)
def test_learning_rate_schedules(schedule: str, expected: list[float]) -> None:
    """The learning rate used at each of 8 steps: step decay at 3/8, 5/8, 7/8; a half cosine towards 0."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = scheduler_of(optimizer, schedule, 8)
    used = []
    for _ in range(8):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert np.allclose(used, expected), used


def test_a_registered_distance_and_prior_are_searched_by_name() -> None:
    calls: dict[str, int] = {"distance": 0, "prior": 0}

    @register_distance("l1-of-a-test")
    def l1_distance(g: list[torch.Tensor], target: list[torch.Tensor]) -> torch.Tensor:
        calls["distance"] += 1
        return sum((x - y).flatten(1).abs().sum(1) for x, y in zip(g, target))  # type: ignore[return-value]

    @register_prior("dark-of-a-test")
    def dark_prior(inputs: TermInputs) -> torch.Tensor:
        calls["prior"] += 1
        return inputs.images.flatten(1).mean(1)

    observations, _, _ = uploads()
    spec = SearchSpec(20, 1, "cpu", distance="l1-of-a-test", terms=(Term("dark-of-a-test", 0.1),), compile="off")
    [found] = search(spec, observations[:1], 0)
    assert calls["distance"] >= 20 and calls["prior"] >= 20 and torch.isfinite(found.images).all()
    with pytest.raises(ValueError, match="distance 'cosine' is registered already"):
        register_distance("cosine")(l1_distance)
    with pytest.raises(ValueError, match="prior 'tv' is registered already"):
        register_prior("tv")(dark_prior)
    with pytest.raises(ValueError, match="distance 'l1-of-a-tset': choose one of .*l1-of-a-test"):
        SearchSpec(20, 1, "cpu", distance="l1-of-a-tset")
