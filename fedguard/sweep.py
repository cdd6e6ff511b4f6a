"""Sweeps: one preset, several runs (settings x variants), one summary table.

A sweep preset is a run preset with a ``[sweep]`` table::

    [sweep]
    baseline = "none"                    # the variant whose accuracy is 100%
    [sweep.settings.privacy]             # overrides of one setting (flat or nested keys)
    "train.rounds" = 1
    [sweep.variants.none]
    "defense.name" = "none"
    [sweep.variants.dp]
    defense = { name = "dp", dp = { noise-multiplier = 0.01 } }

Every (setting, variant) pair is one run: the preset's keys, then the setting's, then the variant's.
All runs are validated before the first one starts. Each runs as its own ``fedguard run`` process in
``<sweep folder>/<setting>/<variant>``, so a run that fails is reported and the others go on; a run
folder that already holds ``rounds.jsonl`` with every round is kept, not run again (a stopped sweep
resumes). ``sweep.jsonl`` holds one row per run and ``summary.md`` the table per variant; a reproduction
preset's ``[sweep.paper]`` (``fedguard.report.paper_table``) adds the paper's numbers beside ours. Run logs
are read and the sweep's files written as ``fedguard.run_folder`` says: a torn last line of a run's log is
skipped with a warning, and every file appears whole.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import tomli_w

from fedguard.config import Config, ConfigError, flatten, load_config, parse_override, read_toml, resolve_paths
from fedguard.report.paper_table import PaperTable, metric_value, parse_paper_table, render_paper_table
from fedguard.report.run_dir import unflatten
from fedguard.report.run_status import read_status
from fedguard.run_folder import ATTACKS_FILE, ROUNDS_FILE, SUMMARY_FILE, SWEEP_FILE, read_jsonl, write_atomic, write_jsonl


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its setting, variant, validated configuration and folder."""

    setting: str
    variant: str
    config: Config
    folder: Path


@dataclass(frozen=True)
class Sweep:
    """The runs of a sweep preset, the variant the others' accuracy is compared to, and for a reproduction
    preset the paper's numbers to print beside ours."""

    name: str
    folder: Path
    baseline: str
    runs: tuple[SweepRun, ...]
    paper: PaperTable | None = None


def _table(sweep: dict[str, Any], key: str, path: Path) -> dict[str, dict[str, Any]]:
    table = sweep.get(key, {})
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ConfigError([f"{path}: [sweep.{key}] must hold tables of overrides, one per {key[:-1]}"])
    return {name: flatten(overrides) for name, overrides in table.items()}


def load_sweep(preset: Path | str, out: Path | None = None, overrides: list[str] | tuple[str, ...] = (),
               only: list[str] | tuple[str, ...] = ()) -> Sweep:
    """Read and validate every run of the sweep ``preset``; all problems of all runs are reported at once.

    ``overrides`` (``key=value``) apply to every run, after its setting's and variant's keys; ``only`` keeps the
    runs it names (``setting/variant``, or a variant in every setting). Relative paths, in the preset and in the
    overrides alike, are resolved against the current folder, as ``fedguard run`` resolves them."""
    path = Path(preset)
    if not path.is_file():
        raise ConfigError([f"sweep preset {str(path)!r} not found (presets live in experiments/)"])
    document = read_toml(path)
    sweep = document.pop("sweep", None)
    if not isinstance(sweep, dict):
        raise ConfigError([f"{path}: no [sweep] table; run a single experiment with `fedguard run {path}`"])
    unknown = sorted(set(sweep) - {"baseline", "settings", "variants", "paper"})
    if unknown:
        raise ConfigError([f"{path}: unknown key(s) in [sweep]: {', '.join(unknown)} "
                           "(choose baseline, settings, variants, paper)"])
    variants = _table(sweep, "variants", path)
    settings = _table(sweep, "settings", path) or {"run": {}}
    if not variants:
        raise ConfigError([f"{path}: [sweep.variants] is empty; add one table of overrides per variant"])
    baseline = str(sweep.get("baseline", next(iter(variants))))
    if baseline not in variants:
        raise ConfigError([f"{path}: sweep.baseline = {baseline!r} is not one of the variants: {', '.join(variants)}"])
    base = flatten(document)
    name = str(base.get("name", path.stem))
    folder = (Path(out) if out is not None else Path(str(base.get("out-dir") or "runs")) / name).absolute()
    given = dict(parse_override(text) for text in overrides)
    chosen = _chosen_runs(only, list(settings), list(variants), path)
    runs, problems = [], []
    for setting, setting_keys in settings.items():
        for variant, variant_keys in variants.items():
            if (setting, variant) not in chosen:
                continue
            flat = {**base, **setting_keys, **variant_keys, **given, "name": f"{name}-{setting}-{variant}"}
            try:
                config = resolve_paths(Config.from_flat(flat), Path.cwd())
            except ConfigError as error:
                problems += [f"{setting}/{variant}: {p}" for p in error.problems]
                continue
            runs.append(SweepRun(setting, variant, config, folder / setting / variant))
    paper = None
    if "paper" in sweep:
        paper, paper_problems = parse_paper_table(sweep["paper"], {f"{s}/{v}" for s in settings for v in variants}, str(path))
        problems += paper_problems
    if problems:
        raise ConfigError(problems)
    return Sweep(name, folder, baseline, tuple(runs), paper)


def _chosen_runs(only: list[str] | tuple[str, ...], settings: list[str], variants: list[str],
                 path: Path) -> set[tuple[str, str]]:
    """The (setting, variant) pairs ``only`` names (every pair when empty); ``ConfigError`` for a name that is
    no setting/variant or variant of the sweep."""
    pairs = {(s, v) for s in settings for v in variants}
    if not only:
        return pairs
    chosen: set[tuple[str, str]] = set()
    for name in only:
        setting, _, variant = name.rpartition("/")
        matched = {(s, v) for s, v in pairs if v == variant and setting in ("", s)}
        if not matched:
            raise ConfigError([f"--only {name!r}: {path} has no such run; choose a variant ({', '.join(variants)}) "
                               f"or setting/variant with a setting of {', '.join(settings)}"])
        chosen |= matched
    return chosen


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return sum(present) / len(present) if present else None


def finished(run: SweepRun) -> bool:
    """Whether ``run.folder`` holds a rounds log with every round."""
    rounds = read_jsonl(run.folder / ROUNDS_FILE)
    return bool(rounds) and rounds[-1]["round"] == run.config.train.rounds


def attack_scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over one attack's scored rows: ``psnr``, ``ssim``, ``lpips``, ``floor_psnr``; counts of
    ``uploads``, ``images`` and ``leaked_images``."""
    scores: dict[str, Any] = {key: _mean([a.get(key) for a in rows]) for key in ("psnr", "ssim", "lpips")}
    scores["floor_psnr"] = _mean([(a.get("floor") or {}).get("psnr") for a in rows])
    scores["uploads"] = len(rows)
    scores["images"] = sum(len(a.get("per_image") or []) for a in rows)
    scores["leaked_images"] = sum(a.get("leaked_images", 0) for a in rows)
    return scores


def raw_uploads(rounds: list[dict[str, Any]], attacked: list[dict[str, Any]]) -> dict[str, Any]:
    """How many uploads went out as the raw gradient (a defense's ``upload.raw`` report, e.g. CENSOR's
    Algorithm 1 fallback): ``raw_fraction`` over every upload of the run, and ``raw_attacked`` of
    ``attacked_uploads`` among the (round, client) uploads that attack rows scored. Empty when no upload
    reported it."""
    flags = {(r["round"], u.get("client")): u["raw"] for r in rounds for u in r.get("uploads", []) if "raw" in u}
    if not flags:
        return {}
    targets = dict.fromkeys((a.get("round"), a.get("client")) for a in attacked)
    return {"raw_fraction": sum(flags.values()) / len(flags), "attacked_uploads": len(targets),
            "raw_attacked": sum(int(flags.get(t, 0) > 0) for t in targets)}


def failed_row(run: SweepRun, error: str, log: Path) -> dict[str, Any]:
    """The ``sweep.jsonl`` row of a run that did not complete: ``status`` 'failed', the ``error`` that stopped
    it and its ``log``; no figure, so that no verdict is drawn from what it did before it stopped."""
    return {"setting": run.setting, "variant": run.variant, "defense": run.config.defense.name, "status": "failed",
            "error": error, "log": str(log), "folder": str(run.folder), "accuracy": None}


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


def summarize_run(run: SweepRun, status: str) -> dict[str, Any]:
    """One ``sweep.jsonl`` row of a completed run: final accuracy, mean round time, defense reports (the epsilon
    spent by the end, where the defense reports one), raw uploads, scores per attack, and the strongest attack's
    (highest mean SSIM) scores at the top level, since a defense is as good as it is against the best attack."""
    rounds = read_jsonl(run.folder / ROUNDS_FILE)
    scored = [a for a in read_jsonl(run.folder / ATTACKS_FILE) if a.get("status") == "ok"]
    trained = [r for r in rounds if r["round"] > 0]
    per_attack = {name: attack_scores([a for a in scored if a.get("attack") == name])
                  for name in dict.fromkeys(str(a.get("attack")) for a in scored)}
    strongest = max(per_attack, key=lambda name: per_attack[name]["ssim"] or 0.0, default=None)
    report = trained[-1].get("defense", {}) if trained else {}
    by_round = {}
    if strongest:
        for round_ in sorted({a["round"] for a in scored if a.get("attack") == strongest and isinstance(a.get("round"), int)}):
            by_round[str(round_)] = attack_scores([a for a in scored if a.get("attack") == strongest
                                                   and a.get("round") == round_])
    sizes = [(r["upload_bytes"], r["dense_bytes"]) for r in trained if r.get("dense_bytes")]
    return {
        "setting": run.setting, "variant": run.variant, "defense": run.config.defense.name, "status": status,
        "folder": str(run.folder), "rounds": len(trained),
        "accuracy": rounds[-1]["accuracy"] if rounds else None,
        "seconds_per_round": _mean([r["seconds"] for r in trained[1:]] or [r["seconds"] for r in trained]),
        "defense_report": report,
        "epsilon": report.get("epsilon"),
        **raw_uploads(trained, scored),
        "upload_share": sum(u for u, _ in sizes) / sum(d for _, d in sizes) if sizes else None,
        "attacks": per_attack,
        "by_round": by_round,
        "strongest_attack": strongest,
        **(per_attack[strongest] if strongest else {}),
    }


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


def summary_table(rows: list[dict[str, Any]], baseline: str) -> str:
    """Markdown: one line per variant; per setting, the strongest attack's scores where the setting attacked,
    the final accuracy (also as a percentage of the baseline variant's) where it trained for more than one
    round, the epsilon spent where a variant reports one, the raw uploads (of the attacked ones where the
    setting attacked, else the share of all) where a variant reports them, and the mean seconds per round."""
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["setting"], r["variant"]): r for r in rows}
    attacked = {s for s in settings if any(r.get("images") for r in rows if r["setting"] == s)}
    trained = {s for s in settings if any((r.get("rounds") or 0) > 1 for r in rows if r["setting"] == s)}
    private = {s for s in settings if any(r.get("epsilon") is not None for r in rows if r["setting"] == s)}
    raw = {s for s in settings if any("raw_fraction" in r for r in rows if r["setting"] == s)}
    header, rule = ["variant"], ["---"]

    def columns_of(setting: str) -> list[str]:
        return (["strongest attack", "PSNR (dB)", "SSIM", "LPIPS", "SSIM > 0.9"] if setting in attacked else []) + (
            ["accuracy", "% of baseline"] if setting in trained else []) + (
            ["epsilon"] if setting in private else []) + (["raw uploads"] if setting in raw else []) + ["s/round"]

    for setting in settings:
        columns = columns_of(setting)
        header += [f"{setting}: {columns[0]}", *columns[1:]]
        rule += ["---" if column == "strongest attack" else "---:" for column in columns]
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
                attack = row.get("strongest_attack")
                leaked = f"{row['leaked_images']} of {row['images']}" if row.get("images") else "-"
                cells += [f"`{attack}`" if attack else "-", _cell(row.get("psnr"), 1), _cell(row.get("ssim"), 3),
                          _cell(row.get("lpips"), 3), leaked]
            if setting in trained:
                accuracy, share = row.get("accuracy"), metric_value(row, "accuracy_share", base)
                cells += [_cell(None if accuracy is None else 100 * accuracy, 1, "%"),
                          _cell(None if share is None else 100 * share, 1, "%")]
            if setting in private:
                cells.append(_epsilon_cell(row.get("epsilon")))
            if setting in raw:
                cells.append(_raw_cell(row, setting in attacked))
            cells.append(_cell(row.get("seconds_per_round"), 2))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def failures_note(rows: list[dict[str, Any]]) -> str:
    """Markdown lines naming each failed run and why it failed (empty when none did)."""
    failed = [r for r in rows if r.get("status") == "failed"]
    return "".join(f"\n- `{r['setting']}/{r['variant']}` **failed**: {r['error']} (log {r['log']})" for r in failed) \
        + ("\n" if failed else "")


STOP_WAIT = 90.0  # seconds a stopped run gets to record its attacks and stop its processes (it takes 60 at most)


def run_one(command: list[str], log: Path, timeout: float | None) -> int:
    """Run one ``fedguard run`` in a session of its own, its output in ``log``; its exit code, -1 when it ran past
    ``timeout``. A timeout or Ctrl-C reaches it as one SIGTERM or SIGINT and it gets ``STOP_WAIT`` seconds to stop
    cleanly (results and report kept, its processes ended); the Ctrl-C then goes on up."""
    with open(log, "w", encoding="utf-8") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop_run(process, signal.SIGTERM)
            return -1
        except KeyboardInterrupt:
            _stop_run(process, signal.SIGINT)
            raise


def _stop_run(process: subprocess.Popen, signum: int) -> None:
    """Signal ``process`` once, wait ``STOP_WAIT`` seconds for it to stop, then kill it."""
    process.send_signal(signum)
    try:
        process.wait(STOP_WAIT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_sweep(sweep: Sweep, progress: Callable[[str], None] = print, timeout: float | None = None) -> list[dict[str, Any]]:
    """Run every run of ``sweep`` that is not finished yet, one process each; write ``sweep.jsonl`` and
    ``summary.md``; returns the rows."""
    sweep.folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, run in enumerate(sweep.runs, 1):
        label = f"[{index}/{len(sweep.runs)}] {run.setting}/{run.variant}"
        if finished(run):
            progress(f"fedguard: {label}: finished earlier, kept ({run.folder})")
            rows.append(summarize_run(run, "ok"))
            continue
        run.folder.mkdir(parents=True, exist_ok=True)
        preset = run.folder.parent / f"{run.variant}.toml"
        write_atomic(preset, tomli_w.dumps(unflatten(run.config.to_flat())))
        progress(f"fedguard: {label}: defense {run.config.defense.name}, {run.config.train.rounds} rounds -> {run.folder}")
        log = run.folder.parent / f"{run.variant}.log"
        code = run_one([sys.executable, "-m", "fedguard", "run", str(preset), "--out", str(run.folder)], log, timeout)
        if code != 0:
            rows.append(failed_row(run, failure_reason(run, code, log), log))
            progress(f"fedguard: {label}: failed: {rows[-1]['error']} (log {log})")
            continue
        row = summarize_run(run, "ok")
        rows.append(row)
        scores = f"PSNR {row['psnr']:.1f} dB, " if row.get("psnr") is not None else ""
        accuracy = f"accuracy {100 * row['accuracy']:.1f}%" if row["accuracy"] is not None else "no round finished"
        progress(f"fedguard: {label}: ok; {scores}{accuracy}")
    write_jsonl(sweep.folder / SWEEP_FILE, rows)
    summary = summary_table(rows, sweep.baseline) + failures_note(rows)
    if sweep.paper is not None:
        summary += "\n" + render_paper_table(sweep.paper, rows, sweep.baseline)
    write_atomic(sweep.folder / SUMMARY_FILE, summary)
    return rows


def load_preset(preset: Path | str) -> Config | Sweep:
    """A sweep preset's ``Sweep``, or a plain preset's ``Config``: what ``fedguard`` would run."""
    document = read_toml(Path(preset))
    return load_sweep(preset) if "sweep" in document else load_config(preset)
