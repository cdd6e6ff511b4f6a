"""fedguard from Python: run an experiment or a sweep, and open what a finished one wrote.

    import fedguard
    run = fedguard.run("experiments/quickstart.toml", overrides=["train.rounds=2"])
    run.rounds            # one row per round: accuracy, loss, seconds, ...
    run.attacks           # one row per attacked upload: attack, round, client, psnr, ssim, lpips, ...
    truth, recon = run.images("ig", round=1, client=0)   # (N, C, H, W) float32 in [0, 1]
    sweep = fedguard.open_run("runs/defenses")            # a sweep folder: cells, runs, leakage

``attack`` attacks a finished run's saved uploads again in this process (no Flower, no Ray), as ``fedguard attack``
does, each call's rows kept apart from the others' (``invocation``):

    fedguard.attack(run.folder, "ig", iterations=4000)   # the new rows; run.images("ig", 1, 0) now shows them

``run`` and ``run_sweep`` start ``fedguard run`` / ``fedguard sweep`` as a child process, exactly as the command
line does (the run's own processes, its lock, its watcher and its report), and print its progress; the tables are
pandas DataFrames read from the folder's JSON-lines files, so a handle opened later on a copied folder gives the
same tables.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedguard.config import Config, ConfigError, load_config
from fedguard.report.run_status import read_status
from fedguard.runtime import lifeline
from fedguard.runtime.simulation import joins_cluster
from fedguard.store.folder import (
    CONFIG_FILE,
    REPORT_FILE,
    ROUNDS_FILE,
    RUNS_FILE,
    SUMMARY_FILE,
)
from fedguard.store.invocations import invocation_of
from fedguard.store.rows import read_attacks, read_cells, read_rounds
from fedguard.store.run_dir import resolve_run_dir
from fedguard.store.vault import read_scored_images

if TYPE_CHECKING:
    import pandas as pd

    from fedguard.commands.sweep import Sweep
    from fedguard.runtime.warm import WarmRuntime

ConfigLike = Config | Mapping[str, Any] | str | Path
"""A preset's path, a mapping of keys (flat ``{"train.rounds": 2}`` or nested ``{"train": {"rounds": 2}}``) or a
``Config``."""


class RunFailed(RuntimeError):
    """``fedguard run`` or ``fedguard sweep`` ended with an error; ``folder`` holds what it wrote before."""

    def __init__(self, message: str, folder: Path) -> None:
        super().__init__(message)
        self.folder = folder


def _frame(rows: Sequence[Mapping[str, Any]], drop: Iterable[str] = ()) -> pd.DataFrame:
    """``rows`` as a DataFrame; nested objects become dotted columns (``defense.epsilon``), the keys in ``drop``
    (lists that belong in tables of their own) are left out."""
    import pandas as pd

    dropped = set(drop)
    return pd.json_normalize([{k: v for k, v in row.items() if k not in dropped} for row in rows])


@dataclasses.dataclass(frozen=True)
class RunResults:
    """A run folder's results. ``status`` is ``status.json`` (None while the run goes)."""

    folder: Path

    @property
    def config(self) -> Config:
        """The run's configuration, from its ``config.toml``."""
        return load_config(self.folder / CONFIG_FILE, base=self.folder)

    @property
    def status(self) -> dict[str, Any] | None:
        return read_status(self.folder)

    @property
    def report(self) -> Path:
        """``report.html``: curves, scores and reconstructions in one file."""
        return self.folder / REPORT_FILE

    @property
    def rounds(self) -> pd.DataFrame:
        """One row per round (0: the initial model): ``round``, ``accuracy``, ``loss``, ``seconds``, the
        defense's totals as ``defense.<name>``, upload sizes in bytes."""
        return _frame(read_rounds(self.folder), drop=("uploads", "failed", "rejected", "detect"))

    @property
    def uploads(self) -> pd.DataFrame:
        """One row per upload whose defense reported numbers of its own (e.g. CENSOR's ``raw``): ``round``,
        ``client`` and those numbers; empty when no defense did."""
        import pandas as pd

        return pd.DataFrame(
            [{"round": row["round"], **upload} for row in read_rounds(self.folder) for upload in row.get("uploads", [])]
        )

    @property
    def attacks(self) -> pd.DataFrame:
        """One row per attack on a captured upload: ``attack``, ``round``, ``client``, ``status``, ``psnr`` (dB),
        ``ssim``, ``lpips``, ``label_accuracy``, ``seconds``, ``attack_params.<key>``, ``stats.<key>``, ... (the
        scores are means over the upload's images; ``images`` has them one by one)."""
        return _frame(read_attacks(self.folder), drop=("per_image",))

    @property
    def image_scores(self) -> pd.DataFrame:
        """One row per scored image: ``attack``, ``round``, ``client``, ``image`` (its index in the client's
        batch), ``psnr``, ``ssim``, ``lpips``, ``mse``."""
        import pandas as pd

        return pd.DataFrame(
            [
                {"attack": row["attack"], "round": row["round"], "client": row["client"], "image": index, **scores}
                for row in read_attacks(self.folder)
                for index, scores in enumerate(row.get("per_image") or [])
            ]
        )

    def images(
        self, attack: str, round: int, client: int, invocation: str | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(truth, reconstruction) of one attacked upload, each (N, C, H, W) float32 in [0, 1], image i of the
        reconstruction matched to image i of the client's batch (as scored): of the latest invocation of
        ``attack`` on it (the run's own, ``run``, or a ``fedguard attack``'s, ``attack-<n>``), or of
        ``invocation``. ``KeyError`` naming the scored (attack, round, client, invocation) when there is none."""
        scored = [r for r in read_attacks(self.folder) if r.get("status") == "ok" and r.get("images")]
        chosen = [
            r
            for r in scored
            if (r.get("attack"), r.get("round"), r.get("client")) == (attack, round, client)
            and invocation in (None, invocation_of(r))
        ]
        truth, recon = (None, None)
        if chosen:
            truth, recon = read_scored_images(self.folder, round, client, str(chosen[-1]["images"]))
        if truth is None or recon is None:
            known = sorted({(r["attack"], r["round"], r["client"], invocation_of(r)) for r in scored})
            raise KeyError(
                f"no scored reconstruction of attack {attack!r}, round {round}, client {client}"
                f"{'' if invocation is None else f', invocation {invocation!r}'} in {self.folder}; scored "
                f"(attack, round, client, invocation): {known or 'none'}"
            )
        return truth, recon


@dataclasses.dataclass(frozen=True)
class SweepResults:
    """A sweep folder's results: its cells (one per setting and variant, pooled over seeds), its runs, and the
    leakage of every attack in every attacked round of every cell."""

    folder: Path

    @property
    def cells(self) -> pd.DataFrame:
        """One row per (setting, variant) cell: ``accuracy``, ``accuracy_ci95``, ``accuracy_share``, ``epsilon``,
        the headline leakage as ``privacy.<key>`` (``privacy.attack``, ``privacy.round``, ``privacy.ssim_mean``,
        ``privacy.ssim_ci95``, ...), ``seconds_per_round``, ..."""
        return _frame(read_cells(self.folder), drop=("attacks", "by_round", "defense_report"))

    @property
    def runs(self) -> pd.DataFrame:
        """One row per run (a seed of a cell): ``setting``, ``variant``, ``seed``, ``status``, ``accuracy``,
        ``folder``, ..."""
        return _frame(read_cells(self.folder, RUNS_FILE), drop=("attacks", "by_round", "defense_report", "privacy"))

    @property
    def leakage(self) -> pd.DataFrame:
        """One row per (setting, variant, attack, round): ``n_images``, ``adaptive``, ``psnr_mean``,
        ``ssim_mean``, ``ssim_ci95``, ``lpips_mean``, ``success_rate``, ... over the cell's seeds."""
        import pandas as pd

        return pd.DataFrame(
            [
                {"setting": cell["setting"], "variant": cell["variant"], **leak}
                for cell in read_cells(self.folder)
                for leak in (cell.get("privacy") or {}).get("by_attack", [])
            ]
        )

    @property
    def summary(self) -> str:
        """``summary.md``: the tables ``fedguard sweep`` prints."""
        return (self.folder / SUMMARY_FILE).read_text()

    def run(self, setting: str, variant: str, seed: int | None = None) -> RunResults:
        """One run of the sweep (``seed``: required where the sweep declares seeds); ``KeyError`` naming the
        runs there are."""
        rows = read_cells(self.folder, RUNS_FILE)
        found = [
            r
            for r in rows
            if r["setting"] == setting and r["variant"] == variant and (seed is None or r.get("seed") == seed)
        ]
        if len(found) != 1:
            there = ", ".join(
                f"{r['setting']}/{r['variant']}" + (f" seed {r['seed']}" if r.get("seed") is not None else "")
                for r in rows
            )
            need = " (give its seed)" if len(found) > 1 else ""
            raise KeyError(
                f"no single run {setting}/{variant}{'' if seed is None else f' seed {seed}'}{need} in "
                f"{self.folder}; runs: {there}"
            )
        return RunResults(Path(found[0]["folder"]))


def open_run(path: str | Path) -> RunResults | SweepResults:
    """The results in ``path``: a sweep's folder (it holds ``runs.jsonl``) or a run's (``rounds.jsonl``).
    ``FileNotFoundError`` when it is neither."""
    folder = Path(path).expanduser().absolute()
    if (folder / RUNS_FILE).is_file():
        return SweepResults(folder)
    if (folder / ROUNDS_FILE).is_file():
        return RunResults(folder)
    raise FileNotFoundError(
        f"{folder} holds no run ({ROUNDS_FILE}) and no sweep ({RUNS_FILE}); give the folder "
        f"that `fedguard run --out` or `fedguard sweep --out` wrote"
    )


def as_config(config: ConfigLike, overrides: Iterable[str] = ()) -> Config:
    """``config`` (see ``ConfigLike``) validated, with ``key=value`` ``overrides`` after it; relative paths are
    resolved against the current folder, as on the command line. ``ConfigError`` lists every problem."""
    if isinstance(config, (str, Path)):
        return load_config(config, list(overrides))
    if isinstance(config, Config):
        return load_config(keys=config.to_flat(), overrides=list(overrides))
    if isinstance(config, Mapping):
        return load_config(keys=config, overrides=list(overrides))
    raise ConfigError([f"config {type(config).__name__}: give a preset's path, a mapping of keys or a Config"])


def _follow(command: list[str], progress: Callable[[str], None] | None) -> tuple[int, str]:
    """Run ``command`` tied to this process (``fedguard.runtime.lifeline``: should it die, the run is stopped and
    recorded as interrupted), each line of its output to ``progress`` (None: kept quiet); its exit code and last
    lines."""
    tail: list[str] = []
    with subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env={**os.environ, **lifeline.tied()},
    ) as process:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                tail = (tail + [line.rstrip("\n")])[-20:]
                if progress is not None:
                    progress(line.rstrip("\n"))
        except KeyboardInterrupt:  # the child got the same Ctrl-C and stops its run cleanly
            process.wait()
            raise
    return process.returncode, "\n".join(tail)


_WARM: dict[str, WarmRuntime] = {}  # this process's warm runtime, once a warm run started it


def close() -> None:
    """Stop the warm runtime ``run(..., warm=True)`` started (its Ray cluster and runner); the next warm run starts
    a new one. Called at this process's exit too."""
    runtime = _WARM.pop("runtime", None)
    if runtime is not None:
        runtime.close()


def _warm_runtime(cpus: int) -> WarmRuntime:
    """This process's warm runtime with a cluster of ``cpus`` CPUs (the one running, or a new one when it has
    another count)."""
    from fedguard.runtime.warm import WarmRuntime

    runtime = _WARM.get("runtime")
    if runtime is not None and runtime.cpus != cpus:
        close()
        runtime = None
    if runtime is None:
        if not _WARM:
            atexit.register(close)
        runtime = _WARM["runtime"] = WarmRuntime(cpus)
    return runtime


def run(
    config: ConfigLike,
    out: str | Path | None = None,
    overrides: Iterable[str] = (),
    progress: Callable[[str], None] | None = print,
    warm: bool = False,
) -> RunResults:
    """Run one experiment to its end and open its folder.

    ``config``: a preset's path, a mapping of keys or a ``Config``; ``overrides``: ``key=value`` strings applied
    after it; ``out``: the run's folder (default: the config's ``out-dir``, else ``runs/<name>``, or
    ``runs/<name>-2`` ... when that holds a run). ``progress`` receives each line ``fedguard run`` prints.
    ``warm``: run it in this process's warm runtime (``fedguard.runtime.warm``: a Ray cluster and a runner
    started by the first warm run and kept for the next ones until ``close()`` or this process's exit), so a
    run pays for no process, SuperLink or Ray start; the results are those of a cold run. A configuration that
    joins a Ray cluster of its own (``sim.address``, ``RAY_ADDRESS``) runs cold.
    Raises ``ConfigError`` before anything runs when the configuration is invalid, ``FileExistsError`` when
    ``out`` (or ``out-dir``) already holds a run, ``RunFailed`` (with the folder) when the run fails."""
    resolved = as_config(config, overrides)
    if out is not None:
        resolved = dataclasses.replace(
            resolved, run=dataclasses.replace(resolved.run, out_dir=str(Path(out).absolute()))
        )
    folder = resolve_run_dir(resolved)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:  # the run's processes rebuild ``resolved`` from its plan
        if warm and joins_cluster(resolved) is None:
            log = Path(scratch, "run.log")
            code = _warm_runtime(resolved.sim.num_cpus).run(resolved, folder, log, progress=progress)
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        else:
            plan = Path(scratch, "plan.json")
            plan.write_text(resolved.plan(), encoding="utf-8")
            command = [sys.executable, "-m", "fedguard", "run", "--plan", str(plan), "--out", str(folder)]
            code, tail = _follow(command, progress)
    if code != 0:
        status = read_status(folder) or {}
        raise RunFailed(f"fedguard run failed (exit code {code}) in {folder}: {status.get('error') or tail}", folder)
    return RunResults(folder)


def attack(
    run: str | Path | RunResults,
    name: str | None = None,
    overrides: Iterable[str] = (),
    progress: Callable[[str], None] | None = print,
    **params: Any,
) -> pd.DataFrame:
    """Attack a finished run's captured uploads again, in this process, as ``fedguard attack RUN`` does (no
    Flower, no Ray process): ``name`` the attack (``attack.name``; None: the run's own), ``params`` its parameters
    (``iterations=500`` for ``attack.<name>.iterations``), ``overrides`` any other ``key=value``. The rows are
    scored against the run's vault, appended to its ``attacks.jsonl`` under an invocation id of their own
    (``attack-<n>``) with their images, and returned as ``RunResults.attacks`` has them; the report is rebuilt.
    Raises ``ConfigError`` for a bad key or value, ``FileNotFoundError`` for a folder without captured uploads."""
    from fedguard.commands.attack import attack_capture

    if params and name is None:
        raise ConfigError([f"attack parameters {sorted(params)} given without the attack's name"])
    chosen = [] if name is None else [f"attack.name={name}"]
    chosen += [f"attack.{name}.{key.replace('_', '-')}={_override_value(value)}" for key, value in params.items()]
    folder = run.folder if isinstance(run, RunResults) else Path(run)
    _, rows = attack_capture(folder, [*chosen, *overrides], progress or (lambda line: None))
    return _frame(rows, drop=("per_image",))


def _override_value(value: Any) -> str:
    """``value`` as ``key=value`` text reads it back (booleans as true/false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def run_sweep(
    preset: str | Path,
    out: str | Path | None = None,
    overrides: Iterable[str] = (),
    only: Iterable[str] = (),
    seeds: Iterable[int] | None = None,
    progress: Callable[[str], None] | None = print,
    warm: bool = False,
) -> SweepResults:
    """Run a sweep preset (each run not finished yet) and open its folder; the arguments are those of
    ``fedguard sweep`` (``only``: ``[SETTING/]VARIANT`` names; ``seeds``: instead of the preset's), which runs it
    as a child process. ``warm``: run it in this process instead, its runs in this process's warm runtime (the
    one ``run(..., warm=True)`` uses, kept for the next runs and sweeps until ``close()``). Raises
    ``ConfigError`` before anything runs when a run's configuration is invalid, ``RunFailed`` when the sweep
    itself fails (a failed run is a row with status ``failed``, not an exception)."""
    from fedguard.commands.sweep import load_sweep

    overrides, only, chosen = list(overrides), list(only), None if seeds is None else list(seeds)
    sweep = load_sweep(preset, None if out is None else Path(out), overrides, only, chosen)
    if warm:
        return _warm_sweep(sweep, out is not None, progress or (lambda line: None))
    command = [sys.executable, "-m", "fedguard", "sweep", str(Path(preset).absolute()), "--out", str(sweep.folder)]
    command += [arg for text in overrides for arg in ("--set", text)] + [
        arg for name in only for arg in ("--only", name)
    ]
    command += [] if chosen is None else ["--seeds", ",".join(str(seed) for seed in chosen)]
    code, tail = _follow(command, progress)
    if code != 0:
        raise RunFailed(f"fedguard sweep failed (exit code {code}) in {sweep.folder}: {tail}", sweep.folder)
    return SweepResults(sweep.folder)


def _warm_sweep(sweep: Sweep, out_given: bool, progress: Callable[[str], None]) -> SweepResults:
    """Run ``sweep`` in this process, its runs in this process's warm runtime where they can share a cluster
    (``fedguard.runtime.ray_head.shared_cpus``), else each as its own ``fedguard run``; checked as ``fedguard
    sweep`` checks it."""
    from fedguard.commands.sweep import finished
    from fedguard.commands.sweep import run_sweep as sweep_runs
    from fedguard.limits import writable_problem
    from fedguard.runtime.preflight import machine_problems
    from fedguard.runtime.ray_head import shared_cpus

    problems = machine_problems([(f"{run.setting}/{run.variant}", run.config) for run in sweep.runs])
    if problem := writable_problem("out" if out_given else "sweep folder", sweep.folder):
        problems.append(problem)
    if problems:
        raise ConfigError(problems)
    cpus = shared_cpus([run.config for run in sweep.runs if not finished(run)])
    progress(f"fedguard: sweep {sweep.name}: {len(sweep.runs)} runs in {sweep.folder}")
    sweep_runs(sweep, progress, runtime=None if cpus is None else _warm_runtime(cpus))
    return SweepResults(sweep.folder)
