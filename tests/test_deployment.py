"""The app on Flower's deployment engine, on loopback: a SuperLink with TLS and SuperNode
authentication, SuperNodes started with `flower-supernode`, the run started with `flwr run`.

Certificates and keys come from docker/certs/generate.sh and docker/keys/generate.sh, as in a
real deployment. Every process runs in its own process group, is killed at the end, and logs to
tmp_path; the tails of those logs are printed when a test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

from fedguard.runtime.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CERTS_SCRIPT = ROOT / "docker" / "certs" / "generate.sh"
PROXY_CONF = ROOT / "docker" / "fleet-proxy.conf"
KEYS_SCRIPT = ROOT / "docker" / "keys" / "generate.sh"
CONNECTION = "fedguard-deploy"

# Small enough for two CPU cores: 2 rounds of a 16-unit MLP on the bundled digits.
SMALL_RUN = "data.name='digits' model.name='mlp' model.mlp.hidden=16 train.rounds=2 train.batch-size=16 pool.wait=120.0"
IG = "attack.name='ig' attack.ig.iterations=20 attack.ig.restarts=1 attack.ig.device='cpu'"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"--- {path.name}: (no file)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return f"--- {path.name} (last {len(text)} lines)\n" + "\n".join(text)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a SuperLink certificate for 127.0.0.1 and localhost."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: docker/certs/generate.sh needs it")
    folder = tmp_path_factory.mktemp("certs")
    subprocess.run(
        ["bash", str(CERTS_SCRIPT), "127.0.0.1,localhost", str(folder)], check=True, capture_output=True, timeout=120
    )
    return folder


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four SuperNode key pairs: supernode-1 ... supernode-4."""
    folder = tmp_path_factory.mktemp("keys")
    subprocess.run(
        ["bash", str(KEYS_SCRIPT), "4", str(folder)],
        check=True,
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable},
    )
    return folder


class Deployment:
    """A SuperLink and its SuperNodes on loopback, each process in its own process group."""

    def __init__(self, tmp_path: Path, certs: Path) -> None:
        self.tmp, self.certs = tmp_path, certs
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.home = tmp_path / "flwr-home"
        self.home.mkdir()
        self.port = free_port()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{certs / "ca.crt"}"\n'
        )
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "PATH": f"{BIN}:{os.environ['PATH']}",
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self._files: list[IO[str]] = []

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(self.log(name), "w")  # noqa: SIM115 - open while the process runs; stop() closes it
        self._files.append(out)
        proc = subprocess.Popen(
            args,
            env=env or self.env,
            cwd=self.tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def start_superlink(self) -> None:
        self.spawn(
            "superlink",
            [
                str(BIN / "flower-superlink"),
                "--ssl-ca-certfile",
                str(self.certs / "ca.crt"),
                "--ssl-certfile",
                str(self.certs / "server.pem"),
                "--ssl-keyfile",
                str(self.certs / "server.key"),
                "--enable-supernode-auth",
                "--disable-runtime-dependency-installation",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--database",
                str(self.tmp / "superlink.db"),
            ],
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.procs["superlink"].poll() is not None:
                raise RuntimeError(f"the SuperLink exited with {self.procs['superlink'].returncode}")
            if "Uvicorn running on https://" in self.log("superlink").read_text(errors="replace"):
                return
            time.sleep(0.3)
        raise TimeoutError("the SuperLink did not start within 60 s")

    def start_fleet_proxy(self) -> str:
        """NGINX with docker/fleet-proxy.conf as compose.yaml mounts it, its container paths and the upstream's
        name mapped to this machine; returns the address SuperNodes connect to."""
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(nginx).is_file():
            pytest.skip("nginx is not installed (Debian package nginx-light; .ci/run installs it)")
        port, folder = free_port(), self.tmp / "nginx"
        folder.mkdir()
        server = PROXY_CONF.read_text()
        for container, here in {
            "listen 9092 ssl;": f"listen 127.0.0.1:{port} ssl;",
            "https://superlink-api:8000/": f"https://127.0.0.1:{self.port}/",
            "/certs/": f"{self.certs}/",
        }.items():
            assert container in server, f"{PROXY_CONF.name} no longer holds {container!r}"
            server = server.replace(container, here)
        (folder / "fleet-proxy.conf").write_text(server)
        # What the official image's nginx.conf sets around conf.d/, in folders of this test.
        temp = " ".join(
            f"{kind}_temp_path {folder}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (folder / "nginx.conf").write_text(
            f"daemon off;\npid {folder}/nginx.pid;\nerror_log {folder}/error.log info;\nevents {{}}\n"
            f"http {{ access_log {folder}/access.log; {temp} include {folder}/fleet-proxy.conf; }}\n"
        )
        self.spawn("fleet-proxy", [nginx, "-p", str(folder), "-c", str(folder / "nginx.conf")])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return f"127.0.0.1:{port}"
            if self.procs["fleet-proxy"].poll() is not None:
                raise RuntimeError(f"nginx exited:\n{self.log('fleet-proxy').read_text()}")
            time.sleep(0.2)
        raise TimeoutError("the Fleet proxy did not listen within 30 s")

    def connect(self, name: str, address: str) -> None:
        """Add a connection ``name`` to ``address`` to the flwr CLI's configuration, with the CA certificate only."""
        with open(self.home / "config.toml", "a") as config:
            config.write(
                f'\n[superlink.{name}]\naddress = "{address}"\nroot-certificates = "{self.certs / "ca.crt"}"\n'
            )

    def flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "flwr"), *args], env=self.env, cwd=self.tmp, capture_output=True, text=True, timeout=timeout
        )

    def register(self, public_key: Path) -> str:
        result = self.flwr("supernode", "register", str(public_key), CONNECTION, "--format", "json")
        assert result.returncode == 0, result.stdout + result.stderr
        return str(json.loads(result.stdout)["node-id"])

    def nodes(self) -> dict[str, str]:
        """node id -> status, as `flwr supernode list` reports them."""
        result = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        assert result.returncode == 0, result.stdout + result.stderr
        return {str(n["node-id"]): n["status"] for n in json.loads(result.stdout)["nodes"]}

    def start_supernode(
        self,
        name: str,
        private_key: Path,
        partition_id: int,
        num_partitions: int,
        vault: Path | None = None,
        superlink: str = "",
    ) -> None:
        """A SuperNode connecting to ``superlink`` (default: the SuperLink itself); with ``vault``, its node config
        opts in to keeping ground truth there."""
        home = self.tmp / f"{name}-home"
        home.mkdir()
        node_config = f"partition-id={partition_id} num-partitions={num_partitions}"
        if vault is not None:
            node_config += f' vault-dir="{vault}"'
        self.spawn(
            name,
            [
                str(BIN / "flower-supernode"),
                "--superlink",
                superlink or f"127.0.0.1:{self.port}",
                "--root-certificates",
                str(self.certs / "ca.crt"),
                "--auth-supernode-private-key",
                str(private_key),
                "--node-config",
                node_config,
                "--host",
                "127.0.0.1",
                "--port",
                str(free_port()),
                "--max-retries",
                "3",
            ],
            env={**self.env, "FLWR_HOME": str(home)},
        )

    def wait_online(self, node_ids: set[str], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = self.nodes()
            if all(nodes.get(n) == "online" for n in node_ids):
                return
            time.sleep(1)
        raise TimeoutError(f"SuperNodes not online within {timeout} s: {self.nodes()}")

    def run(self, overrides: str, name: str = "flwr-run") -> subprocess.Popen:
        """Start `flwr run` on the app; its output goes to logs/<name>.log."""
        return self.spawn(
            name,
            [
                str(BIN / "flwr"),
                "run",
                str(ROOT),
                CONNECTION,
                "--run-config",
                overrides,
                "--stream",
            ],
        )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def close(self) -> None:
        for proc in reversed(list(self.procs.values())):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            try:  # whatever the group left behind (SuperExec, app processes)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait(10)
        for f in self._files:
            f.close()

    def report(self) -> str:
        return "\n".join(tail(p) for p in sorted(self.logs.glob("*.log")))


@pytest.fixture
def deployment(tmp_path: Path, certs: Path):
    """A Deployment torn down after the test; pytest shows the log tails printed here when it fails."""
    dep = Deployment(tmp_path, certs)
    try:
        yield dep
    finally:
        dep.close()
        print(f"\nlogs in {dep.logs}\n{dep.report()}")


def wait_finished(dep: Deployment, name: str, timeout: float) -> int:
    try:
        return dep.procs[name].wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`flwr run` did not finish within {timeout} s")


def read_rows(path: Path, count: int, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (not path.exists() or len(path.read_text().splitlines()) < count):
        time.sleep(0.5)
    assert path.exists(), f"{path} was not written"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_authenticated_supernodes_over_tls_run_the_app(deployment: Deployment, keys: Path, tmp_path: Path) -> None:
    dep = deployment
    dep.start_superlink()
    ids = {dep.register(keys / f"supernode-{i}.pub") for i in (1, 2)}
    vaults = [tmp_path / f"vault-{i}" for i in (1, 2)]
    for i, vault in zip((1, 2), vaults):
        dep.start_supernode(
            f"supernode-{i}", keys / f"supernode-{i}", partition_id=i - 1, num_partitions=2, vault=vault
        )
    dep.wait_online(ids)

    out = tmp_path / "run"
    dep.run(
        f"{SMALL_RUN} {IG} partition.num-clients=2 train.clients-per-round=2 capture.rounds='1-2' "
        f"capture.clients='0' out-dir='{out}'"
    )
    assert wait_finished(dep, "flwr-run", 240) == 0

    rounds = read_rows(out / "rounds.jsonl", 3)
    assert [r["round"] for r in rounds] == [0, 1, 2]
    attacks = read_rows(out / "attacks.jsonl", 2)
    assert sorted((a["round"], a["client"]) for a in attacks) == [(1, 0), (2, 0)]
    assert all(a["status"] == "ok" for a in attacks), [a.get("error") for a in attacks]
    assert (out / "report.html").is_file()
    # The ClientApps ran on the SuperNodes, not in a simulation.
    for i in (1, 2):
        assert "Start `flwr-clientapp` process" in dep.log(f"supernode-{i}").read_text()
    # Ground truth stays with the SuperNodes that opted in, under their own folder, one per Flower run;
    # nothing is written to the run folder, whatever the server's instructions name.
    kept = [p.relative_to(v) for v in vaults for p in v.rglob("*.npz")]
    assert sorted(p.name for p in kept) == ["round-0001_client-0000.npz", "round-0002_client-0000.npz"]
    assert all(len(p.parts) == 2 and p.parts[0].startswith("run-") for p in kept), kept
    assert not (out / "vault").exists()
    assert all(a["psnr"] is None and "no ground truth" in a["error"] for a in attacks), attacks


@pytest.mark.heavy
def test_through_the_fleet_proxy_a_supernode_trains_and_a_ca_holder_cannot_touch_the_control_api(
    deployment: Deployment, keys: Path, tmp_path: Path
) -> None:
    """The SuperNodes' side of compose.yaml reaches the SuperLink only through docker/fleet-proxy.conf: a
    registered SuperNode trains through it, and a stranger holding ca.crt can neither register a key, unregister
    the operator's node nor list the nodes there."""
    dep = deployment
    dep.start_superlink()
    proxy = dep.start_fleet_proxy()
    node = dep.register(keys / "supernode-1.pub")
    dep.start_supernode("supernode-1", keys / "supernode-1", partition_id=0, num_partitions=1, superlink=proxy)
    dep.wait_online({node})

    dep.connect("stranger", proxy)
    for command in (
        ["supernode", "register", str(keys / "supernode-2.pub"), "stranger"],
        ["supernode", "unregister", node, "stranger"],
        ["supernode", "list", "stranger"],
    ):
        result = dep.flwr(*command)
        assert result.returncode != 0, f"flwr {' '.join(command)} through the proxy:\n{result.stdout}{result.stderr}"
    assert dep.nodes() == {node: "online"}, "the stranger changed nothing"
    refused = [line for line in (tmp_path / "nginx" / "access.log").read_text().splitlines() if "/v1/control/" in line]
    assert len(refused) >= 3 and all('" 404 ' in line for line in refused), refused

    out = tmp_path / "run"
    dep.run(
        f"{SMALL_RUN} attack.name='none' partition.num-clients=1 train.clients-per-round=1 "
        f"capture.rounds='none' out-dir='{out}'"
    )
    assert wait_finished(dep, "flwr-run", 200) == 0
    assert [r["round"] for r in read_rows(out / "rounds.jsonl", 3)] == [0, 1, 2]
    assert "/v1/fleet/" in (tmp_path / "nginx" / "access.log").read_text()


def test_a_supernode_with_an_unregistered_key_is_refused(deployment: Deployment, keys: Path) -> None:
    dep = deployment
    dep.start_superlink()
    registered = dep.register(keys / "supernode-1.pub")
    dep.start_supernode("supernode-1", keys / "supernode-1", partition_id=0, num_partitions=2)
    dep.start_supernode("intruder", keys / "supernode-4", partition_id=1, num_partitions=2)  # never registered
    dep.wait_online({registered})

    intruder = dep.procs["intruder"]
    try:
        code = intruder.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail("the SuperNode with an unregistered key is still running")
    assert code != 0
    assert "Failed to activate SuperNode" in dep.log("intruder").read_text()
    assert "No SuperNode found with the given public key" in dep.log("superlink").read_text()
    assert dep.nodes() == {registered: "online"}


@pytest.mark.heavy
def test_a_supernode_killed_mid_round_does_not_stop_the_run(deployment: Deployment, keys: Path, tmp_path: Path) -> None:
    dep = deployment
    dep.start_superlink()
    ids = {dep.register(keys / f"supernode-{i}.pub") for i in (1, 2, 3)}
    for i in (1, 2, 3):
        dep.start_supernode(f"supernode-{i}", keys / f"supernode-{i}", partition_id=i - 1, num_partitions=3)
    dep.wait_online(ids)

    out = tmp_path / "run"
    dep.run(
        f"{SMALL_RUN} attack.name='none' partition.num-clients=3 train.clients-per-round=2 "
        f"capture.rounds='1' capture.clients='all' out-dir='{out}'"
    )

    # Kill (SIGKILL, process group: SuperNode and its ClientApp) the first SuperNode that receives
    # round 1's instructions, while its ClientApp is still training.
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline:
        for i in (1, 2, 3):
            if "Receiving: train message" in dep.log(f"supernode-{i}").read_text():  # the first one is round 1
                victim = f"supernode-{i}"
                break
        else:
            assert dep.procs["flwr-run"].poll() is None, "`flwr run` ended before round 1"
            time.sleep(0.2)
    assert victim is not None, "no SuperNode received round 1 within 120 s"
    dep.kill(victim)

    assert wait_finished(dep, "flwr-run", 200) == 0
    rounds = read_rows(out / "rounds.jsonl", 3)
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert "Received 1 results and 1 failures" in dep.log("flwr-run").read_text()
