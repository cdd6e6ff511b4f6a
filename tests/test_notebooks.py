"""The notebooks in notebooks/ run end to end at small size (``FEDGUARD_NOTEBOOK_SIZE=small``) in a fresh
kernel, and are kept in the repository without outputs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_kept_without_outputs() -> None:
    assert [path.name for path in NOTEBOOKS] == ["01-first-attack.ipynb", "02-compare-defenses.ipynb"]
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        code = [cell for cell in notebook.cells if cell.cell_type == "code"]
        assert all(not cell.outputs and cell.execution_count is None for cell in code), f"{path.name}: strip outputs"


def printed(notebook: nbformat.NotebookNode) -> str:
    return "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )


def images(notebook: nbformat.NotebookNode) -> int:
    return sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    # Every notebook is heavy (67 s and 114 s on 2 cores): `make test` runs them, CI does not.
    [pytest.param(path, marks=pytest.mark.heavy) for path in NOTEBOOKS],
    ids=[path.stem for path in NOTEBOOKS],
)
def test_a_notebook_runs_end_to_end_at_small_size(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDGUARD_NOTEBOOK_SIZE", "small")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # this venv's kernel
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = printed(notebook)
    if path.stem == "01-first-attack":
        assert text.count("ig-adaptive") >= 1 and "psnr" in text and images(notebook) == 2, text[-2000:]
        undefended = tmp_path / "runs" / "nb-undefended"
        assert (undefended / "report.html").is_file()
        rows = [json.loads(line) for line in (undefended / "attacks.jsonl").read_text().splitlines()]
        own = [row for row in rows if row["invocation"] == "run"]
        assert len(own) == 1 and own[0]["ssim"] >= 0.8, own  # the undefended digits come back at small size
        assert [row["invocation"] for row in rows[1:]] == ["attack-1", "attack-2", "attack-3"], rows
        pruned = (tmp_path / "runs" / "nb-pruned" / "attacks.jsonl").read_text().splitlines()
        budget = ("iterations", "restarts", "tv")
        budgets = {row["attack"]: {k: row["attack_params"][k] for k in budget} for row in map(json.loads, pruned)}
        assert budgets["ig"] == budgets["ig-adaptive"], budgets  # the two attacks compare on equal terms
    else:
        assert "prune" in text and "privacy.ssim_mean" in text and images(notebook) == 2, text[-2000:]
        assert (tmp_path / "runs" / "nb-defenses" / "sweep.html").is_file()
