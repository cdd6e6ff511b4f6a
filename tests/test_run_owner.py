"""The owners a run belongs to (``fedguard.run_owner``): a chain that each starter extends, any dead member of
which makes ``gone`` true, and a row writer that ends itself rather than write a row once an owner is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedguard import run_owner
from fedguard.runtime import lifeline

# A child that prints the owner chain it was given and the chain it would give its own children.
CHAIN = (
    "import json, os; from fedguard import run_owner; "
    "print(json.dumps([os.environ.get(run_owner.OWNER_ENV, ''), run_owner.owner_entry()[run_owner.OWNER_ENV]]))"
)
# A child that appends one row to a rounds log named on its command line.
APPEND = (
    "import sys; from pathlib import Path; from fedguard.store.folder import JsonlAppender; "
    "JsonlAppender(Path(sys.argv[1])).append({'round': 1})"
)


def dead_entry() -> str:
    """The owner entry of a process that has ended (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", CHAIN], stdout=subprocess.PIPE, text=True, env=os.environ)
    _, entry = json.loads(child.communicate()[0])
    return str(entry.rsplit(",", 1)[-1])


def test_each_starter_extends_the_chain_its_children_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(run_owner.OWNER_ENV, raising=False)
    mine = run_owner.owner_entry()[run_owner.OWNER_ENV]
    assert mine.startswith(f"{os.getpid()}:") and lifeline.tied()[run_owner.OWNER_ENV] == mine
    child = subprocess.run(
        [sys.executable, "-c", CHAIN], capture_output=True, text=True, env={**os.environ, **lifeline.tied()}, check=True
    )
    given, passed_on = json.loads(child.stdout)
    assert given == mine
    assert passed_on.startswith(f"{mine},") and len(passed_on.split(",")) == 2  # this process, then the child


def test_gone_once_any_owner_of_the_chain_died(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = run_owner.owner_entry()[run_owner.OWNER_ENV].rsplit(",", 1)[-1]
    dead = dead_entry()
    monkeypatch.delenv(run_owner.OWNER_ENV, raising=False)
    assert not run_owner.gone()  # a process of no run
    monkeypatch.setenv(run_owner.OWNER_ENV, mine)
    assert not run_owner.gone()
    for chain in (dead, f"{dead},{mine}", f"{mine},{dead}"):
        monkeypatch.setenv(run_owner.OWNER_ENV, chain)
        assert run_owner.gone(), chain
    pid, _, started = mine.partition(":")
    monkeypatch.setenv(run_owner.OWNER_ENV, f"{pid}:{int(started) + 1}")  # a later holder of a live pid
    assert run_owner.gone()


def test_a_row_writer_ends_itself_once_an_owner_is_gone(tmp_path: Path) -> None:
    log = tmp_path / "rounds.jsonl"
    mine = run_owner.owner_entry()[run_owner.OWNER_ENV].rsplit(",", 1)[-1]
    alive = subprocess.run([sys.executable, "-c", APPEND, str(log)], env={**os.environ, run_owner.OWNER_ENV: mine})
    assert alive.returncode == 0 and log.read_text() == '{"round": 1}\n'
    chain = f"{mine},{dead_entry()}"
    orphan = subprocess.run([sys.executable, "-c", APPEND, str(log)], env={**os.environ, run_owner.OWNER_ENV: chain})
    assert orphan.returncode == -signal.SIGKILL
    assert log.read_text() == '{"round": 1}\n'  # no row from the orphan
