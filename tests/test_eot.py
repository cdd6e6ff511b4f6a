"""Expectation over transformation: IG re-applies a known randomized defense to its dummy updates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attackers.base import build_attack, missing_grants
from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from fedguard.config import Config, ConfigError
from fedguard.defenses import LocalStep, build_defense
from fedguard.defenses.base import DEFENSES, defense_traits
from fedguard.defenses.dp_update import UpdateDPParams
from fedguard.training import loss_fn
from tests.devices import ATTACK_DEVICE
from tests.test_inverting_gradients import uploads


def defended(defense, job: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """What a client with ``defense`` uploads for the update ``job``, its generator seeded with ``seed``."""
    step = LocalStep(
        torch.nn.Identity(), torch.zeros(1), torch.zeros(1), job, loss_fn, torch.Generator().manual_seed(seed)
    )
    return defense(step, {})


@pytest.mark.parametrize("mechanism", ["gaussian", "laplace"])
def test_dp_simulate_is_the_defense_itself_job_by_job(mechanism: str) -> None:
    jobs = [[torch.randn(3, 4) * s, torch.randn(3) * s] for s in (0.1, 5.0)]  # one below the clip, one above
    batched = [torch.stack([job[i] for job in jobs]) for i in range(2)]
    clip_only = build_defense("dp", UpdateDPParams(clip=0.5, noise_multiplier=0.0, mechanism=mechanism))
    simulated = clip_only.simulate(batched, torch.Generator().manual_seed(7))
    for j, job in enumerate(jobs):  # clipping is per job, exactly the client's
        assert all(torch.allclose(s[j], e, atol=1e-7) for s, e in zip(simulated, defended(clip_only, job, 0)))
    noisy = build_defense("dp", UpdateDPParams(clip=0.5, noise_multiplier=0.3, mechanism=mechanism))
    for job in jobs:  # one job: the same draws from the same seed
        one = noisy.simulate([t[None] for t in job], torch.Generator().manual_seed(3))
        assert all(torch.allclose(s[0], e, atol=1e-6) for s, e in zip(one, defended(noisy, job, 3)))


def test_dp_simulate_is_differentiable_in_the_update() -> None:
    defense = build_defense("dp", UpdateDPParams(clip=1.0, noise_multiplier=0.1))
    g = torch.randn(2, 5, requires_grad=True)
    (out,) = defense.simulate([g], torch.Generator().manual_seed(0))
    out.sum().backward()
    assert g.grad is not None and torch.isfinite(g.grad).all() and g.grad.abs().sum() > 0


class CountingDefense:
    """Records the shapes it is applied to; adds nothing."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, ...]]] = []

    def simulate(self, grads: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        self.calls.append([tuple(g.shape) for g in grads])
        return list(grads)


def test_eot_applies_the_defense_draws_times_per_iteration_to_every_job() -> None:
    observations, _, _ = uploads()
    attack = InvertingGradients(InvertingGradientsParams(iterations=5, restarts=2, device=ATTACK_DEVICE, eot=3))
    defense = CountingDefense()
    attack.know_defense(defense)
    plain = InvertingGradients(InvertingGradientsParams(iterations=5, restarts=2, device=ATTACK_DEVICE))
    got = attack.reconstruct_many(observations[:2], 0)
    want = plain.reconstruct_many(observations[:2], 0)
    assert len(defense.calls) == 3 * (5 + 1)  # each iteration and the final scoring
    jobs = {shapes[0][0] for shapes in defense.calls}
    assert jobs == {4} and len(defense.calls[0]) == len(observations[0].upload)  # 2 uploads x 2 restarts, all tensors
    for a, b in zip(got, want):  # an identity defense leaves the attack unchanged
        assert torch.allclose(a.images, b.images, atol=1e-6)


def test_eot_needs_the_defense_granted_and_simulable() -> None:
    with pytest.raises(ConfigError, match="threat model does not grant: defense"):
        Config.from_flat({"attack.name": "ig", "attack.ig.eot": 4, "defense.name": "dp"})
    config = Config.from_flat({"attack.name": "ig", "attack.ig.eot": 4, "defense.name": "dp", "threat.defense": True})
    attack = build_attack("ig", config.attacks[0].params, ("dp", config.defense.params))
    assert isinstance(attack.defense.params, UpdateDPParams) and missing_grants(attack, {"defense"}) == []
    with pytest.raises(ValueError, match="needs the clients' defense"):
        build_attack("ig", config.attacks[0].params)
    with pytest.raises(ValueError, match="defense 'soteria' cannot be simulated"):
        build_attack("ig", config.attacks[0].params, ("soteria", None))
    with pytest.raises(ValueError, match="eot must be >= 0"):
        InvertingGradientsParams(eot=-1)


SIMULATED = sorted(name for name in DEFENSES.names() if defense_traits(name).simulated)


@pytest.mark.parametrize("name", SIMULATED)
def test_eot_runs_through_every_defense_that_simulates_itself(name: str) -> None:
    """The defense runs inside the search's ``torch.func`` transforms (no storage, no data-dependent branch)."""
    config = Config.from_flat({"attack.name": "ig", "attack.ig.eot": 2, "defense.name": name, "threat.defense": True})
    params = dataclasses.replace(config.attacks[0].params, iterations=3, restarts=2, device=ATTACK_DEVICE)
    attack = build_attack("ig", params, (name, config.defense.params))
    observations, _, _ = uploads()
    (got,) = attack.reconstruct_many(observations[:1], 0)
    assert got.images.shape == (1, *observations[0].spec.shape) and torch.isfinite(got.images).all()
