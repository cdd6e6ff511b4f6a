"""The command line: help, configuration errors before anything starts, config listing."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedguard.commands.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_help_documents_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fedguard", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("run", "config"):
        assert command in out
    run_help = subprocess.run(
        [sys.executable, "-m", "fedguard", "run", "--help"], capture_output=True, text=True
    ).stdout
    assert "--set" in run_help and "--out" in run_help and "preset" in run_help


def test_no_help_names_an_internal_module() -> None:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in [("fedguard", parser), *commands.choices.items()]:
        text = " ".join(command.format_help().split())
        assert not re.search(r"``|\b(fedguard|attackers|clients|strategies)\.[a-z_]", text), (name, text)


def test_bad_override_fails_fast_with_the_problem(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["run", "--set", "train.rounds=0", "--set", "model.name=vgg", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2
    assert "train.rounds = 0" in err and "'vgg'" in err and "resnet18" in err
    assert not (tmp_path / "r").exists(), "nothing may start on a bad configuration"


def test_missing_dataset_fails_fast(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["run", "--set", "data.name=cifar10", "--set", f"data.root={tmp_path}", "--out", str(tmp_path / "r")])
    assert code == 2 and "cifar-10-batches-py" in capsys.readouterr().err


def test_config_prints_resolved_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", str(ROOT / "experiments" / "quickstart.toml"), "--set", "train.rounds=3"]) == 0
    out = capsys.readouterr().out
    assert 'name = "quickstart"' in out and "train.rounds = 3" in out
    assert main(["config", "--keys"]) == 0
    assert "model.convnet.width = 64" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_train_mjolnir_refuses_cuda_where_there_is_none(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(
        [
            "train-mjolnir",
            "--set",
            "data.name=digits",
            "--set",
            "model.name=mlp",
            "--gradients",
            "4",
            "--epochs",
            "1",
            "--device",
            "cuda",
            "--out",
            str(tmp_path / "d.npz"),
        ]
    )
    assert code == 2 and "device 'cuda' asked for, but CUDA is not available here" in capsys.readouterr().err
    assert not (tmp_path / "d.npz").exists()


def test_a_plan_that_is_not_the_one_written_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tests.helpers import config

    plan = tmp_path / "plan.json"
    text = config().plan()
    assert '"train.rounds": 20' in text
    plan.write_text(text.replace('"train.rounds": 20', '"train.rounds": 200'))
    assert main(["run", "--plan", str(plan), "--out", str(tmp_path / "run")]) == 2
    assert "its keys do not match their sha256 digest" in capsys.readouterr().err
    assert main(["run", "--plan", str(tmp_path / "absent.json")]) == 2
    assert f"--plan {tmp_path / 'absent.json'}: cannot be read" in capsys.readouterr().err
    assert main(["run", str(ROOT / "experiments" / "quickstart.toml"), "--plan", str(plan)]) == 2
    assert "drop the preset, --set and --resume" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing was started"
