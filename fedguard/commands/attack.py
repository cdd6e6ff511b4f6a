"""Re-running attacks on saved observations, without the federation: ``fedguard attack``.

Observations are untrusted files (``fedguard.store.observations``): one that cannot be read or does not fit the
run (a truncated or foreign file, a header or member size beyond the model's, a field of the wrong type, a
symbolic link) is named with the reason and skipped; the others are attacked, and the count of skipped ones is
said at the end. The attacks run on the attack runner the live run uses (``attackers.runner``), with one
worker in this process (``LocalWorkers``): the same batching, and the same retry of a batch that raised.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attackers.base import ATTACKS, AttackOutcome, check_attack_files, shape_key
from attackers.runner import AttackRunner, LocalWorkers, attack_specs
from fedguard.absent_plugins import without_absent_plugins
from fedguard.config import Component, Config, ConfigError, load_config, read_preset
from fedguard.evaluation import Evaluator, attack_contexts, describe_row, status_counts
from fedguard.observation import Observation
from fedguard.report.html import build_report
from fedguard.store.folder import ATTACKS_FILE, CONFIG_FILE, OBSERVATIONS_DIR, UPLOAD_GLOB
from fedguard.store.invocations import next_invocation
from fedguard.store.observations import ObservationRefused, RunExpectations, read_observation
from fedguard.store.rows import read_attacks


def describe(attack: Component) -> str:
    """``name key=value, ...``: an attack and the parameters it runs with."""
    params = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(attack.params).items())
    return f"{attack.name} {params}".strip()


def locate(capture_dir: Path) -> tuple[Path, Path]:
    """(run folder, observations folder) for a run folder or its ``observations`` folder."""
    capture_dir = Path(capture_dir)
    if (capture_dir / OBSERVATIONS_DIR).is_dir():
        return capture_dir, capture_dir / OBSERVATIONS_DIR
    if capture_dir.is_dir() and any(capture_dir.glob(UPLOAD_GLOB)):
        return capture_dir.parent, capture_dir
    raise FileNotFoundError(f"{capture_dir} holds no captured observations ({UPLOAD_GLOB}, or {OBSERVATIONS_DIR}/)")


def offline_config(run_dir: Path, overrides: list[str], progress: Callable[[str], None] = print) -> Config:
    """The run's own configuration (if saved) with ``overrides``; at least one attack must be chosen. The
    components of plugins that cannot be imported here are left out, each said through ``progress``
    (``fedguard.absent_plugins``)."""
    preset = run_dir / CONFIG_FILE
    recorded: dict[str, Any] = {}
    if preset.is_file():
        recorded, notes = without_absent_plugins(read_preset(preset))
        for note in notes:
            progress(f"fedguard: {note}")
    config = load_config(None, overrides, keys=recorded)
    if not config.attacks:
        raise ConfigError(
            [
                f"attack.name = 'none': choose attacks, e.g. --set attack.name=ig,dlg "
                f"(choices: {', '.join(ATTACKS.names())})"
            ]
        )
    return config


def readable_observations(
    folder: Path, run_dir: Path, expected: RunExpectations, progress: Callable[[str], None]
) -> tuple[list[Observation], int]:
    """(every observation in ``folder``, of the run in ``run_dir``, that fits ``expected``, how many did not);
    each one skipped is named with its reason through ``progress``."""
    observations, skipped = [], 0
    for path in sorted(folder.glob(UPLOAD_GLOB)):
        try:
            observations.append(read_observation(path, run_dir, expected))
        except ObservationRefused as refused:
            skipped += 1
            progress(f"fedguard: skipped {refused}")
    return observations, skipped


def attack_capture(
    capture_dir: Path, overrides: list[str], progress: Callable[[str], None] = print
) -> tuple[Path, list[dict[str, Any]]]:
    """Run every configured attack on the saved observations it applies to (those computed under the
    manipulation it exploits), score against the run's vault, append to its ``attacks.jsonl`` (each row with this
    invocation's id, ``attack-<n>``: ``fedguard.store.invocations``), rebuild its report. Observations that cannot
    be read or do not fit the run are skipped, each named. Returns (run folder, new rows)."""
    run_dir, folder = locate(capture_dir)
    config = offline_config(run_dir, overrides, progress)
    check_attack_files(config.attacks)  # every missing generator or denoiser named before any attack runs
    observations, skipped = readable_observations(folder, run_dir, RunExpectations.of(config), progress)
    invocation = next_invocation(read_attacks(run_dir))
    progress(f"fedguard: invocation {invocation} ({', '.join(describe(c) for c in config.attacks)})")
    evaluator = Evaluator(run_dir, attack_contexts(config, source="offline", invocation=invocation))
    specs = attack_specs(config.attacks, (config.defense.name, config.defense.params))
    for spec in specs:
        targets = sum(o.manipulation == spec.manipulation for o in observations)
        progress(f"fedguard: {spec.name} on {targets} of {len(observations)} observations from {folder}")
    rows = []

    def score(outcome: AttackOutcome) -> None:
        rows.append(evaluator(outcome))
        progress(f"  {describe_row(rows[-1])}")

    runner = AttackRunner(specs, score, LocalWorkers(), math.inf, config.pool.group, config.run.seed, poll_seconds=0.01)
    with runner.held():  # grouped as one batch, whatever the order they come in
        for obs in sorted(observations, key=lambda o: (repr(shape_key(o)), o.round, o.client)):
            runner.submit(obs)
    runner.close()
    if skipped:
        progress(
            f"fedguard: {skipped} observation{'s' if skipped != 1 else ''} of {skipped + len(observations)} "
            "skipped (unreadable, or not of this run)"
        )
    progress(
        f"fedguard: {len(rows)} rows ({status_counts(rows)}) appended to {run_dir / ATTACKS_FILE}; "
        f"report {build_report(run_dir)}"
    )
    return run_dir, rows
