"""What ``fedguard run`` checks before a run starts, in whichever runtime runs it (a cold launch or a warm one).

This machine's resources and trackers, the attacks' and defense's files, the dataset, and a writable run
folder: each refused with a ``ConfigError`` (or the loader's own error) naming the bad value, before a round
runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from fedguard.config import Config, ConfigError, load_config
from fedguard.limits import writable_problem


def ready(config: Config, out: Path | None = None) -> tuple[Config, str]:
    """``config`` checked and set to write its run folder (``out``, else its ``out-dir`` or ``runs/<name>``,
    its own folder when it resumes); returns it and the line describing the federation."""
    from attackers.base import check_attack_files
    from fedguard.data import load_dataset
    from fedguard.defenses.base import check_defense_files
    from fedguard.runtime.simulation import resource_problems
    from fedguard.store.run_dir import resolve_run_dir
    from fedguard.tracking import tracker_problems

    if out is not None and not config.run.resume:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(out)))
    if problems := resource_problems(config) + tracker_problems(config):  # this machine's, before anything loads
        raise ConfigError(problems)
    check_attack_files(config.attacks)  # the simulated clients read this machine's files: check them all now
    data = load_dataset(config.data.name, config.data.source_options())
    check_defense_files(config.defense.name, config.defense.params, clients_here=True, spec=data.spec)
    folder = Path(config.run.out_dir) if config.run.resume else resolve_run_dir(config)
    if problem := writable_problem("--out", out) if out else writable_problem("out-dir", folder):
        raise ConfigError([problem])
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(folder)))
    line = (
        f"fedguard: {config.partition.num_clients} clients ({config.partition.name}) on {data.name} "
        f"({len(data.train)} train / {len(data.test)} test), model {config.model.name}, "
        f"{config.train.protocol} for {config.train.rounds} rounds, defense {config.defense.name}"
    )
    return config, line


RESUME_KEYS = ("train.rounds", "sim.", "pool.")
"""What ``--set`` may change when a run resumes: how many rounds in all, and resources; nothing that changes
what the rounds compute."""


def resumed(folder: Path, overrides: Sequence[str] = ()) -> Config:
    """The configuration of the run in ``folder`` (its ``config.toml`` with the allowed ``overrides``,
    ``RESUME_KEYS``), set to go on from its checkpoint (``fedguard run --resume``); ``ValueError`` saying why it
    cannot (``CheckpointError`` when it has no checkpoint)."""
    from fedguard.store.folder import CONFIG_FILE
    from fedguard.store.resume import resume_point

    folder = Path(folder).resolve()
    refused = [text for text in overrides if not text.partition("=")[0].strip().startswith(RESUME_KEYS)]
    if refused:
        raise ValueError(
            f"--resume: {', '.join(refused)} would change what the rounds compute; a resumed run may "
            f"only set {', '.join(k + '*' if k.endswith('.') else k for k in RESUME_KEYS)}"
        )
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"--resume {folder}: no {CONFIG_FILE} there; give the folder of a run")
    config = load_config(folder / CONFIG_FILE, list(overrides))
    resume_point(folder, config.train.rounds)
    return dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(folder), resume=True))


def machine_problems(runs: list[tuple[str, Config]]) -> list[str]:
    """What this machine lacks for any of the named ``runs``, each problem once with the first run it concerns;
    runs alike in what is checked (``sim.*``, ``track.*``, the attacks' devices) are checked once."""
    from fedguard.runtime.simulation import resource_problems
    from fedguard.tracking import tracker_problems

    problems: dict[str, str] = {}
    checked: set[str] = set()
    for label, config in runs:
        key = repr((config.sim, config.track, config.attack_devices()))
        if key in checked:
            continue
        checked.add(key)
        for problem in resource_problems(config) + tracker_problems(config):
            problems.setdefault(problem, label)
    return [f"{label}: {problem}" for problem, label in problems.items()]
