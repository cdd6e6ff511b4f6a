"""The simulation on a Ray cluster of two nodes: ``fedguard run`` joins it through ``sim.address`` and the
clients train on both nodes.

Both nodes run on this machine, each started by its own ``ray start`` (a head, and a worker node joining it),
with one CPU and a custom resource of its own. Each client reserves one CPU (``sim.client-cpus = 1``), so
Flower's actor pool (one actor per client's worth of resources on each node) has exactly one actor per node.
A plugin module records the Ray node of every ``DefendedClient.fit``; the cluster is asked which node is
which before it is stopped. Every process of the cluster carries a tag in its environment, by which the test
stops it (never ``ray stop``, which stops every Ray process on the machine) and checks that none is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedguard.report.run_status import read_status
from fedguard.runtime.launcher import free_port
from tests.commands import quickstart_run

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
TAG = "FEDGUARD_TEST_RAY_CLUSTER"  # every process of the cluster inherits the environment, so this marks them all
NODES = {"head": "fg-head", "worker": "fg-worker"}  # node -> its custom resource
CLIENTS, ROUNDS = 4, 2

NODE_LOG_PLUGIN = '''
"""Records the Ray node (and process) of every client fit, in fits.jsonl beside this file."""
import json
import os
from pathlib import Path

import ray

from clients import DefendedClient

LOG = Path(__file__).with_name("fits.jsonl")
_fit = getattr(DefendedClient.fit, "__wrapped__", DefendedClient.fit)


def fit(self, *args, **kwargs):
    where = ray.get_runtime_context() if ray.is_initialized() else None
    with LOG.open("a") as log:
        log.write(json.dumps({"node": where and where.get_node_id(), "actor": where and where.get_actor_id(),
                              "pid": os.getpid()}) + "\\n")
    return _fit(self, *args, **kwargs)


fit.__wrapped__ = _fit
DefendedClient.fit = fit
'''

NODES_PROBE = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([{"id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]} for n in ray.nodes()]))
"""


def tagged(tag: str) -> dict[int, str]:
    """The processes whose environment holds ``TAG=tag``, with their command lines (a zombie's environment
    reads empty: not counted)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"{TAG}={tag}".encode() in (entry / "environ").read_bytes():
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            pass
    return found


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def wait_until_gone(tag: str, timeout: float, which: str = "") -> dict[int, str]:
    """Wait up to ``timeout`` s until no process tagged ``tag`` (whose command line holds ``which``) is left."""
    deadline = time.monotonic() + timeout
    while (left := {p: c for p, c in tagged(tag).items() if which in c}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def stop_cluster(tag: str) -> dict[int, str]:
    """Stop every process of the cluster tagged ``tag``, the way ``ray stop`` does but for this cluster only:
    the raylets first (a raylet whose GCS went first keeps trying to reach it), then the rest; SIGKILL for
    what is left after a few seconds. Returns what is still running after that (nothing, normally)."""
    signal_all([p for p, c in tagged(tag).items() if "/raylet/raylet" in c], signal.SIGTERM)
    wait_until_gone(tag, 10, "/raylet/raylet")
    signal_all(list(tagged(tag)), signal.SIGTERM)
    if wait_until_gone(tag, 5):
        signal_all(list(tagged(tag)), signal.SIGKILL)
    return wait_until_gone(tag, 10)


def ray_start(args: list[str], env: dict[str, str]) -> None:
    """``ray start`` with ``args``, on ports of its own where Ray would take fixed ones (another cluster on this
    machine may hold them)."""
    ports = [f"--dashboard-agent-listen-port={free_port()}"]
    if "--head" in args:
        ports += [f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}"]
    started = subprocess.run(
        [RAY, "start", *args, *ports, "--disable-usage-stats"], capture_output=True, text=True, timeout=120, env=env
    )
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]


def cluster_nodes(address: str, env: dict[str, str]) -> list[dict]:
    probe = subprocess.run(
        [sys.executable, "-c", NODES_PROBE, address], capture_output=True, text=True, timeout=120, env=env
    )
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-2000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


def node_names(nodes: list[dict]) -> dict[str, str]:
    """Node id -> ``head`` or ``worker``, told apart by their custom resources; alive nodes only."""
    return {
        n["id"]: name for n in nodes if n["alive"] for name, resource in NODES.items() if n["resources"].get(resource)
    }


@pytest.fixture
def two_node_cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray cluster of a head and a worker node on this machine, one CPU each: its address and the
    environment its processes run in. Stopped afterwards; the test fails if any of its processes is left."""
    tag = uuid.uuid4().hex
    temp = tempfile.mkdtemp(prefix="fg-ray-", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, TAG: tag, "RAY_TMPDIR": temp}
    env.pop("RAY_ADDRESS", None)
    # Ray's multi-node mode, as on Linux by default: `ray start --address` refuses to add a node without it
    # (the venv's `activate` exports 0 for the loopback-only local clusters of `flwr run .`). In it, Ray puts
    # its nodes on this machine's address, 127.0.0.1 included, and listens on every interface.
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    port = free_port()
    address = f"127.0.0.1:{port}"
    try:
        ray_start(
            [
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--num-cpus=1",
                f"--resources={json.dumps({NODES['head']: 1})}",
                "--include-dashboard=false",
            ],
            env,
        )
        ray_start([f"--address={address}", "--num-cpus=1", f"--resources={json.dumps({NODES['worker']: 1})}"], env)
        deadline = time.monotonic() + 60
        while sorted(node_names(cluster_nodes(address, env)).values()) != ["head", "worker"]:
            assert time.monotonic() < deadline, "the worker node did not join the head within 60 s"
            time.sleep(1)
        yield address, env
    finally:
        left = stop_cluster(tag)
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"processes of the test's Ray cluster still running: {left}"


@pytest.mark.slow
@pytest.mark.heavy
def test_the_simulation_runs_its_clients_on_every_node_of_a_cluster(tmp_path: Path, two_node_cluster) -> None:
    address, env = two_node_cluster
    (tmp_path / "node_log_plugin.py").write_text(NODE_LOG_PLUGIN)
    out = tmp_path / "run"
    overrides = [
        f"sim.address={address}",
        "sim.client-cpus=1",
        "server.plugins=node_log_plugin",
        f"partition.num-clients={CLIENTS}",
        f"train.clients-per-round={CLIENTS}",
        f"train.rounds={ROUNDS}",
        "train.protocol=fedsgd",
        "model.name=mlp",
        "capture.rounds=1",
        "capture.clients=all",
        "attack.name=none",
    ]
    command = quickstart_run(out, overrides)
    run_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=run_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # The run completed, every round.
    assert read_status(out)["status"] == "completed"
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(ROUNDS + 1))
    assert len(list((out / "vault").glob("*.npz"))) == CLIENTS  # the clients of both nodes filled the vault

    # Every fit ran in a Ray actor of this cluster, and each node ran some: asked while the cluster is up.
    names = node_names(cluster_nodes(address, env))
    fits = [json.loads(line) for line in (tmp_path / "fits.jsonl").read_text().splitlines()]
    assert len(fits) == CLIENTS * ROUNDS and all(f["actor"] for f in fits), fits
    per_node = Counter(names.get(f["node"], f"unknown node {f['node']}") for f in fits)
    assert set(per_node) == {"head", "worker"}, (per_node, names)
    actors = {name: {f["actor"] for f in fits if names.get(f["node"]) == name} for name in NODES}
    assert all(len(ids) == 1 for ids in actors.values()), actors  # Flower's pool: one actor per node's CPU
