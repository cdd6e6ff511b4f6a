"""Objects shipped to other processes are rebuilt from this app's code, not from a copy earlier on their path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ray import cloudpickle

from fedguard.app_code import Call, app_root
from fedguard.runtime.client_app import make_client_app

ROOT = Path(__file__).resolve().parents[1]

UNPICKLE = """
import pickle, sys
sys.path.insert(0, sys.argv[1])  # as a Ray worker puts its driver's folder first
call, client_app = pickle.loads(sys.stdin.buffer.read())
print(call())
print(sys.modules["fedguard.runtime.client_app"].__file__)
print(type(client_app).__name__, callable(client_app))
"""


def test_a_worker_rebuilds_shipped_objects_from_the_app_and_not_from_the_folder_first_on_its_path(
    tmp_path: Path,
) -> None:
    stale = tmp_path / "stale"
    for package in ("fedguard", "attackers", "clients", "strategies"):
        (stale / package).mkdir(parents=True)
        (stale / package / "__init__.py").write_text(f"raise ImportError('{package} of the stale copy')\n")
    payload = cloudpickle.dumps((Call(app_root), make_client_app()))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", UNPICKLE, str(stale)],
        input=payload,
        cwd=stale,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    root, module, client_app = result.stdout.decode().splitlines()
    assert root == str(ROOT) == app_root()
    assert module == str(ROOT / "fedguard" / "runtime" / "client_app.py")
    assert client_app == "ShippedClientApp True"
