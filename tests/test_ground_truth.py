"""Where clients write ground truth: only where their own configuration says, never where the server says.

On a SuperNode nothing is written unless its node config opts in with ``vault-dir``; in a simulation (one
party runs the server and every client) the truth goes to the vault of the run's folder, which the clients
resolve as the ServerApp does.
A folder named in a train instruction is never written to.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context
from flwr.serverapp.strategy import FedAvg

from fedguard.config import Config
from fedguard.data import load_dataset
from fedguard.models import build_model
from fedguard.runtime import client_app
from fedguard.runtime.client_app import VAULT_DIR_KEY, in_simulation, make_client_app, truth_vault
from fedguard.runtime.server_app import under_runs_home
from fedguard.store.folder import VAULT_DIR
from fedguard.training import get_arrays
from fedguard.wire.records import array_record
from tests.helpers import config, context
from tests.local_grid import LocalGrid

SERVER_SENT_KEY = "vault"  # the key under which a server's train instruction names a vault folder


def files_under(folder: Path) -> list[str]:
    """Every file below ``folder``, relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def train_round(cfg: Config, server_sent: Path, node_config: dict[str, str] | None = None) -> None:
    """Round 1 of ``cfg`` on four in-process nodes, whose train instructions name ``server_sent`` as the vault
    and whose node configs add ``node_config``."""
    grid = LocalGrid(make_client_app(cfg), cfg.partition.num_clients)
    for ctx in grid.contexts.values():
        ctx.node_config.update(node_config or {})
    model = build_model(cfg.model.name, load_dataset(cfg.data.name).spec, cfg.model.params)
    instruction = ConfigRecord({SERVER_SENT_KEY: str(server_sent)})
    messages = FedAvg(min_train_nodes=4).configure_train(
        1, array_record(list(model.state_dict()), get_arrays(model)), instruction, grid
    )
    replies = list(grid.send_and_receive(messages))
    assert replies and not any(m.has_error() for m in replies), [m.error for m in replies if m.has_error()]


def test_a_node_that_opted_in_writes_under_its_own_folder_never_the_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    mine, theirs = tmp_path / "mine", tmp_path / "server-named"
    train_round(config("capture.clients=0,2"), theirs, {VAULT_DIR_KEY: str(mine)})
    assert not theirs.exists()
    assert files_under(mine) == ["run-1/round-0001_client-0000.npz", "run-1/round-0001_client-0002.npz"]
    assert files_under(tmp_path) == [f"mine/{name}" for name in files_under(mine)]


def test_outside_simulation_a_node_that_did_not_opt_in_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = config("capture.ground-truth=true", f"out-dir={tmp_path / 'run'}")
    train_round(cfg, tmp_path / "server-named")
    assert not in_simulation()
    assert files_under(tmp_path) == []


def test_in_simulation_the_truth_goes_to_the_run_folder_out_dir_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(client_app, "in_simulation", lambda: True)
    run, theirs = tmp_path / "run", tmp_path / "server-named"
    train_round(config("capture.clients=1", f"out-dir={run}"), theirs)
    assert not theirs.exists()
    assert files_under(tmp_path) == ["run/vault/round-0001_client-0001.npz"]


def test_in_simulation_the_clients_resolve_the_servers_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(client_app, "in_simulation", lambda: True)
    monkeypatch.setenv("FEDGUARD_RUNS", str(tmp_path))
    client = context(0, 4)
    for given in ([], ["out-dir=relative"], ["out-dir=/srv/runs/a"]):
        server = under_runs_home(config(*given), client.run_id)
        assert truth_vault(client, config(*given)) == Path(server.run.out_dir) / VAULT_DIR
    assert truth_vault(client, config()).parent.parent == tmp_path


def test_ground_truth_off_writes_nowhere_even_for_a_node_that_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    opted_in = Context(
        run_id=7, node_id=1, node_config={VAULT_DIR_KEY: "/vault"}, state=context(0, 4).state, run_config={}
    )
    assert truth_vault(opted_in, config()) == Path("/vault/run-7")
    assert truth_vault(opted_in, config("capture.ground-truth=false")) is None
    monkeypatch.setattr(client_app, "in_simulation", lambda: True)
    assert truth_vault(opted_in, config("capture.ground-truth=false", "out-dir=/srv/runs/a")) is None


@pytest.mark.parametrize("root", ["vault", "./runs", 3])
def test_a_vault_dir_that_is_not_an_absolute_folder_is_refused(root: object) -> None:
    node = Context(run_id=1, node_id=1, node_config={VAULT_DIR_KEY: root}, state=context(0, 4).state, run_config={})
    with pytest.raises(ValueError, match="absolute folder"):
        truth_vault(node, config())
