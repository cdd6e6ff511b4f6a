"""How fedguard's Flower simulation scales with the number of clients, side by side with a bare Flower app.

For each N in --clients, two runs of the same federation, one after the other:

    fedguard  `fedguard run` with the default configuration (FedSGD, the default MLP, iid) and
              --set data.name=DATA defense.name=DEFENSE train.batch-size=4 partition.num-clients=N
              train.clients-per-round=N capture.rounds=none train.rounds=R, into a temporary --out folder.
    bare      benchmarks/bare_flower: a minimal Flower app (message API, flwr.serverapp.strategy.FedAvg, no
              federated evaluation) with the same MLP (same layers, same seeded initial weights), fedguard's
              data and iid partitioning, and the same client step as fedguard's FedSGD client
              (clients/defended_client.py): the batch of 4 drawn as fedguard draws it
              (fedguard.seeding.client_generators(seed, client, round), the same rng.choice), the gradient of
              its mean cross-entropy, then (--defense dgp) fedguard's Dual Gradient Pruning with error feedback
              (fedguard.defenses.dgp.DualGradientPruning(DGPParams()), the algorithm alone, given the LocalStep
              fedguard gives it), the residual kept in the node's Context.state as an ArrayRecord, as a Flower
              user keeps per-client state. The client returns the model after one SGD step of train.lr with
              what it sent, which FedAvg turns into FedSGD; the update is bit for bit fedguard's
              (tests/test_scale_benchmark.py checks it). It is launched the way `fedguard run` launches its
              app (fedguard/runtime/simulation.py `simulate`): a private `flower-superlink --simulation` on loopback
              with the same flags and environment (`fedguard.runtime.simulation._environment`), then `flwr run <app>
              --federation-config <fedguard.runtime.simulation.federation_config> --run-config <file> --stream`: one
              SuperNode per client, the same Ray resources (sim.num-cpus, sim.client-cpus, sim.client-gpus).
              So the ratio of the two isolates fedguard's own share: its CLI, its ServerApp's wrappers and
              checks, its client's bookkeeping (per-client state in files under the run folder rather than in
              Context.state, sparse-encoded uploads, reports) and its FedSGD strategy.

--defense dgp|none (default dgp) sets both sides: fedguard's defense.name, the bare app's `defense`. --data
NAME (default mnist-5k) sets both sides' data set. MNIST-5k has 4,000 training examples and fedguard's iid
partition gives each client at least one, so N > 4,000 is refused (as fedguard refuses it; the benchmark says
so up front); --data fashion-mnist (60,000 training images, 1x28x28 like MNIST, from Debian's
dataset-fashion-mnist package) allows up to 60,000 clients.

With DGP every client carries a dense residual the size of the model (the MLP: 269,322 float32 = 1.08 MB)
from round to round: N x 1.08 MB in all (10.8 GB at 10,000 clients), held by the bare app in Context.state,
which Flower's simulation keeps in its `flwr-simulation` process, and by fedguard in files in its run folder
(the temporary folder here). The benchmark prints the figure before such runs.

What is measured, per run:

    seconds per round   the mean wall time of rounds 2..R (round 1 pays the start-up of the Ray actors):
                        fedguard's rounds.jsonl `seconds`; the bare ServerApp measures it the same way, as
                        the time between two consecutive central evaluations of the global model on the
                        held-out split (fedguard scores the global model after every round; so does the
                        bare app, to have the same round).
    ms per client step  seconds per round / N.
    peak PSS            every --interval seconds (0.2) the memory of every process of the run is read from
                        /proc/<pid>/smaps_rollup (less often when that would take more than 10 % of a core:
                        the kernel walks the page tables, about 15 ms per resident GB on the 2-core test
                        machine; the JSON has the mean interval and the cost of a sample): the process
                        launched (the fedguard CLI; for the bare app the SuperLink and `flwr run`, started
                        from here as fedguard's CLI starts them, this script standing in for the CLI and
                        not counted), every descendant, every process in a
                        session one of them leads (fedguard and Flower start the SuperLink, SuperExec and
                        `flwr run` in sessions of their own, and Ray's processes outlive their parents) and
                        every process whose environment carries this run's FEDGUARD_SCALE_RUN token.
                        The primary figure is the peak of the SUM of their PSS (proportional set size: a page
                        shared by k processes counts 1/k in each, so shared libraries such as libtorch count
                        once in the sum, not once per process; pages shared with processes outside the run,
                        this script included, are split with those too). Where a process's smaps_rollup cannot
                        be read its RSS (/proc/<pid>/statm) stands in, and the result says so
                        (`memory_measure`, `pss_unreadable`). Also reported: the peak of the RSS sum (shared
                        pages once per process, as before), the largest single process by PSS and by RSS, and
                        (JSON) the PSS per role (CLI, SuperLink, SuperExec, flwr run, simulation (the
                        ServerApp), Ray ClientAppActor, other Ray services) at the PSS peak. GB = 1e9 bytes.

A run that fails (or passes --timeout) has its log tail printed and is marked failed; the next one goes on.
Each run works in a temporary folder that is removed afterwards.

    .venv/bin/python benchmarks/scale_clients.py [--clients 10,100,1000] [--rounds 3] [--defense dgp|none]
        [--data mnist-5k|fashion-mnist|...] [--tools fedguard,bare] [--timeout 3600] [--interval 0.2]
        [--out benchmarks/results/scale_clients.json]

    e.g. 10,000 clients:  --clients 10000 --data fashion-mnist

Prints a table per N (tool, seconds per round, ms per client step, peak PSS sum, peak RSS sum, largest process
by PSS and by RSS in GB, and the ratios fedguard/bare), then one summary line per N (fedguard/bare: ms per
client step, peak PSS sum); writes the results as JSON to --out after every run and a plot beside it
(scale_clients.png: log x clients; seconds per round and peak PSS, both tools). ``--clients 10 --rounds 2`` is
a quick smoke run (about a minute); tests/test_scale_benchmark.py runs 4.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BARE_APP = HERE / "bare_flower"
RESULTS = HERE / "results"
BIN = Path(sys.executable).parent
TOOLS = ("fedguard", "bare")
DEFENSES = ("dgp", "none")  # what --defense sets on both sides
DATA = "mnist-5k"  # --data default: fedguard's default data set
ROOMY_DATA = "fashion-mnist"  # 60,000 training examples: what to suggest when N is too large for --data
MARKER = "FEDGUARD_SCALE_RUN"  # environment variable naming the run every process of it belongs to
GB = 1e9
PAGE = os.sysconf("SC_PAGE_SIZE")
STOP_GRACE = 90.0  # seconds a run past --timeout gets after SIGTERM (fedguard records and reports meanwhile)
SETTLE = 10.0  # seconds the processes of a finished run get to end on their own before they are stopped
SAMPLING_SHARE = 0.1  # the memory sampler waits long enough after each sample to use at most this share of a core


def fedguard_overrides(clients: int | str, rounds: int, defense: str = "dgp", data: str = DATA) -> list[str]:
    """The ``--set`` of the fedguard runs: the default configuration with ``data`` and ``defense``, batches of 4,
    every client in every round, nothing captured."""
    return [
        f"data.name={data}",
        f"defense.name={defense}",
        "train.batch-size=4",
        f"partition.num-clients={clients}",
        f"train.clients-per-round={clients}",
        "capture.rounds=none",
        f"train.rounds={rounds}",
    ]


def fedguard_config(clients: int, rounds: int, defense: str = "dgp", data: str = DATA) -> Any:
    """The resolved fedguard ``Config`` of a run (raises ``fedguard.config.ConfigError`` for one fedguard
    refuses, e.g. more clients than training examples)."""
    from fedguard.config import load_config

    return load_config(None, fedguard_overrides(clients, rounds, defense, data))


def training_examples(data: str) -> int | None:
    """Training examples of data set ``data`` with fedguard's default options (None: known only once loaded)."""
    from fedguard.config import ConfigError, load_config
    from fedguard.data.sizes import split_sizes

    try:
        options = load_config(None, [f"data.name={data}"]).data.source_options()
    except ConfigError:
        return None
    sizes = split_sizes(data, options)
    return None if sizes is None else sizes.train


def residual_gb(clients: int, data: str) -> float | None:
    """GB of DGP residuals ``clients`` clients carry between rounds: one dense float32 copy of the MLP's
    trainable parameters each (None when the data set's shape is known only once it is loaded)."""
    from fedguard.data.registry import dataset_spec

    spec = dataset_spec(data)
    if spec is None:
        return None
    size, params = spec.channels * spec.height * spec.width, 0
    hidden, depth = 256, 2  # the bare app's (and fedguard's default) MLP: bareflower.task.HIDDEN, DEPTH
    for _ in range(depth):
        params += size * hidden + hidden
        size = hidden
    params += size * spec.num_classes + spec.num_classes
    return clients * params * 4 / GB


# ------------------------------------------------------------------------------------------------------------
# The processes of a run and their memory, from /proc
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stat:
    comm: str
    state: str
    ppid: int
    sid: int
    started: int  # clock ticks after boot: (pid, started) names one process for good


def _stat(pid: int) -> Stat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, _, tail = text.rpartition(")")  # "pid (comm) state ppid pgrp session ..."; comm may hold anything
    fields = tail.split()
    return Stat(head.partition("(")[2], fields[0], int(fields[1]), int(fields[3]), int(fields[19]))


def _rss(pid: int) -> int:
    """Resident bytes of ``pid`` (0 when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _memory(pid: int) -> tuple[int, int, bool]:
    """(PSS, RSS) bytes of ``pid`` from ``/proc/<pid>/smaps_rollup`` and True; (RSS, RSS, False) from
    ``/proc/<pid>/statm`` when smaps_rollup cannot be read; (0, 0, True) when the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as handle:
            text = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0, True
    except OSError:  # not ours to read, or no smaps_rollup in this kernel
        text = b""
    pss = rss = None
    for line in text.splitlines():
        if line.startswith(b"Rss:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith(b"Pss:"):
            pss = int(line.split()[1]) * 1024
            break  # Rss comes first
    if pss is not None and rss is not None:
        return pss, rss, True
    rss = _rss(pid)
    return (rss, rss, False) if rss else (0, 0, True)  # empty smaps_rollup and no statm: it just ended


def _has_token(pid: int, token: bytes) -> bool:
    try:
        return token in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def role(comm: str, cmdline: str) -> str:
    """What a process of a run is, for the breakdown of its memory."""
    words = cmdline.split()
    names = [Path(w).name for w in words[:3]]
    if "ClientAppActor" in comm or "ClientAppActor" in cmdline:
        return "Ray ClientAppActor"
    if "flwr-simulation" in names:
        return "simulation (ServerApp)"
    if "flower-superlink" in names:
        return "SuperLink"
    if "flower-superexec" in names:
        return "SuperExec"
    if "flwr" in names and "run" in words:
        return "flwr run"
    if "fedguard" in names or "fedguard.runtime.launcher" in words:
        return "fedguard CLI"
    if comm.startswith("ray::") or "ray" in cmdline or comm in ("raylet", "gcs_server"):
        return "Ray services"
    return comm or "?"


class RunMemory:
    """Samples, every ``interval`` seconds in a thread, the memory (PSS and RSS) of every process of one run: the
    ``roots``, their descendants (a child of a process of the run is one, whoever reaps it later), the
    processes of every session a process of the run leads, and any process whose environment holds
    ``MARKER=token``. Keeps the peak of the PSS sum (with its breakdown by role), of the RSS sum, and of the
    largest single process by each; a process whose PSS cannot be read counts with its RSS
    (``pss_unreadable``)."""

    def __init__(self, token: str, interval: float = 0.2) -> None:
        self.token = f"\0{MARKER}={token}\0".encode()
        self.interval = interval
        self.roots: set[tuple[int, int]] = set()
        self.members: dict[tuple[int, int], str] = {}  # (pid, started) -> role
        self._roles: dict[tuple[int, int, str], str] = {}
        self._commands: dict[tuple[int, int], str] = {}
        self.process_peaks: dict[tuple[int, int], int] = {}
        self._env_checked: dict[tuple[int, int], bool] = {}
        self.sessions: set[int] = set()
        self.pss_unreadable: set[tuple[int, int]] = set()
        self.peak_sum = 0  # PSS
        self.peak_breakdown: dict[str, int] = {}
        self.peak_processes = 0
        self.peak_single = 0
        self.peak_single_role = ""
        self.peak_rss_sum = 0
        self.peak_rss_single = 0
        self.peak_rss_single_role = ""
        self.samples = 0
        self.sampling_seconds = 0.0
        self.sampling_cpu_seconds = 0.0
        self.last_cpu = 0.0
        self.first_sample = self.last_sample = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add_root(self, pid: int) -> None:
        stat = _stat(pid)
        if stat is not None:
            with self._lock:
                self.roots.add((pid, stat.started))

    def _table(self) -> dict[int, Stat]:
        table = {}
        with os.scandir("/proc") as entries:
            for entry in entries:
                if entry.name.isdigit():
                    stat = _stat(int(entry.name))
                    if stat is not None and stat.state not in ("Z", "X"):
                        table[int(entry.name)] = stat
        return table

    def _role(self, pid: int, key: tuple[int, int], comm: str) -> str:
        # a forked child runs its parent's program until it execs (or renames itself, as Ray's workers do)
        cached = self._roles.get((*key, comm))
        if cached is None:
            command = self._commands[key] = _cmdline(pid) or comm
            cached = self._roles[(*key, comm)] = role(comm, command)
        return cached

    def sample(self) -> None:
        """One reading of every process of the run now."""
        began, cpu = time.perf_counter(), time.thread_time()
        with self._lock:
            table = self._table()
            total, rss_total, breakdown, count = 0, 0, {}, 0
            for pid, stat in sorted(table.items(), key=lambda item: item[1].started):  # parents before children
                key = (pid, stat.started)
                parent = table.get(stat.ppid)
                member = (
                    key in self.members
                    or key in self.roots
                    or (parent is not None and (stat.ppid, parent.started) in self.members)
                    or stat.sid in self.sessions
                )
                if not member:
                    if key not in self._env_checked:
                        self._env_checked[key] = _has_token(pid, self.token)
                    member = self._env_checked[key]
                if not member:
                    continue
                name = self.members[key] = self._role(pid, key, stat.comm)
                if stat.sid == pid:  # it leads a session: what runs in it belongs to the run
                    self.sessions.add(pid)
                pss, rss, proportional = _memory(pid)
                if not proportional:
                    self.pss_unreadable.add(key)
                total += pss
                rss_total += rss
                count += 1
                breakdown[name] = breakdown.get(name, 0) + pss
                self.process_peaks[key] = max(self.process_peaks.get(key, 0), pss)
                if pss > self.peak_single:
                    self.peak_single, self.peak_single_role = pss, name
                if rss > self.peak_rss_single:
                    self.peak_rss_single, self.peak_rss_single_role = rss, name
            if total > self.peak_sum:
                self.peak_sum, self.peak_breakdown, self.peak_processes = total, breakdown, count
            self.peak_rss_sum = max(self.peak_rss_sum, rss_total)
            self.samples += 1
        self.sampling_seconds += time.perf_counter() - began
        self.last_cpu = time.thread_time() - cpu
        self.sampling_cpu_seconds += self.last_cpu
        self.first_sample = self.first_sample or began
        self.last_sample = began

    def _loop(self) -> None:
        # smaps_rollup walks the page tables: ~15 ms per GB resident here, so a run with a process of several GB
        # is sampled less often than every ``interval``, to keep the sampler's CPU to SAMPLING_SHARE of a core
        while not self._stop.is_set():
            began = time.perf_counter()
            self.sample()
            self._stop.wait(
                max(self.interval - (time.perf_counter() - began), self.last_cpu * (1 / SAMPLING_SHARE - 1))
            )

    def __enter__(self) -> RunMemory:
        self._thread = threading.Thread(target=self._loop, name="run-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def live(self) -> set[Any]:
        """The processes of the run still running, as ``fedguard.runtime.processes.Process``."""
        from fedguard.runtime.processes import Process, is_running

        if self._thread is None or not self._thread.is_alive():
            self.sample()  # what started since the last reading
        with self._lock:
            known = {Process(pid, started) for pid, started in self.members}
        return {p for p in known if is_running(p)}

    def describe(self, key: tuple[int, int]) -> str:
        """'pid role: command' of a process of the run."""
        return f"{key[0]} {self.members.get(key, '?')}: {self._commands.get(key, '')[:150]}"

    def summary(self) -> dict[str, Any]:
        heaviest = sorted(self.process_peaks.items(), key=lambda kv: -kv[1])
        unreadable = sorted(self.pss_unreadable)
        return {
            "memory_measure": "PSS"
            if not unreadable
            else f"PSS (RSS for {len(unreadable)} processes whose smaps_rollup could not be read)",
            "peak_pss_sum_gb": self.peak_sum / GB,
            "peak_pss_max_gb": self.peak_single / GB,
            "largest_process": self.peak_single_role,
            "peak_rss_sum_gb": self.peak_rss_sum / GB,
            "peak_rss_max_gb": self.peak_rss_single / GB,
            "largest_process_rss": self.peak_rss_single_role,
            "pss_unreadable": [self.describe(key) for key in unreadable],
            "peak_breakdown_gb": {
                k: round(v / GB, 4) for k, v in sorted(self.peak_breakdown.items(), key=lambda kv: -kv[1])
            },
            "processes_at_peak": self.peak_processes,
            "processes_seen": len(self.members),
            "process_peaks_gb": [[round(pss / GB, 4), self.describe(key)] for key, pss in heaviest],  # PSS
            "memory_samples": self.samples,
            "sampling_ms_per_sample": 1000 * self.sampling_seconds / max(self.samples, 1),
            "sampling_cpu_ms_per_sample": 1000 * self.sampling_cpu_seconds / max(self.samples, 1),
            "sampling_interval_s": (self.last_sample - self.first_sample) / max(self.samples - 1, 1),
        }


def stop_leftovers(memory: RunMemory, patience: float = SETTLE) -> list[str]:
    """Stop the processes of a run still running ``patience`` seconds after it ended (with fedguard's
    ``ProcessTracker.stop``: SIGTERM, then SIGKILL); returns those it had to stop."""
    from fedguard.runtime.processes import ProcessTracker, is_running

    left, deadline = memory.live(), time.monotonic() + patience
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {p for p in left if is_running(p)}
    if left:
        ProcessTracker(seen=set(left)).stop(patience=0.0)
    return [memory.describe((p.pid, p.started)) for p in sorted(left, key=lambda p: p.pid)]


# ------------------------------------------------------------------------------------------------------------
# The runs
# ------------------------------------------------------------------------------------------------------------


class RunFailed(RuntimeError):
    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


def _tail(*paths: Path, chars: int = 3000) -> str:
    parts = []
    for path in paths:
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace")
            if text.strip():
                parts.append(f"--- {path.name} ---\n{text[-chars:]}")
    return "\n".join(parts)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(process: subprocess.Popen, timeout: float) -> bool:
    """Whether ``process`` ended within ``timeout`` seconds; if not, it (its session) gets SIGTERM, and SIGKILL
    ``STOP_GRACE`` seconds later."""
    try:
        process.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        _stop_group(process, STOP_GRACE)
        return False


def _stop_group(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM to ``process``'s process group (it leads its own), SIGKILL after ``grace`` seconds."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def run_fedguard(
    clients: int,
    rounds: int,
    folder: Path,
    memory: RunMemory,
    timeout: float,
    token: str,
    defense: str = "dgp",
    data: str = DATA,
) -> list[dict[str, Any]]:
    """``fedguard run`` of the benchmark's configuration into ``folder``; its rounds.jsonl rows."""
    out, log_path = folder / "run", folder / "fedguard.log"
    command = [str(BIN / "fedguard"), "run", "--out", str(out)]
    for override in fedguard_overrides(clients, rounds, defense, data):
        command += ["--set", override]
    env = {**os.environ, MARKER: token}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    memory.add_root(process.pid)
    with memory:
        ended = _wait(process, timeout)
    if not ended:
        raise RunFailed(f"still running after --timeout {timeout:g} s; stopped", _tail(log_path))
    rows = _read_rows(out / "rounds.jsonl")
    if process.returncode != 0:
        raise RunFailed(f"`fedguard run` exited with code {process.returncode}", _tail(log_path))
    return rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RunFailed(f"the SuperLink exited with code {process.returncode}", _tail(log_path))
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RunFailed(f"the SuperLink did not listen on 127.0.0.1:{port} within {timeout:.0f} s", _tail(log_path))


def run_bare(
    clients: int,
    rounds: int,
    folder: Path,
    memory: RunMemory,
    timeout: float,
    token: str,
    defense: str = "dgp",
    data: str = DATA,
) -> list[dict[str, Any]]:
    """The bare Flower app on a private SuperLink, launched as ``fedguard.runtime.simulation.simulate`` launches
    fedguard's; the rows of its timing file."""
    import tomli_w

    from fedguard.defenses.dgp import DGPParams
    from fedguard.runtime.launcher import superlink_command, write_flower_home
    from fedguard.runtime.simulation import CONNECTION, _environment, federation_config

    # the configuration fedguard runs, for the run config, federation config and environment it would use
    config = fedguard_config(clients, rounds, defense, data)
    home = folder / "flwr-home"
    home.mkdir()
    timing = folder / "rounds.jsonl"
    port = _free_port()
    write_flower_home(home, port)
    source = config.data
    (home / "run-config.toml").write_text(
        tomli_w.dumps(
            {
                "num-server-rounds": rounds,
                "num-clients": clients,
                "clients-per-round": config.train.clients_per_round,
                "batch-size": config.train.batch_size,
                "lr": config.train.lr,
                "seed": config.run.seed,
                "defense": config.defense.name,
                "data-name": source.name,
                "data-root": source.root,
                "test-fraction": source.test_fraction,
                "image-size": source.image_size,
                "timing-file": str(timing),
            }
        )
    )
    assert (config.partition.name, config.model.name) == ("iid", "mlp"), "the bare app has fedguard's defaults"
    assert config.defense.name == "none" or config.defense.params == DGPParams(), "the bare app runs DGPParams()"
    with contextlib.chdir(REPO):  # fedguard's environment puts the working directory on PYTHONPATH
        env = _environment(home, config)
    env[MARKER] = token
    superlink_log, run_log = folder / "superlink.log", folder / "flwr-run.log"
    superlink_args = superlink_command(port, home / "state.db")  # the SuperLink fedguard run starts
    run_command = [
        "flwr",
        "run",
        str(BARE_APP),
        CONNECTION,
        "--federation-config",
        federation_config(config),
        "--run-config",
        str(home / "run-config.toml"),
        "--stream",
    ]
    deadline = time.monotonic() + timeout
    with memory:
        with open(superlink_log, "w") as log:
            superlink = subprocess.Popen(
                superlink_args, env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        memory.add_root(superlink.pid)
        try:
            _wait_for_port(port, superlink, 60, superlink_log)
            with open(run_log, "w") as log:
                run = subprocess.Popen(
                    run_command, env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            memory.add_root(run.pid)
            ended = _wait(run, max(1.0, deadline - time.monotonic()))
        finally:
            memory.sample()
            _stop_group(superlink, 20.0)
    logs = (run_log, superlink_log)
    if not ended:
        raise RunFailed(f"still running after --timeout {timeout:g} s; stopped", _tail(*logs))
    rows = _read_rows(timing)
    if run.returncode != 0:
        raise RunFailed(f"`flwr run` exited with code {run.returncode}", _tail(*logs))
    if len([r for r in rows if r["round"] > 0]) < rounds:
        raise RunFailed(f"the bare ServerApp recorded {len(rows)} of {rounds + 1} evaluations", _tail(*logs))
    return rows


RUNNERS: dict[str, Callable[..., list[dict[str, Any]]]] = {"fedguard": run_fedguard, "bare": run_bare}


def refusal(clients: int, rounds: int, defense: str = "dgp", data: str = DATA) -> str | None:
    """Why no run of ``clients`` clients can be made (fedguard's own checks, e.g. at least one training example
    per client, with a hint at a larger data set), or None."""
    from fedguard.config import ConfigError

    try:
        fedguard_config(clients, rounds, defense, data)
    except ConfigError as error:
        reason = " ".join(str(error).split())
        examples, roomy = training_examples(data), training_examples(ROOMY_DATA)
        if examples is not None and clients > examples:
            hint = f"{data} has {examples:,} training examples and each client needs one"
            if roomy is not None and clients <= roomy:
                hint += f"; use --data {ROOMY_DATA} ({roomy:,} training examples) for up to {roomy:,} clients"
            reason = f"{hint}. fedguard says: {reason}"
        return reason
    return None


def measure(
    tool: str,
    clients: int,
    rounds: int,
    timeout: float = 3600.0,
    interval: float = 0.2,
    defense: str = "dgp",
    data: str = DATA,
) -> dict[str, Any]:
    """One run of ``tool`` ('fedguard' or 'bare') with ``clients`` clients for ``rounds`` rounds, ``defense``
    ('dgp' or 'none') and data set ``data``, in its own temporary folder (removed afterwards): its timing and
    peak memory, or why it failed."""
    if rounds < 2:
        raise ValueError("rounds must be >= 2: round 1 pays the start-up and is left out of the mean")
    if defense not in DEFENSES:
        raise ValueError(f"defense {defense!r}: choose one of {', '.join(DEFENSES)}")
    result: dict[str, Any] = {
        "tool": tool,
        "clients": clients,
        "rounds": rounds,
        "defense": defense,
        "data": data,
        "status": "failed",
        "load_average_before": round(os.getloadavg()[0], 2),
    }
    reason = refusal(clients, rounds, defense, data)
    if reason is not None:
        return {**result, "status": "refused", "error": reason}
    token = uuid.uuid4().hex
    memory = RunMemory(token, interval)
    folder = Path(tempfile.mkdtemp(prefix=f"scale-clients-{tool}-{clients}-"))
    began = time.perf_counter()
    try:
        rows = RUNNERS[tool](clients, rounds, folder, memory, timeout, token, defense, data)
        per_round = [float(r["seconds"]) for r in sorted(rows, key=lambda r: r["round"]) if r["round"] > 0]
        if len(per_round) < rounds:
            raise RunFailed(f"{len(per_round)} of {rounds} rounds recorded")
        steady = per_round[1:]
        seconds = sum(steady) / len(steady)
        result.update(
            status="ok",
            round_seconds=per_round,
            first_round_seconds=per_round[0],
            seconds_per_round=seconds,
            ms_per_client_step=1000 * seconds / clients,
            final_accuracy=rows[-1].get("accuracy"),
        )
    except RunFailed as failure:
        result["error"] = str(failure)
        print(f"[{tool}, {clients} clients] FAILED: {failure}\n{failure.log_tail}", file=sys.stderr, flush=True)
    except Exception as error:  # the benchmark goes on with the next run
        result["error"] = f"{type(error).__name__}: {error}"
        print(
            f"[{tool}, {clients} clients] FAILED: {result['error']}\n{_tail(*folder.glob('*.log'))}",
            file=sys.stderr,
            flush=True,
        )
    finally:
        result["wall_seconds"] = time.perf_counter() - began
        left = stop_leftovers(memory)
        if left:
            result["leftover_processes_stopped"] = left
        result.update(memory.summary())
        shutil.rmtree(folder, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------------------


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """fedguard / bare, per N where both ran: step time, peak PSS sum (``memory``), peak RSS sum, and the largest
    process by PSS and by RSS."""
    by = {(r["tool"], r["clients"]): r for r in results if r["status"] == "ok"}
    rows = []
    for clients in sorted({r["clients"] for r in results}):
        f, b = by.get(("fedguard", clients)), by.get(("bare", clients))
        if f and b:
            rows.append(
                {
                    "clients": clients,
                    "step_time": f["seconds_per_round"] / b["seconds_per_round"],
                    "memory": f["peak_pss_sum_gb"] / b["peak_pss_sum_gb"],
                    "memory_rss": f["peak_rss_sum_gb"] / b["peak_rss_sum_gb"],
                    "largest_process": f["peak_pss_max_gb"] / b["peak_pss_max_gb"],
                    "largest_process_rss": f["peak_rss_max_gb"] / b["peak_rss_max_gb"],
                }
            )
    return rows


def _setup(results: list[dict[str, Any]]) -> str:
    """'defense dgp, data mnist-5k' of the runs in ``results``."""
    seen = dict.fromkeys(f"defense {r.get('defense', '?')}, data {r.get('data', '?')}" for r in results)
    return "; ".join(seen)


def table(results: list[dict[str, Any]], clients: int) -> str:
    """The table of one N."""
    mine = [r for r in results if r["clients"] == clients]
    lines = [
        f"N = {clients} clients ({_setup(mine)})",
        f"  {'tool':<10} {'s/round':>9} {'ms/client step':>15} {'peak PSS sum GB':>16} {'peak RSS sum GB':>16} "
        f"{'largest PSS GB':>15} {'largest RSS GB':>15}  largest (PSS)",
    ]
    for r in mine:
        if r["status"] != "ok":
            lines.append(f"  {r['tool']:<10} {r['status'].upper():>9}  {r.get('error', '')[:200]}")
            continue
        note = "" if r.get("memory_measure", "PSS") == "PSS" else f"  [{r['memory_measure']}]"
        lines.append(
            f"  {r['tool']:<10} {r['seconds_per_round']:>9.3f} {r['ms_per_client_step']:>15.2f} "
            f"{r['peak_pss_sum_gb']:>16.2f} {r['peak_rss_sum_gb']:>16.2f} {r['peak_pss_max_gb']:>15.2f} "
            f"{r['peak_rss_max_gb']:>15.2f}  {r['largest_process']}{note}"
        )
    for q in ratios(mine):
        lines.append(
            f"  fedguard/bare: {q['step_time']:.2f}x step time, {q['memory']:.2f}x peak PSS sum "
            f"({q['memory_rss']:.2f}x RSS sum), {q['largest_process']:.2f}x largest process by PSS "
            f"({q['largest_process_rss']:.2f}x by RSS)"
        )
    return "\n".join(lines)


def summary_lines(results: list[dict[str, Any]]) -> list[str]:
    """One line per N: fedguard/bare of ms per client step and of peak PSS sum (or why there is no ratio)."""
    done = {q["clients"]: q for q in ratios(results)}
    lines = []
    for clients in sorted({r["clients"] for r in results}):
        mine = [r for r in results if r["clients"] == clients]
        q = done.get(clients)
        if q is not None:
            lines.append(
                f"N = {clients:>6}: fedguard/bare {q['step_time']:5.2f}x ms per client step, "
                f"{q['memory']:5.2f}x peak PSS  ({_setup(mine)})"
            )
        else:
            missing = ", ".join(f"{r['tool']} {r['status']}" for r in mine if r["status"] != "ok") or "one tool only"
            lines.append(f"N = {clients:>6}: no ratio ({missing})")
    return lines


def environment() -> dict[str, Any]:
    versions = {}
    for package in ("flwr", "ray", "torch"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    memory = next(
        (line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:")),
        "0",
    )
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gb": int(memory) * 1024 / GB,
        "machine": platform.machine(),
        **versions,
    }


def write_json(path: Path, results: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "scale_clients",
        "settings": settings,
        "environment": environment(),
        "results": results,
        "ratios": ratios(results),
    }
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(payload, indent=2) + "\n")
    temporary.replace(path)


def plot(path: Path, results: list[dict[str, Any]]) -> None:
    """Seconds per round and peak PSS (sum over the run's processes, and the largest process) against the number
    of clients (log x), one colour per tool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for tool, marker, color in zip(TOOLS, "os", ("tab:blue", "tab:orange")):
        done = sorted((r for r in results if r["tool"] == tool and r["status"] == "ok"), key=lambda r: r["clients"])
        if not done:
            continue
        xs = [r["clients"] for r in done]
        left.plot(xs, [r["seconds_per_round"] for r in done], marker=marker, color=color, label=tool)
        right.plot(xs, [r["peak_pss_sum_gb"] for r in done], marker=marker, color=color, label=f"{tool}: all processes")
        right.plot(
            xs,
            [r["peak_pss_max_gb"] for r in done],
            marker=marker,
            color=color,
            linestyle=":",
            label=f"{tool}: largest process",
        )
    for axis, title in ((left, "seconds per round (rounds 2..)"), (right, "peak PSS (GB)")):
        axis.set_xscale("log")
        axis.set_xlabel("clients (all train every round)")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    left.set_yscale("log")
    right.set_ylim(bottom=0)
    figure.suptitle(f"fedguard (FedSGD, MLP, batch 4; {_setup(results)}) vs bare Flower FedAvg, same step")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_benchmark(
    clients: list[int],
    rounds: int,
    tools: tuple[str, ...],
    out: Path,
    plot_path: Path | None,
    timeout: float = 3600.0,
    interval: float = 0.2,
    defense: str = "dgp",
    data: str = DATA,
) -> dict[str, Any]:
    """Every (N, tool) run, in order; the table of each N is printed as it completes, the JSON rewritten after
    every run, the plot drawn at the end. Returns the JSON's content."""
    settings = {
        "clients": clients,
        "rounds": rounds,
        "tools": list(tools),
        "defense": defense,
        "data": data,
        "timeout": timeout,
        "interval": interval,
        "fedguard_set": fedguard_overrides("N", rounds, defense, data),
        "bare_app": str(BARE_APP.relative_to(REPO)),
        "bare_run_config": {"defense": defense, "data-name": data},
        "memory": "peak of the sum of PSS (/proc/<pid>/smaps_rollup) over the run's processes; RSS where "
        "unreadable; RSS sum and largest process as secondary figures",
    }
    results: list[dict[str, Any]] = []
    for n in clients:
        residuals = residual_gb(n, data) if defense == "dgp" else None
        for tool in tools:
            print(f"== {tool}, {n} clients, {rounds} rounds, defense {defense}, data {data}", flush=True)
            if residuals is not None and residuals >= 0.5 and refusal(n, rounds, defense, data) is None:
                where = (
                    "in Context.state, held by the flwr-simulation process"
                    if tool == "bare"
                    else "in files under the run's temporary folder"
                )
                print(f"   DGP residuals: {residuals:.1f} GB in all ({where})", flush=True)
            result = measure(tool, n, rounds, timeout, interval, defense, data)
            if residuals is not None:
                result["dgp_residuals_gb"] = residuals
            results.append(result)
            if result["status"] == "ok":
                print(
                    f"   {result['seconds_per_round']:.3f} s/round (round 1: {result['first_round_seconds']:.2f} s), "
                    f"peak PSS {result['peak_pss_sum_gb']:.2f} GB (RSS {result['peak_rss_sum_gb']:.2f} GB), "
                    f"{result['wall_seconds']:.0f} s in all",
                    flush=True,
                )
            elif result["status"] == "refused":
                print(f"   refused: {result['error']}", flush=True)
            write_json(out, results, settings)
        print(table(results, n), flush=True)
    if plot_path is not None:
        plot(plot_path, results)
    return json.loads(out.read_text())


def _count_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated client counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("client counts must be >= 1")
    return values


def _tools(text: str) -> tuple[str, ...]:
    tools = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = set(tools) - set(TOOLS)
    if unknown or not tools:
        raise argparse.ArgumentTypeError(f"tools are {', '.join(TOOLS)}; got {text!r}")
    return tools


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--clients",
        type=_count_list,
        default=[10, 100, 1000],
        help="comma-separated numbers of clients (default 10,100,1000)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds per run, >= 2; the mean is over rounds 2.. (default 3)"
    )
    parser.add_argument(
        "--defense",
        choices=DEFENSES,
        default="dgp",
        help="the clients' defense on both sides: fedguard's defense.name and the bare app's "
        "(default dgp: Dual Gradient Pruning with error feedback)",
    )
    parser.add_argument(
        "--data",
        default=DATA,
        help=f"data set of both sides (fedguard's data.name; default {DATA}, 4,000 training "
        f"examples: at most 4,000 clients; {ROOMY_DATA} allows 60,000)",
    )
    parser.add_argument("--tools", type=_tools, default=TOOLS, help="fedguard,bare (default both)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take (default 3600)")
    parser.add_argument(
        "--interval",
        type=float,
        default=0.2,
        help="seconds between memory samples (default 0.2; longer where a sample would take over 10%% of a core)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "scale_clients.json", help="JSON results")
    parser.add_argument("--plot", type=Path, help="plot (default: --out with .png)")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2: round 1 pays the start-up and is left out of the mean")
    for n in args.clients:  # said up front; the runs are recorded as refused
        reason = refusal(n, args.rounds, args.defense, args.data)
        if reason is not None:
            print(f"N = {n} clients cannot run: {reason}", file=sys.stderr, flush=True)
    plot_path = args.plot or args.out.with_suffix(".png")
    payload = run_benchmark(
        args.clients, args.rounds, args.tools, args.out, plot_path, args.timeout, args.interval, args.defense, args.data
    )
    print("\n" + "\n\n".join(table(payload["results"], n) for n in args.clients))
    print("\nfedguard / bare, per N:\n" + "\n".join(summary_lines(payload["results"])))
    print(f"\nresults: {args.out}\nplot: {plot_path}")
    return 0 if all(r["status"] == "ok" for r in payload["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
