"""Magnitude (Top-k) pruning: exact per-layer counts, the largest entries sent, error feedback on and off."""

from __future__ import annotations

import pytest
import torch

from fedguard.config import ConfigError, load_config
from fedguard.defenses import DEFENSES, build_defense
from fedguard.defenses.magnitude import largest
from fedguard.defenses.pruning import MagnitudePruning, PruneParams
from tests.steps import update_only as step_of

SHAPES = [(64, 300), (64,), (10, 64), (10,), (1,)]


def update(seed: int) -> list[torch.Tensor]:
    """Heavy-tailed float32 entries of many magnitudes, in SHAPES."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) / torch.rand(s, generator=g).add(1e-3).sqrt() * 1e-2 for s in SHAPES]


def prune(keep: float = 0.2, error_feedback: bool = True) -> MagnitudePruning:
    return build_defense("prune", PruneParams(keep, error_feedback))


def residuals(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [state[f"prune.residual.{i}"].clone() for i in range(len(SHAPES))]


@pytest.mark.parametrize("k", [0, 1, 7, 50, 93, 100])
def test_largest_matches_a_stable_descending_sort_under_heavy_ties(k: int) -> None:
    values = torch.randint(0, 5, (3, 100), generator=torch.Generator().manual_seed(k)).float()
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    expected = torch.zeros_like(values, dtype=torch.bool).scatter_(-1, order[:, :k], True)
    assert torch.equal(largest(values, k), expected)


@pytest.mark.parametrize(
    ("keep", "size", "sent"),
    [
        (0.2, 19200, 3840),
        (0.2, 10, 2),
        (0.2, 1, 1),
        (0.07, 100, 7),
        (0.05, 10, 1),
        (1.0, 7, 7),
        (0.8, 64, 52),
    ],
)
def test_per_layer_counts_round_up(keep: float, size: int, sent: int) -> None:
    assert prune(keep).bounds(size) == (0, sent)


def test_each_layer_sends_its_largest_entries_as_copies() -> None:
    grads = update(0)
    out = prune(0.2, error_feedback=False)(step_of(grads), {})
    for s, g in zip(out, grads):
        mask = s != 0
        assert int(mask.sum()) == prune().bounds(g.numel())[1]
        assert torch.equal(s[mask], g[mask]) and not s[~mask].any()
        if (~mask).any():
            assert g[mask].abs().min() >= g[~mask].abs().max()


def test_keep_one_sends_the_update_and_leaves_a_zero_residual() -> None:
    grads, state = update(1), {}
    out = prune(1.0)(step_of(grads), state)
    assert all(torch.equal(o, g) for o, g in zip(out, grads))
    assert not any(e.any() for e in residuals(state))


def test_error_feedback_conserves_exactly_over_two_rounds() -> None:
    defense, state = prune(0.1), {}
    raw1, raw2 = update(2), update(3)
    sent1 = defense(step_of(raw1), state)
    residual1 = residuals(state)
    assert all(torch.equal(s + e, g) for s, e, g in zip(sent1, residual1, raw1))
    sent2 = defense(step_of(raw2), state)
    residual2 = residuals(state)
    assert all(torch.equal(s + e2, g + e1) for s, e1, e2, g in zip(sent2, residual1, residual2, raw2))
    expected = prune(0.1, error_feedback=False)(step_of([g + e for g, e in zip(raw2, residual1)]), {})
    assert all(torch.equal(s, x) for s, x in zip(sent2, expected))


def test_error_feedback_eventually_sends_a_constant_small_coordinate() -> None:
    """A coordinate always 100x below the top entry accumulates until it is sent; without EF it never is."""
    grads = [torch.tensor([1.0, 0.01])]
    with_ef, state = prune(0.5), {}
    sent = [with_ef(step_of(grads), state)[0] for _ in range(101)]
    assert any(s[1] != 0 for s in sent)
    total = torch.stack(sent).sum(0) + state["prune.residual.0"]
    torch.testing.assert_close(total, 101 * grads[0])
    assert all(prune(0.5, error_feedback=False)(step_of(grads), {})[0][1] == 0 for _ in range(3))


def test_without_error_feedback_state_is_untouched_and_rounds_are_independent() -> None:
    defense, state = prune(0.2, error_feedback=False), {}
    raw = update(4)
    first, again = defense(step_of(raw), state), defense(step_of(raw), state)
    assert state == {}
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_the_clients_gradients_are_not_changed() -> None:
    grads = update(5)
    originals = [g.clone() for g in grads]
    state: dict[str, torch.Tensor] = {}
    prune()(step_of(grads), state)
    prune()(step_of(grads), state)
    assert all(torch.equal(g, o) for g, o in zip(grads, originals))


def test_simulate_is_the_defense_job_by_job() -> None:
    jobs = [update(6), update(7)]
    batched = [torch.stack([job[i] for job in jobs]) for i in range(len(SHAPES))]
    simulated = prune(0.3).simulate(batched, torch.Generator())
    for j, job in enumerate(jobs):
        assert all(torch.equal(s[j], e) for s, e in zip(simulated, prune(0.3)(step_of(job), {})))


@pytest.mark.parametrize("keep", [0.0, -0.5, 1.5, float("nan")])
def test_a_keep_fraction_outside_the_unit_interval_is_rejected(keep: float) -> None:
    with pytest.raises(ValueError, match=rf"keep must be in \(0, 1\], got {keep}"):
        PruneParams(keep=keep)


def test_registered_and_configurable() -> None:
    assert DEFENSES.get("prune").params is PruneParams
    config = load_config(None, ["defense.name=prune", "defense.prune.keep=0.8", "defense.prune.error-feedback=false"])
    assert config.defense.params == PruneParams(keep=0.8, error_feedback=False)
    with pytest.raises(ConfigError, match="keep must be in"):
        load_config(None, ["defense.name=prune", "defense.prune.keep=0"])
