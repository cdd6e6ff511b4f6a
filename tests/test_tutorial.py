"""The tutorial's commands as a user types them: every ```bash block of docs/tutorial.md, in order.

The fast tests read the page: each command splits as a shell splits it, names a program the tutorial may use,
parses with fedguard's own argument parser, and its configuration validates (a preset with its --set
overrides; for `fedguard attack`, the run folder an earlier command made, with the attack's overrides). The slow
test types every command in a fresh folder that holds the checkout's experiments/, as a user's checkout does,
with the venv's programs first on PATH."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fedguard.commands.cli import build_parser
from fedguard.config import load_config, schema

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
PROGRAMS = {"fedguard", "python", "cat", "ls", "tail", "grep"}
BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SEPARATORS = {"|", "&&", ";"}


def commands(markdown: str) -> list[str]:
    """The commands of every ```bash block, in order: a line ending in a backslash joined with the next, blank
    lines and comments left out."""
    found = []
    for block in BLOCK.findall(markdown):
        pending = ""
        for line in block.splitlines():
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1].rstrip() + " "
                continue
            command = (pending + line.strip()).strip()
            pending = ""
            if command and not command.startswith("#"):
                found.append(command)
        assert not pending, f"a command ends in a backslash at the end of its block: {pending}"
    return found


def pipeline(command: str) -> list[list[str]]:
    """``command``'s programs with their arguments, as the shell splits them (pipes and lists separate them)."""
    parts: list[list[str]] = [[]]
    for token in shlex.split(command, comments=True):
        if token in SEPARATORS:
            parts.append([])
        else:
            parts[-1].append(token)
    assert all(parts), f"an empty command in {command!r}"
    return parts


def test_the_tutorial_shows_a_run_a_defense_and_an_attack() -> None:
    text = TUTORIAL.read_text()
    assert re.findall(r"^## \d\. .*$", text, re.MULTILINE) == [
        "## 1. First run",
        "## 2. First defense",
        "## 3. First attack",
    ]
    shown = commands(text)
    assert any(c.startswith("fedguard run ") and "defense.name=" not in c for c in shown)
    assert any(c.startswith("fedguard run ") and "defense.name=" in c for c in shown)
    assert any(c.startswith("fedguard attack ") for c in shown)


def test_the_extraction_joins_continued_lines_and_skips_comments() -> None:
    page = "text\n```bash\n# a comment\nfedguard run a.toml \\\n    --set x=1\n\ncat b\n```\n```text\nnot run\n```\n"
    assert commands(page) == ["fedguard run a.toml --set x=1", "cat b"]
    assert pipeline("fedguard config --keys | grep '^defense\\.dgp\\.'") == [
        ["fedguard", "config", "--keys"],
        ["grep", "^defense\\.dgp\\."],
    ]


def test_every_tutorial_command_parses_and_its_configuration_validates() -> None:
    parser = build_parser()
    runs: dict[str, tuple[str | None, list[str]]] = {}  # run folder -> preset and overrides of the command that made it
    for command in commands(TUTORIAL.read_text()):
        listed: list[str] = []  # what the last `fedguard config` of the pipeline prints, for a grep after it
        for argv in pipeline(command):
            program, args = argv[0], argv[1:]
            assert program in PROGRAMS, f"{command}: {program} is not a program the tutorial may use"
            if program == "python":
                assert args[0] == "-c", command
                compile(args[1], "<tutorial>", "exec")
                for folder in re.findall(r"open_run\('([^']+)'\)", args[1]):
                    assert folder in runs, f"{command}: {folder} is made by no earlier command"
            elif program == "grep":
                pattern = next(a for a in args if not a.startswith("-"))
                assert listed and any(re.search(pattern, line) for line in listed), f"{command}: grep finds nothing"
            elif program in ("cat", "ls", "tail"):
                paths = [a for a in args if not a.startswith("-") and not a.isdigit()]
                for path in paths:
                    assert any(path == f or path.startswith(f + "/") for f in runs), f"{command}: {path} is no run's"
            else:
                options = parser.parse_args(args)
                if options.command in ("run", "config"):
                    preset = str(ROOT / options.preset) if options.preset else None
                    assert preset is None or Path(preset).is_file(), f"{command}: no preset {options.preset}"
                    if options.command == "config" and options.keys:
                        listed = [f"{key} = {json.dumps(default)}" for key, (_, default, _) in schema().items()]
                        continue
                    config = load_config(preset, options.overrides)  # raises ConfigError, naming every problem
                    listed = [f"{key} = {json.dumps(value)}" for key, value in config.to_flat().items()]
                    if options.command == "run":
                        assert options.out is not None, f"{command}: the tutorial names its run folders (--out)"
                        runs[str(options.out)] = (preset, options.overrides)
                elif options.command == "attack":
                    folder = str(options.capture_dir)
                    assert folder in runs, f"{command}: {folder} is made by no earlier command"
                    preset, overrides = runs[folder]
                    config = load_config(preset, [*overrides, *options.overrides])
                    assert config.attacks, f"{command}: no attack chosen"
                else:
                    pytest.fail(f"{command}: the tutorial shows only fedguard run, config and attack")
    assert runs, "the tutorial makes no run"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_tutorial_command_runs_as_a_user_types_it(tmp_path: Path) -> None:
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "VIRTUAL_ENV": str(bin_dir.parent),
    }
    for command in commands(TUTORIAL.read_text()):
        result = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"$ {command}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        print(f"$ {command}\n{result.stdout[-2000:]}")
    # What the page says the reader will find.
    runs = tmp_path / "runs"
    for name in ("tutorial-none", "tutorial-dgp"):
        assert json.loads((runs / name / "status.json").read_text())["status"] == "completed"
        assert len(list((runs / name / "observations").glob("*.npz"))) == 3
    last = json.loads((runs / "tutorial-dgp" / "rounds.jsonl").read_text().splitlines()[-1])
    assert last["upload_bytes"] < 0.3 * last["dense_bytes"], last
    rows = [json.loads(line) for line in (runs / "tutorial-dgp" / "attacks.jsonl").read_text().splitlines()]
    assert sorted((r["attack"], r["status"]) for r in rows) == [("ig", "ok")] * 3 + [("ig-adaptive", "ok")] * 3
