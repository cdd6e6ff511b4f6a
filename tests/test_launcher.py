"""The process that waits for a ``fedguard run`` is light: the launcher imports neither torch nor Flower, and a
launch survives its round trip through the file ``fedguard run`` hands over."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fedguard.runtime.launcher import Launch, main


def test_the_launcher_imports_neither_torch_nor_flower_nor_numpy() -> None:
    probe = (
        "import sys, fedguard.runtime.launcher; heavy = sorted({'torch', 'flwr', 'numpy', 'ray'} & set(sys.modules));"
        " print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_launch_round_trips_through_its_file(tmp_path: Path) -> None:
    plan = Launch("/app", str(tmp_path / "run"), str(tmp_path), {"A": "1"}, "num-supernodes=3", True, 12.5)
    assert Launch.load(plan.save()) == plan


def test_the_launcher_without_its_file_says_how_it_is_called(capsys) -> None:
    assert main([]) == 2
    assert "usage: python -m fedguard.runtime.launcher LAUNCH_JSON" in capsys.readouterr().err
