"""Stochastic uniform quantization: unbiased, at most 2**bits levels, on each entry's neighbouring levels.

Statistics: over N = 4000 draws, the mean of an entry quantized with step s, at fraction p between its two
levels, has standard error s * sqrt(p (1 - p) / N) <= s / 126; we allow 5 / 126 s, and deterministic rounding
to the nearest level would be off by up to s / 2. The sample variance of that Bernoulli(p) times s**2 has
standard error about s**2 * sqrt(p (1 - p) / N) <= s**2 / 126 as well; we allow 5 times it.
"""

from __future__ import annotations

import pytest
import torch

from fedguard.config import ConfigError, load_config
from fedguard.defenses import DEFENSES, build_defense
from fedguard.defenses.quantization import QuantizeParams, StochasticQuantization
from tests.steps import update_only as step_of

DRAWS = 4000


def quantize(bits: int) -> StochasticQuantization:
    return build_defense("quantize", QuantizeParams(bits))


def update(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(20, 10, generator=g) * 0.1, torch.randn(100, generator=g) ** 3, torch.rand(7, generator=g)]


def grid(g: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest level, step) of a tensor's grid."""
    return g.min(), (g.max() - g.min()) / (2**bits - 1)


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_quantization_is_unbiased_with_bernoulli_variance(bits: int) -> None:
    grads = update(bits)
    defense, generator = quantize(bits), torch.Generator().manual_seed(bits)
    draws = [torch.stack(d) for d in zip(*(defense(step_of(grads, generator), {}) for _ in range(DRAWS)))]
    for g, q in zip(grads, draws):
        lo, step = grid(g, bits)
        fraction = (g - lo) / step - ((g - lo) / step).floor()
        assert float((q.mean(0) - g).abs().max()) < 5 / 126 * float(step)
        variance = fraction * (1 - fraction) * step**2
        assert float((q.var(0, unbiased=False) - variance).abs().max()) < 5 / 126 * float(step) ** 2
        assert float(variance.max()) > 0.2 * float(step) ** 2, "the test needs entries between levels"


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_at_most_two_to_the_bits_levels_and_each_entry_on_a_neighbouring_level(bits: int) -> None:
    g = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    (q,) = quantize(bits)(step_of([g], torch.Generator().manual_seed(1)), {})
    assert q.shape == g.shape and q.dtype == g.dtype
    levels = q.unique()
    assert len(levels) <= 2**bits
    assert len(levels) >= min(2**bits, 200)  # the levels are used, not collapsed
    lo, step = grid(g, bits)
    index = (q - lo) / step
    torch.testing.assert_close(index, index.round(), atol=1e-3, rtol=0)  # on the grid lo + k step
    assert float((q - g).abs().max()) <= float(step) * (1 + 1e-5)
    if bits == 1:
        assert set(levels.tolist()) == {float(g.min()), float(g.max())}


def test_a_constant_tensor_is_sent_unchanged_and_state_is_untouched() -> None:
    grads, state = [torch.full((5,), 0.25), torch.tensor([-3.0])], {}
    out = quantize(2)(step_of(grads, torch.Generator().manual_seed(0)), state)
    assert all(torch.equal(o, g) for o, g in zip(out, grads)) and state == {}


def test_the_draws_are_determined_by_the_generator_seed() -> None:
    grads = update(5)
    first = quantize(3)(step_of(grads, torch.Generator().manual_seed(4)), {})
    again = quantize(3)(step_of(grads, torch.Generator().manual_seed(4)), {})
    other = quantize(3)(step_of(grads, torch.Generator().manual_seed(5)), {})
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_simulate_draws_like_the_defense_and_passes_gradients_straight_through() -> None:
    job = update(6)
    batched = [g[None].clone().requires_grad_() for g in job]
    simulated = quantize(2).simulate(batched, torch.Generator().manual_seed(9))
    expected = quantize(2)(step_of(job, torch.Generator().manual_seed(9)), {})
    assert all(torch.equal(s[0], e) for s, e in zip(simulated, expected))
    sum((s * 3).sum() for s in simulated).backward()
    assert all(torch.equal(b.grad, torch.full_like(b, 3.0)) for b in batched)


@pytest.mark.parametrize("bits", [0, 17, 2.5, True])
def test_bits_outside_one_to_sixteen_are_rejected(bits) -> None:
    with pytest.raises(ValueError, match=rf"bits must be an integer in \[1, 16\], got {bits}"):
        QuantizeParams(bits=bits)


def test_registered_and_configurable() -> None:
    assert DEFENSES.get("quantize").params is QuantizeParams
    assert load_config(None, ["defense.name=quantize", "defense.quantize.bits=4"]).defense.params == QuantizeParams(4)
    with pytest.raises(ConfigError, match="bits must be"):
        load_config(None, ["defense.name=quantize", "defense.quantize.bits=0"])
