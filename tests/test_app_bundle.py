"""The staged app folder holds exactly the files Flower's own walk puts in the app's FAB, and builds the same FAB."""

from __future__ import annotations

import hashlib
from pathlib import Path

from flwr.cli.build import build_fab_from_disk
from flwr.cli.utils import collect_files, filter_paths_for_publish

from fedguard.runtime.app_bundle import app_files, stage_app
from fedguard.runtime.simulation import APP_DIR

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "demo"
version = "1.0.0"
dependencies = ["flwr>=1.41"]

[tool.flwr.app]
publisher = "demo"

[tool.flwr.app.components]
serverapp = "demo.server:app"
clientapp = "demo.client:app"

[tool.flwr.app.config]
rounds = 1
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _flower_selection(root: Path) -> set[str]:
    return set(filter_paths_for_publish(collect_files(root.resolve())))


def test_the_selection_is_flowers_own_on_ignored_excluded_and_reincluded_paths(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pyproject.toml": PYPROJECT,
            ".gitignore": "runs/\n/keys/*\n!/keys/generate.py\n*.log\n",
            "demo/server.py": "app = None\n",
            "demo/client.py": "app = None\n",
            "demo/__pycache__/server.cpython-311.pyc": "x",
            "demo/data.bin": "not a FAB file",
            "runs/row.json": "{}",
            "keys/generate.py": "print()\n",
            "keys/secret.py": "key = 1\n",
            ".venv/lib/site.py": "",
            "notes/a.md": "# a\n",
            "notes/run.log": "",
        },
    )
    (tmp_path / "demo" / "link.py").symlink_to(tmp_path / "demo" / "server.py")

    selected = set(app_files(tmp_path))

    assert selected == _flower_selection(tmp_path)
    assert {"keys/generate.py", "demo/server.py", "notes/a.md", ".gitignore"} <= selected
    assert not selected & {"keys/secret.py", "runs/row.json", ".venv/lib/site.py", "demo/link.py"}


def test_the_staged_checkout_builds_the_checkouts_fab(tmp_path: Path) -> None:
    """On this checkout (its virtual environment inside it where `make install` put it)."""
    staged = stage_app(APP_DIR, tmp_path / "app")

    assert set(app_files(APP_DIR)) == _flower_selection(APP_DIR)
    digest = [hashlib.sha256(build_fab_from_disk(folder)).hexdigest() for folder in (staged, APP_DIR)]
    assert digest[0] == digest[1]
