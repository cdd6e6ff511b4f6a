"""A plugin that raises, exits or hangs is named with its module and line: on import (a deadline), inside the run
(the ServerApp stops, ``status.json`` names the plugin and ``fedguard run`` exits 2), and when a stop finds the
ServerApp still running a plugin's code."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

import fedguard.config as config_module
import fedguard.runtime.stuck_plugin as stuck_plugin
from fedguard.plugin_faults import PluginFailure, raising_plugin, running_plugin
from fedguard.report.run_status import read_status, write_status
from fedguard.runtime.client_app import make_client_app
from fedguard.runtime.launcher import ending, exit_code
from fedguard.runtime.server_app import run_server
from fedguard.runtime.stopping import StopRequest
from tests.helpers import config
from tests.local_grid import LocalGrid

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "tests.hostile_strategy"

PLUGIN_CODE = """
import json
import threading

def parse(text):
    return json.loads(text)

def wrapped(text):
    try:
        return parse(text)
    except ValueError as error:
        raise RuntimeError("wrapped by the caller") from error

def block(started, release):
    started.set()
    release.wait(30)
"""


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A plugin module written to ``tmp_path`` and imported as ``faulty_plugin``."""
    (tmp_path / "faulty_plugin.py").write_text(PLUGIN_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "faulty_plugin", raising=False)
    return importlib.import_module("faulty_plugin")


def test_an_error_is_blamed_on_the_innermost_plugin_line_that_raised_it(plugin: ModuleType) -> None:
    with pytest.raises(ValueError) as raised:
        plugin.parse("not json")
    frame = raising_plugin(raised.value, ["faulty_plugin"])
    assert frame is not None and frame.module == "faulty_plugin" and frame.function == "parse"
    line = PLUGIN_CODE.splitlines().index("    return json.loads(text)") + 1
    assert frame.file == plugin.__file__ and frame.line == line
    # An error raised outside the plugin's code, or with no plugin loaded, is nobody's.
    with pytest.raises(ValueError) as elsewhere:
        int("x")
    assert raising_plugin(elsewhere.value, ["faulty_plugin"]) is None
    assert raising_plugin(raised.value, ["not_imported_here"]) is None


def test_an_error_whose_cause_the_plugin_raised_is_blamed_on_it(plugin: ModuleType) -> None:
    with pytest.raises(RuntimeError) as raised:
        plugin.wrapped("not json")
    outer = RuntimeError("fedguard's wrapper")
    outer.__cause__ = raised.value.__cause__
    frame = raising_plugin(outer, ["faulty_plugin"])
    assert frame is not None and frame.function == "parse"


def test_a_plugin_failure_says_what_it_raised_or_that_it_exited(plugin: ModuleType) -> None:
    with pytest.raises(ValueError) as raised:
        plugin.parse("x")
    frame = raising_plugin(raised.value, ["faulty_plugin"])
    assert frame is not None
    assert str(PluginFailure(frame, raised.value)).startswith(
        "server.plugins module 'faulty_plugin' raised JSONDecodeError: Expecting value"
    )
    assert f"(at {plugin.__file__}:{frame.line} in parse)" in str(PluginFailure(frame, raised.value))
    assert "called sys.exit(3)" in str(PluginFailure(frame, SystemExit(3)))


def test_the_plugin_line_a_thread_is_running_is_found(plugin: ModuleType) -> None:
    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=plugin.block, args=(started, release))
    worker.start()
    try:
        assert started.wait(10)
        frame = running_plugin(sys._current_frames()[worker.ident or 0], ["faulty_plugin"])
        assert frame is not None and frame.function == "block"
        assert running_plugin(sys._current_frames()[threading.get_ident()], ["faulty_plugin"]) is None
    finally:
        release.set()
        worker.join()


def test_a_plugin_whose_import_hangs_is_refused_within_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hanging_plugin.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(config_module, "PLUGIN_IMPORT_SECONDS", 0.5)
    handler, before = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0]
    started = time.monotonic()
    problems = config_module.import_plugins({"server.plugins": "hanging_plugin"})
    assert time.monotonic() - started < 10
    assert problems == [
        "server.plugins = 'hanging_plugin': importing 'hanging_plugin' did not end within 0.5 s; a plugin registers "
        "components and must not block"
    ]
    # The caller's own handler and timer (pytest-timeout's, where it runs) are put back, less the time spent.
    after = signal.getitimer(signal.ITIMER_REAL)[0]
    assert signal.getsignal(signal.SIGALRM) is handler
    assert (after == 0.0) if before == 0.0 else (before - 10 < after < before)
    assert "hanging_plugin" not in sys.modules


@pytest.mark.parametrize(
    ("strategy", "said"),
    [
        ("raising-fedavg", "raised RuntimeError: the plugin's aggregation broke in round 2"),
        ("exiting-fedavg", "called sys.exit(0)"),
    ],
)
def test_a_plugin_strategy_failing_inside_the_run_stops_it_naming_the_plugin(
    tmp_path: Path, strategy: str, said: str
) -> None:
    folder = tmp_path / "run"
    cfg = config(
        "train.rounds=3",
        "capture.rounds=none",
        f"server.plugins={PLUGIN}",
        f"server.strategy={strategy}",
        "train.protocol=fedavg",
        f"out-dir={folder}",
    )
    with pytest.raises(PluginFailure) as failure:
        run_server(LocalGrid(make_client_app(cfg), cfg.partition.num_clients), cfg)
    at = f"(at {ROOT / 'tests' / 'hostile_strategy.py'}:"
    assert str(failure.value).startswith(f"server.plugins module '{PLUGIN}' {said} {at}")
    status = read_status(folder)
    assert status is not None and status["status"] == "failed" and status["plugin"] == PLUGIN
    assert status["error"] == str(failure.value) and status["rounds"] == 1
    assert (folder / "report.html").is_file()
    # fedguard run's launcher reads that ending as a plugin's failure: exit 2, the reason on stderr.
    assert exit_code(lambda: ending(folder, None), time.time()) == 2


def test_a_run_failing_in_fedguard_s_own_code_still_exits_1(tmp_path: Path) -> None:
    write_status(tmp_path, "failed", 1, "RuntimeError: not a plugin's")
    assert exit_code(lambda: ending(tmp_path, None), time.time()) == 1


def test_a_stop_that_finds_the_server_in_a_plugin_s_code_names_it(
    plugin: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stuck_plugin, "STUCK_AFTER", 0.2)
    monkeypatch.setattr(stuck_plugin, "POLL_SECONDS", 0.05)
    stop, started, release = StopRequest(), threading.Event(), threading.Event()

    def server() -> None:  # the ServerApp's thread: starts the watcher, then blocks in the plugin
        stuck_plugin.watch_for_stuck_plugin(stop, ["faulty_plugin"], tmp_path, lambda: 4)
        plugin.block(started, release)

    thread = threading.Thread(target=server)
    thread.start()
    try:
        assert started.wait(10)
        stop.request("stopped by SIGINT")
        deadline = time.monotonic() + 10
        while read_status(tmp_path) is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        release.set()
        thread.join()
    status = read_status(tmp_path)
    assert status is not None and status["status"] == "interrupted" and status["plugin"] == "faulty_plugin"
    assert status["rounds"] == 4
    assert status["error"].startswith(
        f"stopped by SIGINT while server.plugins module 'faulty_plugin' was running (at {plugin.__file__}:"
    )


def test_a_run_that_ends_in_time_after_a_stop_is_not_blamed_on_a_plugin(tmp_path: Path, plugin: ModuleType) -> None:
    stop = StopRequest()
    ended = stuck_plugin.watch_for_stuck_plugin(stop, ["faulty_plugin"], tmp_path, lambda: 0)
    stop.request("stopped by SIGINT")
    ended.set()
    time.sleep(2 * stuck_plugin.POLL_SECONDS)
    assert read_status(tmp_path) is None


@pytest.mark.slow
def test_fedguard_run_exits_2_naming_a_plugin_that_raises_inside_the_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [str(Path(sys.executable).parent / "fedguard"), "run", "--out", str(out)]
    for setting in (
        "data.name=digits",
        "model.name=mlp",
        "model.mlp.hidden=16",
        "partition.num-clients=2",
        "train.clients-per-round=2",
        "train.protocol=fedavg",
        "train.rounds=3",
        "capture.rounds=none",
        f"server.plugins={PLUGIN}",
        "server.strategy=raising-fedavg",
    ):
        command += ["--set", setting]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    assert f"fedguard: the run ended as 'failed': server.plugins module '{PLUGIN}' raised RuntimeError" in output
    status = read_status(out)
    assert status is not None and status["plugin"] == PLUGIN and status["rounds"] == 1
