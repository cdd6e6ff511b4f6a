"""What a defense sees and returns, and the defense registry.

A defense is a callable ``defense(step, state) -> list[Tensor]``: it receives
everything a client knows at upload time and returns what is uploaded in place
of ``step.grads`` (same shapes). ``state`` is a dict of tensors that survives
between the rounds of one client (error-feedback residuals, caches); the
defense reads and updates it in place. Each registered defense declares its
``DefenseTraits`` (protocols, model check, whether it can simulate itself, the
files its clients load), which the configuration reads without building it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from fedguard.registry import NoParams, Registry, RequiredFile
from fedguard.trained.files import refuse
from fedguard.training import StepGradient, compute_gradients, loss_fn

REPORT_PREFIX = "defense."  # fit-metric prefix of what a ReportingDefense reports
UPLOAD_PREFIX = "upload."  # report-name prefix of a number about this upload alone (not cumulative)


@dataclass
class LocalStep:
    """One client's upload before defense.

    ``model``: at the parameters the step started from (the global ones; the client's own BatchNorm layers under
    ``train.fedbn``); ``x`` (B, C, H, W)
    in [0, 1] and ``y`` (B,) are the samples used; ``grads`` holds one tensor per
    trainable parameter: the batch gradient (FedSGD) or the pseudo-gradient
    ``global - local`` of several local steps (FedAvg); ``loss_fn(logits, y)``
    is the training loss; ``generator`` is seeded from (seed, client, round); ``examples`` is the number of
    examples the client holds (its local data set; 0 when unknown).
    """

    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    grads: list[torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    generator: torch.Generator
    round: int = 0
    client: int = 0
    examples: int = 0


def update_step(
    grads: list[torch.Tensor], generator: torch.Generator, round_: int, client: int, examples: int
) -> LocalStep:
    """The ``LocalStep`` of an update whose training the defense did not see: ``grads`` only, with a model of no
    parameters and an empty batch, for the defenses whose traits say ``update_only``."""
    empty = torch.empty(0)
    return LocalStep(
        nn.Module(), empty, empty.long(), grads, nn.functional.cross_entropy, generator, round_, client, examples
    )


def step_gradient(
    defense: Defense,
    state: dict[str, torch.Tensor],
    generator: torch.Generator,
    round_: int,
    client: int,
    examples: int,
) -> StepGradient:
    """What every local step follows under a defense that ``defends_steps``: ``defense`` on the step's batch at the
    model's current parameters (its ``grads`` the batch's plain gradient), with the batch's loss; ``state`` and
    ``generator`` are the round's, shared by its steps."""

    def gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], float]:
        plain, loss = compute_gradients(model, x, y)
        step = LocalStep(model, x, y, plain, loss_fn, generator, round_, client, examples)
        return [g.detach() for g in defense(step, state)], loss

    return gradient


class Defense(Protocol):
    """Client-side middleware between the local step and the upload."""

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]: ...


@runtime_checkable
class ReportingDefense(Protocol):
    """A defense that also reports numbers about itself after each upload (cumulative privacy loss, fallbacks).

    ``report(state)`` is called with the client's state after the defense ran and returns floats by name; they
    travel with the upload as fit metrics ``defense.<name>``. Two kinds of name:

    - ``<name>``: a running total of the client (epsilon spent, fallbacks so far); ``rounds.jsonl`` records,
      per round, the largest value over that round's clients (the worst-off client).
    - ``upload.<name>``: a number about this upload alone (its gradient norm, whether it was sent raw);
      ``rounds.jsonl`` records each upload's values with its client under ``uploads`` and their mean over the
      round's uploads as ``<name>`` beside the totals.
    """

    def report(self, state: dict[str, torch.Tensor]) -> dict[str, float]: ...


def defense_report(defense: Defense, state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The fit metrics ``defense.<name>`` of a ``ReportingDefense``, or nothing for other defenses."""
    if not isinstance(defense, ReportingDefense):
        return {}
    return {f"{REPORT_PREFIX}{k}": float(v) for k, v in defense.report(state).items()}


@dataclass(frozen=True)
class RoundReports:
    """A round's defense reports: ``totals`` per name (largest running total over the clients, and the mean of
    each per-upload number), ``uploads`` one dict per upload that reported per-upload numbers (with its
    ``client`` where the metrics name one)."""

    totals: dict[str, float]
    uploads: list[dict[str, float]]


def aggregate_reports(metrics: list[dict[str, Any]]) -> RoundReports:
    """The round's ``RoundReports`` from the clients' fit metrics; keys without ``defense.`` are dropped."""
    totals: dict[str, float] = {}
    uploads: list[dict[str, float]] = []
    for client in metrics:
        upload: dict[str, float] = {}
        for key, value in client.items():
            if not key.startswith(REPORT_PREFIX):
                continue
            name = key[len(REPORT_PREFIX) :]
            if name.startswith(UPLOAD_PREFIX):
                upload[name[len(UPLOAD_PREFIX) :]] = float(value)
            else:
                totals[name] = max(float(value), totals.get(name, float("-inf")))
        if upload:
            uploads.append({**({"client": client["client"]} if "client" in client else {}), **upload})
    for name in dict.fromkeys(k for u in uploads for k in u if k != "client"):
        values = [u[name] for u in uploads if name in u]
        totals[name] = sum(values) / len(values)
    return RoundReports(totals, uploads)


class SimulatedDefense(Protocol):
    """A defense an attacker who knows it (and its parameters, not its randomness) can re-apply.

    ``simulate(grads, generator)`` applies the defense to J updates at once: each tensor of ``grads`` has a
    leading job dimension (J, ...) and the list follows the trainable parameters in order; the result has the
    same shapes, is differentiable in ``grads``, and draws fresh randomness from ``generator``. Attacks use it
    for expectation over transformation (EOT).
    """

    def simulate(self, grads: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class DefenseTraits:
    """What a defense with given parameters declares, known without building it: the ``protocols`` it works on
    (None: every one), a ``check_model(model)`` raising ``ValueError`` for a model it cannot defend, whether it is
    ``simulated`` (has ``simulate``, for EOT attacks), the ``files`` its clients load, and whether it is
    ``update_only``: it reads nothing of its ``LocalStep`` but ``grads``, ``generator``, ``round``, ``client`` and
    ``examples``, so that it can defend the update of training it did not see (``update_step``; a Flower mod,
    ``fedguard.flower``), and whether it ``defends_steps``: under a protocol that uploads models (FedAvg) it is
    called on every local step's batch, and the step follows what it returns (``step_gradient``; DP-SGD), the
    upload being the model those steps reach."""

    protocols: frozenset[str] | None = None
    check_model: Callable[[nn.Module], None] | None = None
    simulated: bool = False
    files: tuple[RequiredFile, ...] = ()
    update_only: bool = False
    defends_steps: bool = False

    @classmethod
    def of(cls, defense: type, **changes: Any) -> DefenseTraits:
        """The traits ``defense``'s class declares (``protocols``, a static ``check_model``, ``simulate``), with
        ``changes`` for those its parameters set."""
        declared = cls(
            getattr(defense, "protocols", None),
            getattr(defense, "check_model", None),
            callable(getattr(defense, "simulate", None)),
            update_only=bool(getattr(defense, "update_only", False)),
            defends_steps=bool(getattr(defense, "defends_steps", False)),
        )
        return dataclasses.replace(declared, **changes)


DefenseBuilder = Callable[[Any], Defense]
DefenseTraitsOf = Callable[[Any], DefenseTraits]

DEFENSES: Registry[DefenseBuilder] = Registry("defense")


def unrestricted(params: Any) -> DefenseTraits:
    """The traits of a defense that declares none: every protocol and model, not simulated, no files."""
    return DefenseTraits()


def register_defense(
    name: str, params: type = NoParams, *, traits: DefenseTraitsOf = unrestricted
) -> Callable[[DefenseBuilder], DefenseBuilder]:
    """Register the decorated builder under ``name``; ``traits(params)`` declares what the configuration checks."""
    return DEFENSES.register(name, params, traits)


def class_traits(defense: type) -> DefenseTraitsOf:
    """The ``traits`` of a defense whose class declares them, whatever its parameters."""
    return lambda params: DefenseTraits.of(defense)


def defense_traits(name: str, params: Any = None) -> DefenseTraits:
    """The traits of the registered defense ``name`` with ``params`` (its defaults when None); nothing is built."""
    return DEFENSES.traits(name, params)


def build_defense(name: str, params: Any = None) -> Defense:
    """The registered defense ``name`` configured with ``params``."""
    return DEFENSES.build(name, params=params)


def check_defense_files(name: str, params: Any, clients_here: bool = False, spec: Any = None) -> None:
    """Raise ``TrainedFileError`` naming every file the defense ``name`` with ``params`` loads that is there on
    this machine but cannot be used (corrupt, non-finite, another kind of file, or made for data other than
    ``spec``'s when that ``DataSpec`` is given); the server calls it before round 1. A missing file is left to the
    clients, which load it on their own machines, unless ``clients_here`` (a simulation, checked before it
    starts): then it raises ``MissingTrainedFile`` for it too."""
    files = [file for file in defense_traits(name, params).files if file.path]

    def setting(file: RequiredFile) -> str:
        return f"defense.{name}.{file.param.replace('_', '-')} = {file.path!r}"

    missing = [f"{setting(file)}: {file.missing}" for file in files if clients_here and not Path(file.path).exists()]
    unusable = [f"{setting(file)}: {problem}" for file in files if (problem := file.unusable(spec)) is not None]
    refuse(missing, unusable, f"defense {name!r}")
