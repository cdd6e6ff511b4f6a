"""torch.compile of the attack engine: the compiled evaluations equal the eager ones, ``auto`` decides as
documented, and a program that fails to compile runs eager."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch.func import grad, grad_and_value, vmap

from attackers.dlg import DeepLeakage, DLGParams
from attackers.engine import compiled
from attackers.engine.compiled import AUTO_MIN_ITERATIONS, Compiler, compiler_available
from attackers.engine.objective import Objective
from attackers.engine.problem import Problem
from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from tests.test_inverting_gradients import uploads

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(not compiler_available(CPU), reason="no C++ compiler for torch.compile")


def objective_of(attack, observations) -> tuple[Objective, torch.Tensor]:
    """The attack's objective on ``observations`` and its seeded starting points (J, ...)."""
    problem = Problem.of(attack.spec, observations, CPU, None)
    z = torch.stack([problem.space.start(problem.generator(0, j)) for j in range(problem.jobs)])
    return Objective(attack.spec, problem, None, 0), z


@needs_compiler
def test_the_compiled_signed_adam_step_equals_the_eager_one() -> None:
    observations, _, _ = uploads()
    objective, z = objective_of(InvertingGradients(InvertingGradientsParams(device="cpu")), observations[:2])
    losses = objective.losses_at(0.0)
    eager = grad(lambda point: losses(point).sum())
    compiler = Compiler("on", CPU, 1, "test")
    step = compiler(eager)
    for _ in range(2):  # the second call runs the compiled program without tracing
        assert torch.allclose(step(z), eager(z), rtol=1e-4, atol=1e-7)
        z = (z - 0.01 * eager(z).sign()).clamp(0, 1)


@needs_compiler
def test_the_compiled_gradinversion_step_with_batch_norm_statistics_equals_the_eager_one() -> None:
    from attackers.gradinversion import GradInversion, GradInversionParams
    from tests.test_gradinversion import digits_upload

    obs, _, _, _ = digits_upload()
    attack = GradInversion(GradInversionParams(restarts=2, device="cpu", group_start=0.0))
    objective, z = objective_of(attack, [obs])
    losses = objective.losses_at(1.0)  # every term, the BatchNorm statistics' and the group's included
    eager = grad(lambda point: losses(point).sum())
    step = Compiler("on", CPU, 1, "test-bn")(eager)
    for _ in range(2):
        assert torch.allclose(step(z), eager(z), rtol=1e-4, atol=1e-7)
        z = (z - 0.01 * eager(z)).clamp(0, 1)


@needs_compiler
def test_the_compiled_lbfgs_evaluations_equal_the_eager_ones() -> None:
    observations, _, _ = uploads()
    objective, z = objective_of(DeepLeakage(DLGParams(device="cpu"), infer=False), observations[:2])
    losses = objective.losses_at(1.0)
    compiler = Compiler("on", CPU, 1, "test")
    gradient = grad_and_value(lambda point: losses(point).sum())
    dz, value = compiler(gradient)(z)
    dz_eager, value_eager = gradient(z)
    assert torch.allclose(dz, dz_eager, rtol=1e-4, atol=1e-6) and torch.allclose(value, value_eager, rtol=1e-5)
    trials = torch.stack([z, z * 0.5])
    assert torch.allclose(compiler(vmap(losses))(trials), vmap(losses)(trials), rtol=1e-5)


@needs_compiler
def test_a_compiled_attack_reconstructs_as_well_as_the_eager_one() -> None:
    observations, _x, _ = uploads()
    params = InvertingGradientsParams(iterations=40, device="cpu")
    results = {}
    for mode in ("off", "on"):
        recons = InvertingGradients(dataclasses.replace(params, compile=mode)).reconstruct_many(observations[:2], 0)
        results[mode] = torch.cat([r.images for r in recons])
    assert (results["on"] - results["off"]).abs().mean() < 0.02


@needs_compiler
def test_consecutive_searches_of_one_kind_reuse_the_compiled_programs_on_their_own_data() -> None:
    from torch._dynamo.utils import counters

    observations, _, _ = uploads()
    params = InvertingGradientsParams(iterations=20, device="cpu")
    compiled_attack = InvertingGradients(dataclasses.replace(params, compile="on"))
    eager_attack = InvertingGradients(dataclasses.replace(params, compile="off"))
    compiled_attack.reconstruct_many(observations[:1], 0)
    graphs = counters["stats"]["unique_graphs"]
    for upload in (observations[1:2], observations[2:3]):  # other targets, the same shapes
        got = compiled_attack.reconstruct_many(upload, 0)[0].images
        assert (got - eager_attack.reconstruct_many(upload, 0)[0].images).abs().mean() < 0.02
    assert counters["stats"]["unique_graphs"] == graphs  # nothing traced again
    compiled_attack.reconstruct_many(observations[:2], 0)  # another kind (two jobs): traced anew
    assert counters["stats"]["unique_graphs"] > graphs


def test_auto_compiles_only_long_searches_with_a_compiler_and_not_when_switched_off(monkeypatch) -> None:
    monkeypatch.setenv(compiled.ENV, "auto")
    monkeypatch.setattr(compiled, "compiler_available", lambda device: True)
    assert Compiler("auto", CPU, AUTO_MIN_ITERATIONS, "k").enabled
    assert not Compiler("auto", CPU, AUTO_MIN_ITERATIONS - 1, "k").enabled
    assert Compiler("on", CPU, 1, "k").enabled and not Compiler("off", CPU, 10**6, "k").enabled
    assert not Compiler("auto", CPU, AUTO_MIN_ITERATIONS, "k", "bfloat16").enabled  # Inductor fails on it
    assert Compiler("auto", torch.device("cuda"), AUTO_MIN_ITERATIONS, "k", "bfloat16").enabled
    monkeypatch.setenv(compiled.ENV, "off")
    assert not Compiler("auto", CPU, AUTO_MIN_ITERATIONS, "k").enabled
    monkeypatch.setenv(compiled.ENV, "auto")
    monkeypatch.setattr(compiled, "compiler_available", lambda device: False)
    assert not Compiler("auto", CPU, AUTO_MIN_ITERATIONS, "k").enabled


def test_a_program_that_fails_to_compile_runs_eager_under_auto_and_raises_under_on(monkeypatch) -> None:
    def broken(fn, **_):
        def call(*args):
            raise RuntimeError("C++ compile error\nmore")

        return call

    monkeypatch.setenv(compiled.ENV, "auto")
    monkeypatch.setattr(compiled, "compiler_available", lambda device: True)
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(compiled, "_failed", set())
    double = Compiler("auto", CPU, AUTO_MIN_ITERATIONS, "kind")(lambda t: 2 * t)
    with pytest.warns(UserWarning, match="torch.compile failed .*C\\+\\+ compile error.* runs eager"):
        assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
    assert not Compiler("auto", CPU, AUTO_MIN_ITERATIONS, "kind").enabled  # remembered for this kind of search
    with pytest.raises(RuntimeError, match="C\\+\\+ compile error"):
        Compiler("on", CPU, 1, "kind")(lambda t: 2 * t)(torch.ones(2))


def test_a_bad_compile_value_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="compile 'yes': choose one of auto, on, off"):
        InvertingGradientsParams(compile="yes")
