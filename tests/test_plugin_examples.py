"""The plugin examples of ``extensions/`` that the how-tos build: each module is the how-to's code as printed, does
what it says (its exact mathematics), and runs through a three-round run in process as ``server.plugins``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attackers.manipulation import build_manipulation
from extensions.norm_jump import KEY, NormJumpParams, build_norm_jump
from extensions.scaled_layer import ScaledLayerParams
from fedguard.detect import Received
from fedguard.runtime.client_app import make_client_app
from fedguard.runtime.server_app import run_server
from fedguard.training import get_arrays, set_arrays
from tests.helpers import config
from tests.local_grid import LocalGrid
from tests.untrained import untrained_mlp

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "sign_upload": "defense-plugin.md",
    "scaled_layer": "manipulation-plugin.md",
    "norm_jump": "detector-plugin.md",
}


@pytest.mark.parametrize(("module", "page"), EXAMPLES.items())
def test_each_how_to_prints_its_example_module_as_it_is(module: str, page: str) -> None:
    source = (ROOT / "extensions" / f"{module}.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "how-to" / page).read_text(), re.S)
    assert source in blocks, f"docs/how-to/{page} does not print extensions/{module}.py as it is"


def in_process_run(tmp_path: Path, *settings: str) -> Path:
    """A three-round FedSGD run of 4 clients on digits (the MLP of 16 units) with ``settings``, in this process
    (``LocalGrid``), client 0 captured in round 2; its folder."""
    folder = tmp_path / "run"
    cfg = config("train.rounds=3", "capture.rounds=2", "capture.clients=0", f"out-dir={folder}", *settings)
    run_server(LocalGrid(make_client_app(cfg), cfg.partition.num_clients), cfg)
    assert json.loads((folder / "status.json").read_text())["status"] == "completed"
    return folder


def round_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]


def test_the_sign_defense_uploads_the_scaled_sign_of_every_entry(tmp_path: Path) -> None:
    folder = in_process_run(
        tmp_path, "server.plugins=extensions.sign_upload", "defense.name=sign", "defense.sign.scale=0.02"
    )
    with np.load(folder / "observations" / "round-0002_client-0000.npz") as observation:
        uploads = [observation[key] for key in observation.files if key.startswith("upload/")]
    entries = np.concatenate([u.ravel() for u in uploads])
    assert len(entries) > 1000 and set(np.unique(entries).tolist()) <= set(np.float32([-0.02, 0.0, 0.02]).tolist())
    assert np.mean(entries != 0) > 0.5  # the signs, not a zero upload
    with pytest.raises(ValueError, match=r"scale = 0\.0: must be > 0"):
        config("server.plugins=extensions.sign_upload", "defense.name=sign", "defense.sign.scale=0")


def test_the_scaled_layer_manipulation_multiplies_that_weight_only() -> None:
    _, _, arrays, card = untrained_mlp("digits")
    sent = build_manipulation("scaled-layer", ScaledLayerParams(layer=1, factor=-3.0))(
        arrays, card, np.random.default_rng(0)
    )
    weights = [i for i, a in enumerate(arrays) if a.ndim >= 2]
    for i, (before, after) in enumerate(zip(arrays, sent)):
        assert after.dtype == before.dtype and after.shape == before.shape
        np.testing.assert_array_equal(after, before * -3.0 if i == weights[1] else before)
    with pytest.raises(ValueError, match=r"layer = 9: this model has \d+ weights"):
        build_manipulation("scaled-layer", ScaledLayerParams(layer=9))(arrays, card, np.random.default_rng(0))


def test_the_norm_jump_detector_flags_a_norm_beyond_its_ratio_of_the_last_accepted_one() -> None:
    _, model, arrays, _ = untrained_mlp("digits")
    detector, state = build_norm_jump(NormJumpParams(ratio=1.5)), {}
    x, y = torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.int64)

    def received(scale: float) -> Received:
        set_arrays(model, [a * scale if a.ndim >= 2 else a for a in arrays])
        return Received(model, x, y, torch.nn.functional.cross_entropy)

    first = detector(received(1.0), state)
    assert not first.flagged and first.scores["jump"] == 1.0  # nothing to compare with yet
    detector.remember(received(1.0), state)
    assert float(state[KEY]) == pytest.approx(first.scores["norm"])
    assert not detector(received(1.4), state).flagged
    assert detector(received(1.4), state).scores["jump"] == pytest.approx(1.4)
    assert detector(received(1.6), state).flagged and detector(received(0.6), state).flagged
    assert get_arrays(model)[0].shape == arrays[0].shape


def test_the_norm_jump_detector_flags_the_round_the_scaled_layer_manipulates(tmp_path: Path) -> None:
    folder = in_process_run(
        tmp_path,
        "server.plugins=extensions.scaled_layer,extensions.norm_jump",
        "threat.malicious=2:scaled-layer",
        "detect.name=norm-jump",
        "detect.action=report",
    )
    flagged = {row["round"]: [f["flagged"] for f in row["detect"]] for row in round_rows(folder)[1:]}
    assert flagged[1] == [0.0, 0.0, 0.0] and flagged[2] == [1.0, 1.0, 1.0]
    jumps = [f["norm-jump.jump"] for f in round_rows(folder)[2]["detect"]]
    assert all(j > 1.5 for j in jumps)
    with np.load(folder / "observations" / "round-0002_client-0000.npz") as observation:
        assert json.loads(str(observation["meta"]))["manipulation"] == "scaled-layer"
