"""The attack interface, what attacks may ask of the threat model, and the attack registry.

An attack sees nothing but an ``Observation`` (what the server received) and
returns a ``Reconstruction``. Each registered attack declares its
``AttackTraits`` (what it attacks, what it needs beyond the upload, the
manipulation it exploits, the files it loads) as a pure function of its
parameters; the configuration checks them without building the attack, and a
run whose threat model does not grant what an attack needs fails at
configuration time. The server checks the files once, before round 1
(``check_attack_files``): that they are there and that they load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from attackers.manipulation import HONEST
from fedguard.observation import Observation
from fedguard.registry import NoParams, Registry, RequiredFile
from fedguard.trained.files import refuse

NEEDS = {
    "labels": "the true labels of the batch",
    "bn-statistics": "the BatchNorm statistics of the batch",
    "hyperparameters": "the client's declared local hyper-parameters",
    "defense": "the clients' defense and its parameters (not its randomness)",
}


@dataclass
class Reconstruction:
    """``images`` (B, C, H, W) in [0, 1], ``labels`` (B,) int64 (-1 where the attack does not know them: no label
    accuracy is scored then), and attack statistics (loss, iterations, ...);
    ``gradient``: the gradient the attack inverted when it changed the upload's (one array per trainable
    parameter; a denoising stage), scored by the evaluator against the clean one."""

    images: torch.Tensor
    labels: torch.Tensor
    stats: dict[str, Any] = field(default_factory=dict)
    gradient: list[np.ndarray] | None = None


@dataclass
class AttackOutcome:
    """What became of one attack on one observation: ``status`` is 'ok', 'error', 'timeout' or 'interrupted'
    (the run stopped before it finished)."""

    observation: Observation
    status: str
    reconstruction: Reconstruction | None = None
    error: str | None = None
    seconds: float = 0.0
    worker: int = -1
    attack: str = ""


class Attack(Protocol):
    """Server-side attack on captured uploads.

    ``needs``: what it needs beyond the upload (keys of ``NEEDS``), ``needs_by_upload``: more on some upload
    kinds; ``uploads``: the upload kinds it attacks; ``manipulation``: the malicious-server manipulation it
    exploits ('none' for honest-server attacks); it only attacks uploads computed on a model so manipulated.
    ``reconstruct_many(observations, seed)``: one ``Reconstruction`` per upload (all of one shape key), from
    starting points ``seed`` fixes: the same seed repeats exactly, another gives other starts."""

    needs: frozenset[str]
    needs_by_upload: Mapping[str, frozenset[str]]
    uploads: frozenset[str]
    manipulation: str

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]: ...


@dataclass(frozen=True)
class AttackTraits:
    """What an attack with given parameters declares, known without building it: the ``uploads`` it attacks,
    what it ``needs`` from the threat model (keys of ``NEEDS``) on every upload and ``needs_by_upload`` on some
    kinds only, the ``manipulation`` it exploits, whether it ``simulates_defense`` (EOT: the clients' defense
    must be able to simulate itself), whether it is ``adaptive`` (it uses what it knows of the clients' defense:
    leaves out the layers it alters, simulates it, or reads its noise level; a sweep row says so), the
    ``files`` it loads on the server, a ``check_model(model)`` raising ``ValueError`` for a model it cannot
    attack (the configuration calls it on the run's model built on the meta device: structure, no values), and
    the upload kinds whose secure aggregate it attacks (``sums``: ``fedguard.aggregate``; a FedSGD aggregate is the
    gradient of the union of the batches, a FedAvg one mixes local trainings no replay follows)."""

    uploads: frozenset[str]
    needs: frozenset[str] = frozenset()
    needs_by_upload: Mapping[str, frozenset[str]] = field(default_factory=dict)
    manipulation: str = HONEST
    simulates_defense: bool = False
    adaptive: bool = False
    files: tuple[RequiredFile, ...] = ()
    check_model: Callable[[torch.nn.Module], None] | None = None
    sums: frozenset[str] = frozenset()

    @classmethod
    def of(cls, attack: type, **changes: Any) -> AttackTraits:
        """The traits ``attack``'s class attributes declare, with ``changes`` for those its parameters set."""
        names = ("uploads", "needs", "needs_by_upload", "manipulation", "check_model", "sums")
        declared = {name: getattr(attack, name) for name in names if hasattr(attack, name)}
        return cls(**{**declared, **changes})


AttackBuilder = Callable[[Any], Attack]
TraitsOf = Callable[[Any], AttackTraits]

ATTACKS: Registry[AttackBuilder] = Registry("attack")


def register_attack(
    name: str, params: type = NoParams, *, traits: TraitsOf
) -> Callable[[AttackBuilder], AttackBuilder]:
    """Register the decorated builder under ``name``; ``traits(params)`` declares what it attacks and needs."""
    return ATTACKS.register(name, params, traits)


def class_traits(attack: type) -> TraitsOf:
    """The ``traits`` of an attack whose class attributes declare them, whatever its parameters."""
    return lambda params: AttackTraits.of(attack)


def attack_traits(name: str, params: Any = None) -> AttackTraits:
    """The traits of the registered attack ``name`` with ``params`` (its defaults when None); nothing is built."""
    return ATTACKS.traits(name, params)


def build_attack(name: str, params: Any = None, defense: tuple[str, Any] | None = None) -> Attack:
    """The registered attack ``name`` configured with ``params``.

    ``defense`` (name, parameters) is the clients' defense, given to an attack that needs it (``needs`` holds
    'defense', e.g. IG with EOT) through its ``know_defense`` method; one that simulates it (EOT) needs a
    defense whose traits say it can be simulated."""
    attack = ATTACKS.build(name, params=params)
    if "defense" in attack.needs:
        if defense is None:
            raise ValueError(f"attack {name!r} needs the clients' defense, and none was given")
        from fedguard.defenses import build_defense
        from fedguard.defenses.base import defense_traits

        if attack_traits(name, params).simulates_defense and not defense_traits(*defense).simulated:
            raise ValueError(
                f"attack {name!r} simulates the clients' defense (EOT), and defense {defense[0]!r} "
                f"cannot be simulated (set its eot to 0)"
            )
        attack.know_defense(build_defense(*defense))
    return attack


def images_per_upload(obs: Observation) -> int:
    """How many images an upload came from: the declared batch (a gradient) or every example (weights)."""
    if obs.kind == "weights":
        return int(obs.num_examples)
    return obs.declared.batch(obs.num_examples)


DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("auto", "on", "off")
"""Whether a search's per-iteration functions are compiled (``attackers.engine.compiled``)."""


def check_search_params(iterations: int, restarts: int, lr: float, device: str, compile_mode: str = "auto") -> None:
    """The checks every optimization attack's parameters share; raises ``ValueError`` naming the bad value."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if restarts < 1:
        raise ValueError(f"restarts must be >= 1, got {restarts}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: choose one of {', '.join(DEVICES)}")
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile {compile_mode!r}: choose one of {', '.join(COMPILE_MODES)}")


LOCAL_SCHEDULE = ("lr", "local_epochs", "batch_size", "local_steps", "proximal_mu")
"""What a FedAvg client declares of its local training (``fedguard.wire.declared.Declared`` fields): uploads that agree
on it can be replayed together."""


def shape_key(obs: Observation) -> tuple[Any, ...]:
    """Observations with equal keys (model, data shape, image count, upload kind, local schedule) can be
    attacked as one batch."""
    declared = obs.declared
    schedule = tuple((name, getattr(declared, name)) for name in LOCAL_SCHEDULE) if obs.kind == "weights" else ()
    return (obs.model, tuple(sorted(obs.model_params.items())), obs.spec, images_per_upload(obs), obs.kind, schedule)


def required_manipulation(attack: Attack | AttackTraits) -> str:
    """The manipulation an attack (or its traits) exploits: 'none' for an honest-server attack."""
    return attack.manipulation


def missing_grants(attack: Attack | AttackTraits, granted: set[str], upload_kind: str = "gradient") -> list[str]:
    """What an attack (or its traits) needs on uploads of ``upload_kind`` that the threat model does not grant,
    for an error message.

    ``needs`` holds what it always needs; ``needs_by_upload`` maps an upload kind to more."""
    needs = attack.needs | attack.needs_by_upload.get(upload_kind, frozenset())
    return [f"{need} ({NEEDS[need]})" for need in sorted(needs - granted)]


class Chosen(Protocol):
    """A configured attack: its registered name and parameters (``fedguard.config.Component``)."""

    @property
    def name(self) -> str: ...

    @property
    def params(self) -> Any: ...


def missing_attack_files(attacks: Iterable[Chosen]) -> list[str]:
    """Each file the ``attacks`` load that is not there: its key, its path and how to make it."""
    return [
        f"attack.{attack.name}.{file.param.replace('_', '-')} = {file.path!r}: {file.missing}"
        for attack in attacks
        for file in attack_traits(attack.name, attack.params).files
        if file.path and not Path(file.path).exists()
    ]


def unusable_attack_files(attacks: Iterable[Chosen]) -> list[str]:
    """Each file the ``attacks`` load that is there but cannot be used: its key, its path and what is wrong."""
    return [
        f"attack.{attack.name}.{file.param.replace('_', '-')} = {file.path!r}: {problem}"
        for attack in attacks
        for file in attack_traits(attack.name, attack.params).files
        if file.path and (problem := file.unusable()) is not None
    ]


def check_attack_files(attacks: Iterable[Chosen]) -> None:
    """Raise ``TrainedFileError`` naming every file the ``attacks`` load that is missing (``MissingTrainedFile``,
    also a ``FileNotFoundError``, then) or cannot be used (corrupt, non-finite, another kind of file); the server
    and ``fedguard attack`` call it once before round 1 or the first attack (the clients, which never load these
    files, do not)."""
    attacks = list(attacks)
    refuse(missing_attack_files(attacks), unusable_attack_files(attacks), "the configured attacks")
