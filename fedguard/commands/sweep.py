"""Sweeps: one preset, several runs (settings x variants x seeds), one summary table.

A sweep preset is a run preset with a ``[sweep]`` table::

    [sweep]
    baseline = "none"                    # the variant whose accuracy is 100%
    seeds = [0, 1, 2]                    # optional: each cell once per seed (default: the preset's seed)
    [sweep.settings.privacy]             # overrides of one setting (flat or nested keys)
    kind = "diagnostic"                  # optional: 'diagnostic' (the default) or 'realistic'
    variants = ["none", "dp"]            # optional: the variants this setting runs (default: every one)
    "train.rounds" = 1
    [sweep.variants.none]
    "defense.name" = "none"
    [sweep.variants.dp]
    defense = { name = "dp", dp = { noise-multiplier = 0.01 } }

Every (setting, variant) pair is a cell, run once per seed: the preset's keys, then the setting's, then the
variant's, then the seed. All runs are validated before the first one starts. Each runs as its own Flower run
in ``<sweep folder>/<setting>/<variant>`` (``.../<variant>/seed-<n>`` when the preset declares ``seeds``), so a
run that fails is reported and the others go on; the runs join one Ray cluster started for the sweep where they
would each have started the same (``fedguard.runtime.ray_head``), and run one after another in one warm runner
on it (``fedguard.runtime.warm``: no process, SuperLink or Ray start per run), or each as its own ``fedguard
run`` process where they cannot share the cluster or ``warm`` is off. Every run is tied to the sweep's process
(``fedguard.runtime.lifeline``): a sweep that is killed takes its current run with it, recorded as
interrupted. A stopped sweep resumes when started again: a run that completed is kept, not run again; one that
was stopped is waited for until nothing writes its folder, then resumed from its last checkpoint (``fedguard
run --resume``), or, where it has none, set aside as ``<folder>.stopped-<k>`` and run again. ``runs.jsonl``
holds one row per run, ``sweep.jsonl`` one row per cell over its seeds (``summarize_runs``: means, the
``privacy`` object of ``fedguard.report.leakage``, accuracy with its interval over seeds; a failed run is
left out and counted in ``failed_seeds``) and ``summary.md`` a table per setting, a line per variant; a reproduction
preset's ``[sweep.paper]`` (``fedguard.report.paper_table``) adds the paper's numbers beside ours; runs whose
clients ran detectors add the detection table (``fedguard.report.detection``). Run logs
are read and the sweep's files written as ``fedguard.store.folder`` says: a torn last line of a run's log is
skipped with a warning, and every file appears whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from attackers.base import attack_traits
from fedguard.config import (
    Config,
    ConfigError,
    flatten,
    load_config,
    parse_override,
    parse_schedule,
    read_toml,
    resolve_paths,
)
from fedguard.report.detection import client_rounds, completed_runs, detected, detection_table, pooled_findings
from fedguard.report.invocation import INVOCATION_FILE, invocation, invocation_line
from fedguard.report.leakage import SUCCESS_SSIM, privacy
from fedguard.report.leakage_table import leakage_tables
from fedguard.report.paper_table import PaperTable, metric_value, parse_paper_table, render_paper_table
from fedguard.report.run_status import read_status
from fedguard.report.statistics import over_seeds
from fedguard.report.sweep_html import build_sweep_page
from fedguard.runtime import lifeline
from fedguard.runtime.ray_head import shared_ray
from fedguard.runtime.warm import WarmRuntime
from fedguard.store.checkpoint import CheckpointError, read_checkpoint
from fedguard.store.folder import (
    LOCK_FILE,
    RUNS_FILE,
    SUMMARY_FILE,
    SWEEP_FILE,
    write_atomic,
    write_jsonl,
)
from fedguard.store.invocations import own_rows
from fedguard.store.lock import wait_free
from fedguard.store.rows import AttackRow, RoundRow, read_attacks, read_rounds
from fedguard.store.run_dir import config_toml
from fedguard.tracking.mlflow_sweep import sweep_parent

SETTING_KINDS = ("diagnostic", "realistic")
"""What a setting is (EVALUATION.md, point 7): diagnostic finds worst cases (batch 1, untrained model, known
labels), realistic is training as deployed (FedAvg, local epochs, non-IID, larger batches). A setting is
diagnostic unless its preset says ``kind = "realistic"``."""


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its setting, variant, validated configuration (with the run's seed), folder and the
    setting's kind (``SETTING_KINDS``)."""

    setting: str
    variant: str
    config: Config
    folder: Path
    kind: str = SETTING_KINDS[0]

    @property
    def seed(self) -> int:
        return self.config.run.seed


@dataclass(frozen=True)
class Sweep:
    """The runs of a sweep preset (a cell's seeds one after the other), the variant the others' accuracy is
    compared to, and for a reproduction preset the paper's numbers to print beside ours."""

    name: str
    folder: Path
    baseline: str
    runs: tuple[SweepRun, ...]
    paper: PaperTable | None = None
    seeds: tuple[int, ...] | None = None  # the declared [sweep] seeds; None: each run has its configuration's
    invocation: dict[str, Any] = field(default_factory=dict)  # the preset and options (``invocation``); {}: unknown


VERDICT_IMAGES, VERDICT_SEEDS = 16, 3  # a cell scored on fewer images or seeds is not a verdict
UTILITY_HALF_WIDTH = 0.03
"""A setting whose baseline accuracy's 95 % interval over seeds reaches further than this either side of its mean
(3 points) cannot tell defenses apart by accuracy: the summary leaves its accuracy columns out and says why
(``sweep.jsonl`` keeps every cell's)."""


def _table(sweep: dict[str, Any], key: str, path: Path) -> dict[str, dict[str, Any]]:
    table = sweep.get(key, {})
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ConfigError([f"{path}: [sweep.{key}] must hold tables of overrides, one per {key[:-1]}"])
    return {name: flatten(overrides) for name, overrides in table.items()}


def _kinds(settings: dict[str, dict[str, Any]], path: Path) -> dict[str, str]:
    """Each setting's ``kind``, popped from its overrides (a reserved key, not a configuration key)."""
    kinds = {name: keys.pop("kind", SETTING_KINDS[0]) for name, keys in settings.items()}
    bad = [
        f"{path}: sweep.settings.{name}.kind = {kind!r}: choose {' or '.join(SETTING_KINDS)}"
        for name, kind in kinds.items()
        if kind not in SETTING_KINDS
    ]
    if bad:
        raise ConfigError(bad)
    return kinds


def _case_clashes(names: list[str], key: str, path: Path) -> list[str]:
    """A problem per group of ``[sweep.<key>]`` names that differ only in case: their run folders would be one
    folder on a case-insensitive file system."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.casefold(), []).append(name)
    return [
        f"{path}: {', '.join(f'[sweep.{key}.{n}]' for n in group[:-1])} and [sweep.{key}.{group[-1]}] differ only "
        "in case, so their run folders would be one folder on a case-insensitive file system (macOS, Windows); "
        "rename them so that they differ in more than case"
        for group in groups.values()
        if len(group) > 1
    ]


def _setting_variants(settings: dict[str, dict[str, Any]], variants: list[str], path: Path) -> dict[str, list[str]]:
    """Each setting's ``variants`` (every variant when it names none), popped from its overrides; ``ConfigError``
    for a name that is not a variant of the sweep or that the list repeats."""
    chosen = {name: keys.pop("variants", variants) for name, keys in settings.items()}
    bad = []
    for name, names in chosen.items():
        if not (
            isinstance(names, list) and names and all(isinstance(n, str) for n in names) and set(names) <= set(variants)
        ):
            bad.append(
                f"{path}: sweep.settings.{name}.variants = {names!r}: give a list of variants of this sweep "
                f"({', '.join(variants)})"
            )
        elif len(set(names)) < len(names):
            repeated = ", ".join(repr(v) for v in dict.fromkeys(names) if names.count(v) > 1)
            bad.append(
                f"{path}: sweep.settings.{name}.variants = {names!r} names {repeated} more than once; "
                "name each variant once"
            )
    if bad:
        raise ConfigError(bad)
    return chosen


def _seeds(
    sweep: dict[str, Any], keys: dict[str, dict[str, Any]], given: dict[str, Any], path: Path
) -> list[int] | None:
    """The declared ``[sweep] seeds`` (None when not declared); ``ConfigError`` for a list that is not distinct
    whole numbers >= 0, or for a setting, variant or ``--set`` that sets the seed the list sets."""
    if "seeds" not in sweep:
        return None
    seeds = sweep["seeds"]
    if not (
        isinstance(seeds, list)
        and seeds
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        and len(set(seeds)) == len(seeds)
    ):
        raise ConfigError(
            [f"{path}: sweep.seeds = {seeds!r}: give a list of distinct whole numbers >= 0, e.g. [0, 1, 2]"]
        )
    setters = [f"[sweep.{where}]" for where, overrides in keys.items() if "seed" in overrides]
    setters += ["--set seed"] if "seed" in given else []
    if setters:
        raise ConfigError(
            [
                f"{path}: sweep.seeds = {seeds} sets each run's seed; remove seed from "
                f"{', '.join(setters)} (or change sweep.seeds)"
            ]
        )
    return seeds


def load_sweep(
    preset: Path | str,
    out: Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    only: list[str] | tuple[str, ...] = (),
    seeds: list[int] | None = None,
) -> Sweep:
    """Read and validate every run of the sweep ``preset``; all problems of all runs are reported at once.

    ``overrides`` (``key=value``) apply to every run, after its setting's and variant's keys; ``only`` keeps the
    runs it names (``setting/variant``, or a variant in every setting), every seed of each; ``seeds`` replaces
    the preset's ``[sweep] seeds``. Relative paths, in the
    preset and in the overrides alike, are resolved against the current folder, as ``fedguard run`` resolves
    them."""
    path = Path(preset)
    if not path.is_file():
        raise ConfigError([f"sweep preset {str(path)!r} not found (presets live in experiments/)"])
    document = read_toml(path)
    sweep = document.pop("sweep", None)
    if not isinstance(sweep, dict):
        raise ConfigError([f"{path}: no [sweep] table; run a single experiment with `fedguard run {path}`"])
    unknown = sorted(set(sweep) - {"baseline", "seeds", "settings", "variants", "paper"})
    if unknown:
        raise ConfigError(
            [
                f"{path}: unknown key(s) in [sweep]: {', '.join(unknown)} "
                "(choose baseline, seeds, settings, variants, paper)"
            ]
        )
    if seeds is not None:
        sweep["seeds"] = seeds
    variants = _table(sweep, "variants", path)
    settings = _table(sweep, "settings", path) or {"run": {}}
    kinds = _kinds(settings, path)
    setting_variants = _setting_variants(settings, list(variants), path)
    if not variants:
        raise ConfigError([f"{path}: [sweep.variants] is empty; add one table of overrides per variant"])
    baseline = str(sweep.get("baseline", next(iter(variants))))
    if baseline not in variants:
        raise ConfigError([f"{path}: sweep.baseline = {baseline!r} is not one of the variants: {', '.join(variants)}"])
    base = flatten(document)
    name = str(base.get("name", path.stem))
    folder = (Path(out) if out is not None else Path(str(base.get("out-dir") or "runs")) / name).absolute()
    given = dict(parse_override(text) for text in overrides)
    run_seeds = _seeds(
        sweep,
        {**{f"settings.{k}": v for k, v in settings.items()}, **{f"variants.{k}": v for k, v in variants.items()}},
        given,
        path,
    )
    chosen = _chosen_runs(only, setting_variants, path)
    seed_choices: list[int] | list[None] = run_seeds or [None]
    problems = _case_clashes(list(settings), "settings", path) + _case_clashes(list(variants), "variants", path)
    runs = []
    for setting, setting_keys in settings.items():
        for variant, variant_keys in variants.items():
            if (setting, variant) not in chosen:
                continue
            flat = {**base, **setting_keys, **variant_keys, **given, "name": f"{name}-{setting}-{variant}"}
            for seed in seed_choices:
                keys, where = flat, folder / setting / variant
                if seed is not None:
                    keys, where = {**flat, "seed": seed}, where / f"seed-{seed}"
                try:
                    config = resolve_paths(Config.from_flat(keys), Path.cwd())
                except ConfigError as error:
                    problems += [f"{setting}/{variant}: {p}" for p in error.problems]
                    break
                runs.append(SweepRun(setting, variant, config, where, kinds[setting]))
    paper = None
    if "paper" in sweep:
        paper, paper_problems = parse_paper_table(
            sweep["paper"], {f"{s}/{v}" for s in settings for v in variants}, str(path)
        )
        problems += paper_problems
    if problems:
        raise ConfigError(problems)
    return Sweep(
        name,
        folder,
        baseline,
        tuple(runs),
        paper,
        None if run_seeds is None else tuple(run_seeds),
        invocation(path, only, seeds, overrides),
    )


def _chosen_runs(
    only: list[str] | tuple[str, ...], setting_variants: dict[str, list[str]], path: Path
) -> set[tuple[str, str]]:
    """The (setting, variant) pairs ``only`` names among those each setting runs (every one when ``only`` is
    empty); ``ConfigError`` for a name that is no setting/variant or variant of the sweep."""
    pairs = {(s, v) for s, names in setting_variants.items() for v in names}
    settings, variants = list(setting_variants), sorted({v for _, v in pairs})
    if not only:
        return pairs
    chosen: set[tuple[str, str]] = set()
    for name in only:
        setting, _, variant = name.rpartition("/")
        matched = {(s, v) for s, v in pairs if v == variant and setting in ("", s)}
        if not matched:
            raise ConfigError(
                [
                    f"--only {name!r}: {path} has no such run; choose a variant ({', '.join(variants)}) "
                    f"or setting/variant with a setting of {', '.join(settings)}"
                ]
            )
        chosen |= matched
    return chosen


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return sum(present) / len(present) if present else None


def finished(run: SweepRun) -> bool:
    """Whether ``run.folder`` holds a run that completed: its ``status.json`` says so (a run stopped after its
    last round, while attacking or reporting, did not) and its rounds log has every round."""
    status = read_status(run.folder)
    if status is None or status.get("status") != "completed":
        return False
    rounds = read_rounds(run.folder)
    return bool(rounds) and rounds[-1]["round"] == run.config.train.rounds


STOPPED_WAIT = 120.0  # seconds a sweep waits for the watcher of a run killed in a cell's folder to end it (<= 60 s)


def resumable_round(run: SweepRun) -> int | None:
    """The round a stopped, unfinished run in ``run.folder`` goes on after (its checkpoint's), or None when it
    starts again instead: it failed, finished no round, or finished every round (stopped while attacking)."""
    status = read_status(run.folder) or {}
    if status.get("status") == "failed":
        return None
    try:
        round_ = read_checkpoint(run.folder).round
    except CheckpointError:
        return None
    return round_ if 0 < round_ < run.config.train.rounds else None


def set_aside(run: SweepRun) -> Path:
    """Move the stopped run in ``run.folder`` (and its log) to ``<folder>.stopped-<k>``, the first ``k`` free, so
    that the cell starts again in an empty folder and nothing the stopped run wrote is lost; returns the new
    folder."""
    number = 1
    while (aside := run.folder.with_name(f"{run.folder.name}.stopped-{number}")).exists():
        number += 1
    run.folder.rename(aside)
    log = run.folder.with_suffix(".log")
    if log.is_file():
        log.rename(aside.with_suffix(".log"))
    return aside


def _holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` holds anything of a run (more than the lock a run takes first)."""
    return folder.is_dir() and any(entry.name != LOCK_FILE for entry in folder.iterdir())


def attack_scores(rows: list[AttackRow]) -> dict[str, Any]:
    """Means over one attack's scored rows: ``psnr``, ``ssim``, ``lpips``, ``floor_psnr``; counts of
    ``uploads``, ``images`` and ``leaked_images``."""
    scores: dict[str, Any] = {
        "psnr": _mean([a.get("psnr") for a in rows]),
        "ssim": _mean([a.get("ssim") for a in rows]),
        "lpips": _mean([a.get("lpips") for a in rows]),
    }
    scores["floor_psnr"] = _mean([(a.get("floor") or {}).get("psnr") for a in rows])
    scores["uploads"] = len(rows)
    scores["images"] = sum(len(a.get("per_image") or []) for a in rows)
    scores["leaked_images"] = sum(a.get("leaked_images", 0) for a in rows)
    return scores


def raw_uploads(runs: list[tuple[list[RoundRow], list[AttackRow]]]) -> dict[str, Any]:
    """How many uploads went out as the raw gradient (a defense's ``upload.raw`` report, e.g. CENSOR's
    Algorithm 1 fallback), over ``runs`` (each its trained rounds and its scored attack rows): ``raw_fraction``
    over every upload, and ``raw_attacked`` of ``attacked_uploads`` among the (round, client) uploads that attack
    rows scored. Empty when no upload reported it."""
    flags: dict[tuple[int, int | None, int | None], float] = {
        (index, r.get("round"), u.get("client")): u["raw"]
        for index, (rounds, _) in enumerate(runs)
        for r in rounds
        for u in r.get("uploads", [])
        if "raw" in u
    }
    if not flags:
        return {}
    targets = dict.fromkeys(
        (index, a.get("round"), a.get("client")) for index, (_, attacked) in enumerate(runs) for a in attacked
    )
    return {
        "raw_fraction": sum(flags.values()) / len(flags),
        "attacked_uploads": len(targets),
        "raw_attacked": sum(int(flags.get(t, 0) > 0) for t in targets),
    }


def failed_row(run: SweepRun, error: str, log: Path) -> dict[str, Any]:
    """The ``runs.jsonl`` row of a run that did not complete: ``status`` 'failed', the ``error`` that stopped
    it and its ``log``; no figure, so that no verdict is drawn from what it did before it stopped."""
    return {
        "setting": run.setting,
        "variant": run.variant,
        "seed": run.seed,
        "defense": run.config.defense.name,
        "status": "failed",
        "error": error,
        "log": str(log),
        "folder": str(run.folder),
        "accuracy": None,
        "setting_kind": run.kind,
        "threat": run.config.threat.model(),
    }


def failure_reason(run: SweepRun, code: int, log: Path) -> str:
    """Why the run in ``run.folder`` failed: its ``status.json``'s error, else the last line its ``fedguard run``
    printed (to ``log``), else its exit code (-1: it ran past the sweep's time limit)."""
    status = read_status(run.folder) or {}
    if status.get("error"):
        return str(status["error"])
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() else []
    if code == -1:
        return "it ran past the sweep's time limit"
    return lines[-1].strip() if lines else f"fedguard run exited with code {code}"


def _mean_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The defense reports of several seeds as one: numbers averaged, anything else the first seed's."""
    if len(reports) == 1:
        return reports[0]
    numbers = {
        key for key, value in reports[0].items() if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    return {key: _mean([r.get(key) for r in reports]) if key in numbers else value for key, value in reports[0].items()}


def summarize_runs(runs: list[SweepRun]) -> dict[str, Any]:
    """One row over the completed runs of a cell (its seeds; one run gives its ``runs.jsonl`` row).

    Means over the seeds: final ``accuracy`` (``accuracy_ci95``: the t interval over seeds), seconds per round,
    the defense's reports of the last round (``epsilon``: spent by the end, where the defense reports one).
    Pooled over the seeds: raw uploads, the share of dense bytes uploaded, scores per attack (``attacks``), and at
    the top level the strongest attack's (highest mean SSIM over every attacked round, the adaptive one on a
    tie; ``by_round``: its scores per round), as the means of per-upload means. ``privacy``: the image-level
    headline of ``fedguard.report.leakage.privacy`` (None where nothing was attacked); ``detected``: the
    manipulated client-rounds any of the clients' detectors flagged (``k``, ``n``, ``ci95``: the Wilson interval;
    None where no client checked a manipulated model); ``setting_kind``: the setting's; ``threat``: the server's
    threat model (``ThreatSection.model``)."""
    logs = [(run, read_rounds(run.folder), own_rows(read_attacks(run.folder))) for run in runs]
    trained = [[r for r in rounds if r["round"] > 0] for _, rounds, _ in logs]
    scored_by_run = [[a for a in attacks if a.get("status") == "ok"] for _, _, attacks in logs]
    scored = [a for rows in scored_by_run for a in rows]
    per_attack = {
        name: attack_scores([a for a in scored if a.get("attack") == name])
        for name in dict.fromkeys(str(a.get("attack")) for a in scored)
    }
    adaptive = {a.name: attack_traits(a.name, a.params).adaptive for a in runs[0].config.attacks}
    strongest = max(
        per_attack, key=lambda name: (per_attack[name]["ssim"] or 0.0, adaptive.get(name, False)), default=None
    )
    reports = [rounds[-1].get("defense", {}) if rounds else {} for rounds in trained]
    report = _mean_report(reports)
    by_round = {}
    if strongest:
        for round_ in sorted(
            {a["round"] for a in scored if a.get("attack") == strongest and isinstance(a.get("round"), int)}
        ):
            by_round[str(round_)] = attack_scores(
                [a for a in scored if a.get("attack") == strongest and a.get("round") == round_]
            )
    sizes = [(r["upload_bytes"], r["dense_bytes"]) for rounds in trained for r in rounds if r.get("dense_bytes")]
    accuracy = over_seeds([rounds[-1]["accuracy"] if rounds else None for _, rounds, _ in logs])
    seconds = [_mean([r["seconds"] for r in rounds[1:]] or [r["seconds"] for r in rounds]) for rounds in trained]
    folder = Path(os.path.commonpath([run.folder for run in runs]))
    caught = detected(
        [
            c
            for run, rounds, _ in logs
            for c in client_rounds(rounds, parse_schedule(run.config.threat.malicious), run.setting)
        ]
    )
    return {
        "setting": runs[0].setting,
        "variant": runs[0].variant,
        "defense": runs[0].config.defense.name,
        "status": "ok",
        "setting_kind": runs[0].kind,
        "threat": runs[0].config.threat.model(),
        "folder": str(folder),
        "seeds": [run.seed for run in runs],
        "rounds": len(trained[0]),
        "accuracy": accuracy.mean,
        "accuracy_ci95": accuracy.ci95,
        "seconds_per_round": _mean(seconds),
        "defense_report": report,
        "epsilon": report.get("epsilon"),
        **raw_uploads(list(zip(trained, scored_by_run))),
        "upload_share": sum(u for u, _ in sizes) / sum(d for _, d in sizes) if sizes else None,
        "attacks": per_attack,
        "by_round": by_round,
        "strongest_attack": strongest,
        **(per_attack[strongest] if strongest else {}),
        "privacy": privacy(scored, adaptive),
        "detected": None if caught is None else {"k": caught.k, "n": caught.n, "ci95": caught.ci95},
    }


def cell_row(runs: list[SweepRun], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``sweep.jsonl`` row of one cell from its runs and their ``runs.jsonl`` rows: ``summarize_runs`` over
    the completed ones, with ``failed_seeds``; a failed row (the errors per seed) when none completed."""
    completed = [run for run, row in zip(runs, rows) if row["status"] == "ok"]
    failed = [row for row in rows if row["status"] != "ok"]
    if completed:
        return {**summarize_runs(completed), "failed_seeds": [row["seed"] for row in failed]}
    error = failed[0]["error"] if len(failed) == 1 else "; ".join(f"seed {r['seed']}: {r['error']}" for r in failed)
    first = {key: value for key, value in failed[0].items() if key != "seed"}
    return {
        **first,
        "folder": os.path.commonpath([row["folder"] for row in failed]),
        "error": error,
        "seeds": [],
        "failed_seeds": [row["seed"] for row in failed],
    }


def cell_rows(runs: tuple[SweepRun, ...], rows: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """One ``cell_row`` per (setting, variant) of ``runs`` (with their ``runs.jsonl`` ``rows``, in order), with
    ``accuracy_share``: the accuracy over the ``baseline`` variant's in the same setting."""
    cells: dict[tuple[str, str], list[int]] = {}
    for index, run in enumerate(runs):
        cells.setdefault((run.setting, run.variant), []).append(index)
    result = [cell_row([runs[i] for i in indices], [rows[i] for i in indices]) for indices in cells.values()]
    by = {(r["setting"], r["variant"]): r for r in result}
    for row in result:
        row["baseline"] = baseline
        if row["status"] == "ok":
            row["accuracy_share"] = metric_value(row, "accuracy_share", by.get((row["setting"], baseline)))
    return result


def _cell(value: Any, digits: int, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _epsilon_cell(value: float | None) -> str:
    """Epsilon spent, plain below 1,000 and in powers of ten above (a noise baseline's 2e+06)."""
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 1000 else f"{value:.1e}"


def _raw_cell(row: dict[str, Any], attacked: bool) -> str:
    if "raw_fraction" not in row:
        return "-"
    if attacked:
        return f"{row['raw_attacked']} of {row['attacked_uploads']}"
    return f"{100 * row['raw_fraction']:.0f}%"


def _attack_cells(leak: dict[str, Any]) -> list[str]:
    """The headline attack (adaptive or not) with its round, images (x seeds; "not a verdict" below
    ``VERDICT_IMAGES`` images or ``VERDICT_SEEDS`` seeds), PSNR, SSIM with its interval, LPIPS and success
    rate."""
    attack = f"`{leak['attack']}`" + (" adaptive" if leak["adaptive"] else "") + f", round {leak['round']}"
    seeds = len(leak["seeds"])
    images = f"{leak['n_images']}" + (f" ({seeds} seeds)" if seeds > 1 else "")
    if leak["n_images"] < VERDICT_IMAGES or seeds < VERDICT_SEEDS:
        images += ", not a verdict"
    interval = leak["ssim_ci95"]
    ssim = "-" if interval is None else f"{leak['ssim_mean']:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"
    rate = leak["success_rate"]
    return [
        attack,
        images,
        _cell(leak["psnr_mean"], 1),
        ssim,
        _cell(leak["lpips_mean"], 3),
        _cell(None if rate is None else 100 * rate, 0, "%"),
    ]


def _detected_cell(caught: dict[str, Any] | None) -> str:
    """The manipulated client-rounds flagged: k of n (share)."""
    if not caught:
        return "-"
    return f"{caught['k']} of {caught['n']} ({100 * caught['k'] / caught['n']:.0f}%)"


def _accuracy_cell(row: dict[str, Any]) -> str:
    """Final accuracy in %, with its interval over seeds where there are several."""
    accuracy, interval = row.get("accuracy"), row.get("accuracy_ci95")
    if accuracy is None:
        return "-"
    if len(row.get("seeds") or []) < 2 or interval is None:
        return f"{100 * accuracy:.1f}%"
    return f"{100 * accuracy:.1f}% [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]"


def summary_table(rows: list[dict[str, Any]], baseline: str) -> str:
    """Markdown: one line per variant; per setting, where it attacked, the headline of ``privacy`` (the attack,
    marked adaptive where it is, and its round; images scored over how many seeds; mean PSNR; mean SSIM with its
    95 % interval; mean LPIPS; the share of images above SSIM ``SUCCESS_SSIM``), the manipulated client-rounds
    the clients' detectors flagged where a manipulation was checked, the final accuracy (with its
    interval over seeds where there are several, and as a percentage of the baseline variant's) where it trained
    for more than one round and the baseline's interval is no wider than ``UTILITY_HALF_WIDTH`` either side (a
    note under the table names each setting left out), the epsilon spent where a variant reports one, the raw
    uploads (of the attacked ones where the setting attacked, else the share of all) where a variant reports them,
    and the mean seconds per round."""
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["setting"], r["variant"]): r for r in rows}
    attacked = {s for s in settings if any(r.get("privacy") for r in rows if r["setting"] == s)}
    unsettled = unsettled_utility(rows, baseline)
    trained = {
        s for s in settings if s not in unsettled and any((r.get("rounds") or 0) > 1 for r in rows if r["setting"] == s)
    }
    private = {s for s in settings if any(r.get("epsilon") is not None for r in rows if r["setting"] == s)}
    raw = {s for s in settings if any("raw_fraction" in r for r in rows if r["setting"] == s)}
    checked = {s for s in settings if any(r.get("detected") for r in rows if r["setting"] == s)}
    header, rule = ["variant"], ["---"]

    def columns_of(setting: str) -> list[str]:
        return (
            (
                ["attack, round", "images", "PSNR (dB)", "SSIM [95% CI]", "LPIPS", f"SSIM > {SUCCESS_SSIM:g}"]
                if setting in attacked
                else []
            )
            + (["detected"] if setting in checked else [])
            + (["accuracy", "% of baseline"] if setting in trained else [])
            + (["epsilon"] if setting in private else [])
            + (["raw uploads"] if setting in raw else [])
            + ["s/round"]
        )

    for setting in settings:
        columns = columns_of(setting)
        header += [f"{setting}: {columns[0]}", *columns[1:]]
        rule += ["---" if column == "attack, round" else "---:" for column in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    for variant in variants:
        cells = [f"`{variant}`"]
        for setting in settings:
            row, base = by.get((setting, variant), {}), by.get((setting, baseline), {})
            if row.get("status") == "failed":
                width = len(columns_of(setting))
                cells += ["**failed**", *["-"] * (width - 1)]
                continue
            if setting in attacked:
                cells += _attack_cells(row["privacy"]) if row.get("privacy") else ["-"] * 6
            if setting in checked:
                cells.append(_detected_cell(row.get("detected")))
            if setting in trained:
                share = metric_value(row, "accuracy_share", base)
                cells += [_accuracy_cell(row), _cell(None if share is None else 100 * share, 1, "%")]
            if setting in private:
                cells.append(_epsilon_cell(row.get("epsilon")))
            if setting in raw:
                cells.append(_raw_cell(row, setting in attacked))
            cells.append(_cell(row.get("seconds_per_round"), 2))
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        f"- `{setting}`: accuracy left out: the `{baseline}` accuracy's 95 % interval over seeds is "
        f"+-{100 * width:.1f} points, wider than +-{100 * UTILITY_HALF_WIDTH:g}, so it cannot tell the defenses "
        "apart (sweep.jsonl keeps every cell's)"
        for setting, width in unsettled.items()
    ]
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def summary_tables(rows: list[dict[str, Any]], baseline: str) -> str:
    """Markdown: ``summary_table`` of each setting apart, under a line naming the setting, its kind and its threat
    model (the ``setting_kind`` and ``threat`` of its rows), so that each table says who attacked what."""
    blocks = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        own = [r for r in rows if r["setting"] == setting]
        blocks.append(f"{setting_title(setting, own)}\n\n{summary_table(own, baseline)}")
    return "\n".join(blocks)


def setting_title(setting: str, rows: list[dict[str, Any]]) -> str:
    """'Setting `realistic` (realistic; threat: honest):' from the setting's rows (a failed cell names neither)."""
    kinds = ", ".join(dict.fromkeys(r["setting_kind"] for r in rows if r.get("setting_kind")))
    threats = " / ".join(dict.fromkeys(r["threat"] for r in rows if r.get("threat")))
    named = "; ".join(part for part in (kinds, f"threat: {threats}" if threats else "") if part)
    return f"Setting `{setting}`" + (f" ({named})" if named else "") + ":"


def unsettled_utility(rows: list[dict[str, Any]], baseline: str) -> dict[str, float]:
    """The settings whose ``baseline`` row's accuracy interval over seeds is wider than ``UTILITY_HALF_WIDTH``
    either side, with its half-width (accuracy units)."""
    widths = {
        row["setting"]: (row["accuracy_ci95"][1] - row["accuracy_ci95"][0]) / 2
        for row in rows
        if row.get("variant") == baseline and row.get("accuracy_ci95") and len(row.get("seeds") or []) > 1
    }
    return {setting: width for setting, width in widths.items() if width > UTILITY_HALF_WIDTH}


def failures_note(rows: list[dict[str, Any]]) -> str:
    """Markdown lines naming each failed run (``runs.jsonl`` rows) and why it failed (empty when none did)."""
    failed = [r for r in rows if r.get("status") == "failed"]
    return "".join(
        f"\n- `{r['setting']}/{r['variant']}` seed {r['seed']} **failed**: {r['error']} (log {r['log']})"
        for r in failed
    ) + ("\n" if failed else "")


STOP_WAIT = 90.0  # seconds a stopped run gets to record its attacks and stop its processes (it takes 60 at most)


def run_one(
    command: list[str], log: Path, timeout: float | None, env: dict[str, str] | None = None, append: bool = False
) -> int:
    """Run one ``fedguard run`` in a session of its own, its output in ``log`` (after what it holds when
    ``append``), with ``env`` added to this process's environment, tied to this process
    (``fedguard.runtime.lifeline``: should this one die, the run is stopped and recorded as interrupted); its
    exit code, -1 when it ran past ``timeout``. A timeout or Ctrl-C reaches it as one SIGTERM or SIGINT and it
    gets ``STOP_WAIT`` seconds to stop cleanly (results and report kept, its processes ended); the Ctrl-C then
    goes on up."""
    environment = {**os.environ, **(env or {}), **lifeline.tied()}
    with (
        open(log, "a" if append else "w", encoding="utf-8") as handle,
        subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=environment,
        ) as process,
    ):
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop_run(process, signal.SIGTERM)
            return -1
        except KeyboardInterrupt:
            _stop_run(process, signal.SIGINT)
            raise


def _stop_run(process: subprocess.Popen[Any], signum: int) -> None:
    """Signal ``process`` once, wait ``STOP_WAIT`` seconds for it to stop, then kill it."""
    process.send_signal(signum)
    try:
        process.wait(STOP_WAIT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_sweep(
    sweep: Sweep,
    progress: Callable[[str], None] = print,
    timeout: float | None = None,
    share_ray: bool = True,
    warm: bool = True,
    runtime: WarmRuntime | None = None,
) -> list[dict[str, Any]]:
    """Run every run of ``sweep`` that is not finished yet on one Ray cluster where they can share it and
    ``share_ray`` (``fedguard.runtime.ray_head``): one after another in one warm runner
    (``fedguard.runtime.warm``) when ``warm``, else one ``fedguard run`` process each; in ``runtime`` when given
    (a warm runtime its caller keeps: its cluster must suit the runs, ``shared_cpus``), which is left running.
    Write ``runs.jsonl`` (a row per run), ``sweep.jsonl`` (a row per cell) and ``summary.md``; returns the cells'
    rows."""
    sweep.folder.mkdir(parents=True, exist_ok=True)
    if sweep.invocation:
        write_atomic(sweep.folder / INVOCATION_FILE, json.dumps(sweep.invocation, indent=1) + "\n")
    seeded = sweep.seeds is not None
    pending = [run.config for run in sweep.runs if not finished(run)] if share_ray else []
    rows = []
    tracked = [run.config for run in sweep.runs]
    with (
        _runtime(pending, progress, warm, runtime) as (ray_env, runtime),
        sweep_parent(sweep.name, sweep.folder, tracked) as nest,
    ):
        for index, run in enumerate(sweep.runs, 1):
            label = f"[{index}/{len(sweep.runs)}] {run.setting}/{run.variant}" + (f" seed {run.seed}" if seeded else "")
            if finished(run):
                progress(f"fedguard: {label}: finished earlier, kept ({run.folder})")
                rows.append({**summarize_runs([run]), "seed": run.seed})
                continue
            rows.append(_run_once(replace(run, config=nest(run.config)), label, timeout, ray_env, progress, runtime))
    write_jsonl(sweep.folder / RUNS_FILE, rows)
    cells = cell_rows(sweep.runs, rows, sweep.baseline)
    write_jsonl(sweep.folder / SWEEP_FILE, cells)
    head = invocation_line(sweep.invocation) + "\n" if sweep.invocation else ""
    summary = head + summary_tables(cells, sweep.baseline) + failures_note(rows)
    leakage = leakage_tables(cells)
    if leakage:
        summary += "\n" + leakage
    detection = detection_table(*pooled_findings(completed_runs(rows)))
    if detection:
        summary += "\n" + detection
    if sweep.paper is not None:
        summary += "\n" + render_paper_table(sweep.paper, cells, sweep.baseline)
    write_atomic(sweep.folder / SUMMARY_FILE, summary)
    build_sweep_page(sweep.folder, sweep.baseline)
    return cells


@contextlib.contextmanager
def _runtime(
    pending: list[Config], progress: Callable[[str], None], warm: bool, given: WarmRuntime | None
) -> Iterator[tuple[dict[str, str], WarmRuntime | None]]:
    """The environment that joins the sweep's Ray cluster and the warm runtime its runs run in (None: each its own
    ``fedguard run``): ``given``, left running; else a cluster for ``pending`` (``shared_ray``) with a runtime on it
    when ``warm``, both stopped at the end."""
    if given is not None:
        yield {"RAY_ADDRESS": str(given.address)}, given
        return
    with shared_ray(pending, progress) as ray_env:
        if not (warm and ray_env):
            yield ray_env, None
            return
        with WarmRuntime(0, address=ray_env["RAY_ADDRESS"]) as runtime:
            yield ray_env, runtime


def _run_once(
    run: SweepRun,
    label: str,
    timeout: float | None,
    env: dict[str, str],
    progress: Callable[[str], None],
    runtime: WarmRuntime | None = None,
) -> dict[str, Any]:
    """Run ``run`` in ``runtime``, else as its own ``fedguard run`` (``env`` added to its environment); its
    ``runs.jsonl`` row. A run an earlier sweep left unfinished in the folder (killed, or stopped) is waited for
    until nothing writes it, then resumed from its checkpoint (``resumable_round``), else set aside
    (``set_aside``) and run again."""
    preset, log = run.folder.with_suffix(".toml"), run.folder.with_suffix(".log")
    resume = False
    if _holds_a_run(run.folder):
        if not wait_free(run.folder, STOPPED_WAIT):
            return failed_row(run, f"{run.folder} is still written by another process after {STOPPED_WAIT:.0f} s", log)
        after = resumable_round(run)
        if after is None:
            progress(f"fedguard: {label}: an unfinished run was in its folder; moved to {set_aside(run)}, run again")
        else:
            progress(f"fedguard: {label}: stopped after round {after} of {run.config.train.rounds}; resuming it")
            resume = True
    run.folder.mkdir(parents=True, exist_ok=True)
    write_atomic(preset, config_toml(run.config))
    progress(f"fedguard: {label}: defense {run.config.defense.name}, {run.config.train.rounds} rounds -> {run.folder}")
    if runtime is not None:
        code = runtime.run(run.config, run.folder, log, timeout, resume=resume)
    else:
        plan = run.folder.with_suffix(".plan.json")  # the sweep validated it: the run rebuilds it from its plan
        write_atomic(plan, run.config.plan())
        where = ["--resume", str(run.folder)] if resume else ["--plan", str(plan), "--out", str(run.folder)]
        code = run_one([sys.executable, "-m", "fedguard", "run", *where], log, timeout, env, append=resume)
    if code != 0:
        failed = failed_row(run, failure_reason(run, code, log), log)
        progress(f"fedguard: {label}: failed: {failed['error']} (log {log})")
        return failed
    row = {**summarize_runs([run]), "seed": run.seed}
    scores = f"PSNR {row['psnr']:.1f} dB, " if row.get("psnr") is not None else ""
    accuracy = f"accuracy {100 * row['accuracy']:.1f}%" if row["accuracy"] is not None else "no round finished"
    progress(f"fedguard: {label}: ok; {scores}{accuracy}")
    return row


def load_preset(preset: Path | str) -> Config | Sweep:
    """A sweep preset's ``Sweep``, or a plain preset's ``Config``: what ``fedguard`` would run."""
    document = read_toml(Path(preset))
    return load_sweep(preset) if "sweep" in document else load_config(preset)
