"""Re-running attacks on saved observations, without the federation: ``fedguard attack``."""

from __future__ import annotations

import time
import traceback
from itertools import groupby
from pathlib import Path
from typing import Any, Callable

from attackers.base import ATTACKS, AttackOutcome, build_attack, check_attack_files, required_manipulation, shape_key
from fedguard.config import Config, ConfigError, load_config
from fedguard.evaluation import Evaluator, attack_contexts, describe_row
from fedguard.observation import Observation, load_observations
from fedguard.report.html import build_report
from fedguard.report.run_dir import CONFIG_FILE, OBSERVATIONS_DIR


def locate(capture_dir: Path) -> tuple[Path, Path]:
    """(run folder, observations folder) for a run folder or its ``observations`` folder."""
    capture_dir = Path(capture_dir)
    if (capture_dir / OBSERVATIONS_DIR).is_dir():
        return capture_dir, capture_dir / OBSERVATIONS_DIR
    if capture_dir.is_dir() and any(capture_dir.glob("round-*_client-*.npz")):
        return capture_dir.parent, capture_dir
    raise FileNotFoundError(f"{capture_dir} holds no captured observations (round-*_client-*.npz, or observations/)")


def offline_config(run_dir: Path, overrides: list[str]) -> Config:
    """The run's own configuration (if saved) with ``overrides``; at least one attack must be chosen."""
    preset = run_dir / CONFIG_FILE
    config = load_config(preset if preset.is_file() else None, overrides)
    if not config.attacks:
        raise ConfigError([f"attack.name = 'none': choose attacks, e.g. --set attack.name=ig,dlg "
                           f"(choices: {', '.join(ATTACKS.names())})"])
    return config


def attack_capture(
    capture_dir: Path, overrides: list[str], progress: Callable[[str], None] = print
) -> tuple[Path, list[dict[str, Any]]]:
    """Run every configured attack on the saved observations it applies to (those computed under the
    manipulation it exploits), score against the run's vault, append to its ``attacks.jsonl``, rebuild its
    report. Returns (run folder, new rows)."""
    run_dir, folder = locate(capture_dir)
    config = offline_config(run_dir, overrides)
    check_attack_files(config.attacks)  # every missing generator or denoiser named before any attack runs
    observations = load_observations(folder)
    evaluator = Evaluator(run_dir, attack_contexts(config, source="offline"))
    rows = []
    for component in config.attacks:
        attack = build_attack(component.name, component.params, (config.defense.name, config.defense.params))
        targets = [o for o in observations if o.manipulation == required_manipulation(attack)]
        progress(f"fedguard: {component.name} on {len(targets)} of {len(observations)} observations from {folder}")
        ordered = sorted(targets, key=lambda o: (repr(shape_key(o)), o.round, o.client))
        for _, same_shape in groupby(ordered, key=lambda o: repr(shape_key(o))):
            batch = list(same_shape)
            for start in range(0, len(batch), config.pool.group):
                rows += _attack_group(component.name, attack, batch[start : start + config.pool.group], evaluator,
                                      config.run.seed, progress)
    progress(f"fedguard: rows appended to {run_dir / 'attacks.jsonl'}; report {build_report(run_dir)}")
    return run_dir, rows


def _attack_group(name: str, attack: Any, group: list[Observation], evaluator: Evaluator, seed: int,
                  progress: Callable[[str], None]) -> list[dict[str, Any]]:
    start = time.perf_counter()
    try:
        recons = attack.reconstruct_many(group, seed)
        outcomes = [AttackOutcome(obs, "ok", rec, attack=name) for obs, rec in zip(group, recons)]
    except Exception as error:
        message = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"
        outcomes = [AttackOutcome(obs, "error", error=message[-2000:], attack=name) for obs in group]
    share = (time.perf_counter() - start) / len(group)
    rows = []
    for outcome in outcomes:
        outcome.seconds = share
        row = evaluator(outcome)
        rows.append(row)
        progress(f"  {describe_row(row)}")
    return rows
