"""Every CUDA path of fedguard at small size in one call, with one summary file: for a machine lent a GPU.

Parts, in this order, each a process with its own time limit, so that a hang or a failure costs only that
part; the summary is rewritten after every part:

    environment  the GPU, torch, CUDA, cuDNN, triton, a C compiler, Flower and Ray (and a CUDA matmul)
    tests        the attack tests with FEDGUARD_TEST_DEVICE=cuda (pytest -m "not slow"; -n 8 with pytest-xdist)
    throughput   benchmarks/attack_throughput.py: every optimization attack, batched vs one at a time
    bare-loop    benchmarks/ig_vs_bare_loop.py: IG on ResNet-18 against a bare PyTorch loop, eager
    restarts     benchmarks/ig_batched_restarts.py: IG's restarts batched vs one after another, four models
    denoise      benchmarks/mjolnir_denoise_batching.py with the paper's UNet (the gpu preset)
    mjolnir      one epoch of `fedguard train-mjolnir --unet gpu` (the paper's UNet) on mnist-5k gradients
    simulation   `fedguard run` with sim.client-gpus = 0.25 and IG on CUDA (needs Flower, Ray, flower-superlink)
    compiled     ig_vs_bare_loop.py on the LeNet with --compile on: torch.compile's CUDA kernels
    breaching    benchmarks/vs_breaching.py at 5 % of its iterations (needs breaching importable)

A part starts only while at least MIN_PART_S of the budget (--budget, seconds) is left, and runs at most
its own limit or what is left; parts beyond the budget are listed as skipped (run them with --only).
Writes two files to --out (default: $OUT if set, else gpu-check/ in the checkout): gpu-check.md, the
summary (device and versions, then each part's status, wall seconds and headline figures), and
gpu-check.log, every part's full output. Runs from the source tree without installing it: the checkout
goes first on the parts' PYTHONPATH; the packages of `make gpu-wheels` must be importable (docs/how-to/gpu-check.md).

    make gpu-check
    python3 benchmarks/gpu_check.py [--device cuda|cpu] [--budget 330] [--only tests,mjolnir] [--smoke]
        [--out DIR]

--device cpu runs the same parts on the CPU; --smoke runs each at its smallest (a few iterations, one
test file, the small UNet): both check this script where there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BUDGET_S = 330.0  # the whole check: about 6 minutes with the wheels' install
MIN_PART_S = 20.0  # a part is not started with less of the budget left
GRACE_S = 15.0  # seconds between the signals that stop a part past its limit
FIGURE_LINES = 40  # at most this many headline lines per part in the summary
TAIL_LINES = 15  # lines of output shown for a part that did not succeed
ATTACK_TESTS = (
    "tests/test_dlg.py",
    "tests/test_engine.py",
    "tests/test_eot.py",
    "tests/test_generative.py",
    "tests/test_gradinversion.py",
    "tests/test_inverting_gradients.py",
)
XDIST_WORKERS = 8
PART_NAMES = (
    "tests",
    "throughput",
    "bare-loop",
    "restarts",
    "denoise",
    "mjolnir",
    "simulation",
    "compiled",
    "breaching",
)  # plan's parts, in its order
MJOLNIR_GRADIENTS = 4000  # mnist-5k's whole train split, one pass at batch 1; the paper's epoch: 60,000


@dataclasses.dataclass(frozen=True)
class Part:
    """One process of the check: ``command`` (argv) with ``env`` added, at most ``limit_s`` seconds; ``keep``
    picks its headline lines from stdout; ``skip`` says why it cannot run here ('' : it can)."""

    name: str
    what: str
    command: list[str]
    limit_s: float
    keep: Callable[[str], bool] = lambda line: bool(line.strip())
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    skip: str = ""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a part gave: ``status`` ('ok', 'failed (exit N)', 'timed out after N s', 'skipped: why'), wall
    ``seconds``, its headline ``figures`` and, unless ok, the ``tail`` of its output."""

    part: Part
    status: str
    seconds: float
    figures: list[str]
    tail: list[str]


def environment(device: str) -> dict[str, Any]:
    """Facts of this machine for the summary's header: versions, the device's name and memory, whether
    torch.compile can build kernels for ``device`` ('cuda' or 'cpu'); on CUDA one matmul checks it runs."""
    import torch
    from vs_breaching import device_name

    from attackers.engine.compiled import compiler_available

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    target = torch.device(device)
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "cuda_available": torch.cuda.is_available(),
        "triton": version("triton"),
        "c_compiler": shutil.which("gcc") or shutil.which("cc"),
        "compiles": compiler_available(target),
        "flwr": version("flwr"),
        "ray": version("ray"),
        "breaching": version("breaching"),
        "cpu": device_name(torch.device("cpu")),
        "cores": os.cpu_count(),
    }
    if target.type == "cuda":
        facts["device"] = torch.cuda.get_device_name(target)
        facts["memory_gib"] = round(torch.cuda.get_device_properties(target).total_memory / 2**30, 1)
        x = torch.randn(1024, 1024, device=target)
        facts["matmul_ok"] = bool(torch.allclose((x @ x).cpu(), x.cpu() @ x.cpu(), atol=1e-2, rtol=1e-3))
        facts["driver"] = nvidia_driver()
    else:
        facts["device"] = facts["cpu"]
    return facts


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version from nvidia-smi, or None where it cannot say within 30 s."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return smi.stdout.strip() or None
    return None


def flower_bin() -> Path | None:
    """The folder of Flower's commands (flower-superlink, flwr): on PATH, or beside the package installed
    with ``pip --target``; None where there is none."""
    found = shutil.which("flower-superlink")
    if found:
        return Path(found).parent
    spec = importlib.util.find_spec("flwr")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))).parent / "bin"
    return folder if (folder / "flower-superlink").is_file() else None


def peer_dir() -> Path | None:
    """The folder breaching imports from (vs_breaching.py's --peer-dir), or None where it is not installed."""
    spec = importlib.util.find_spec("breaching")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def matches(pattern: str) -> Callable[[str], bool]:
    """A ``keep`` for lines that match ``pattern`` at their start."""
    compiled = re.compile(pattern)
    return lambda line: bool(compiled.match(line))


def simulation_skip() -> str:
    """Why ``fedguard run`` cannot run here ('' : it can)."""
    missing = [name for name in ("flwr", "ray") if importlib.util.find_spec(name) is None]
    if missing:
        return f"{' and '.join(missing)} not importable (make gpu-wheels carries them)"
    return "" if flower_bin() else "Flower's flower-superlink command is not on PATH nor beside the flwr package"


def plan(device: str, smoke: bool, facts: dict[str, Any], scratch: Path) -> list[Part]:
    """The parts after ``environment``, at full size or (``smoke``) their smallest, for ``device``."""
    python, bench = sys.executable, str(HERE)

    def size(full: list[str], small: list[str]) -> list[str]:
        return small if smoke else full

    workers = min(XDIST_WORKERS, os.cpu_count() or 1)
    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") else []
    tests = [
        python,
        "-m",
        "pytest",
        "-q",
        "-m",
        "not slow",
        "-p",
        "no:cacheprovider",
        "--durations=5",
        *parallel,
        *size(list(ATTACK_TESTS), ["tests/test_eot.py"]),
    ]
    gpus = "0.25" if device == "cuda" else "0"
    simulation = [
        python,
        "-m",
        "fedguard",
        "run",
        str(ROOT / "experiments" / "quickstart.toml"),
        *(
            a
            for kv in (
                "train.rounds=2",
                "partition.num-clients=2",
                "train.clients-per-round=2",
                "capture.clients=0-1",
                "attack.ig.iterations=100",
                "attack.ig.restarts=2",
                "sim.num-cpus=4",
                f"sim.client-gpus={gpus}",
                "pool.wait=30",
                "pool.time-limit=60",
            )
            for a in ("--set", kv)
        ),
        "--out",
        str(scratch / "simulation"),
    ]
    peers, commands = peer_dir(), flower_bin()
    unet, gradients = ("cpu", 64) if smoke else ("gpu", MJOLNIR_GRADIENTS)
    return [
        Part(
            "tests",
            f"the attack tests on {device} (pytest -m 'not slow')",
            tests,
            150,
            matches(r"(FAILED|ERROR|SKIPPED|XFAIL)\b|\d+ (passed|failed|error|skipped)|[\d.]+s (call|setup)"),
            env={"FEDGUARD_TEST_DEVICE": device},
        ),
        Part(
            "throughput",
            "every optimization attack: U uploads x R restarts, batched vs one at a time",
            [
                python,
                f"{bench}/attack_throughput.py",
                "--device",
                device,
                *size(
                    ["--uploads", "4", "--restarts", "2", "--iterations", "30"],
                    ["--attacks", "ig,ggl", "--uploads", "2", "--restarts", "2", "--iterations", "3"],
                ),
            ],
            90,
        ),
        Part(
            "bare-loop",
            "IG against a bare PyTorch loop of the same maths, eager",
            [
                python,
                f"{bench}/ig_vs_bare_loop.py",
                "--device",
                device,
                "--compile",
                "off",
                "--out",
                str(scratch / "ig_vs_bare_loop.json"),
                *size(
                    ["--model", "resnet18", "--uploads", "8", "--iterations", "100"],
                    ["--model", "lenet", "--uploads", "2", "--iterations", "5"],
                ),
            ],
            90,
            matches(r"(?!wrote )"),
        ),
        Part(
            "restarts",
            "IG's restarts in one batched program vs one after another",
            [
                python,
                f"{bench}/ig_batched_restarts.py",
                "--device",
                device,
                *size(
                    ["--restarts", "8", "--iterations", "50", "--models", "lenet,mlp,convnet,resnet18"],
                    ["--restarts", "2", "--iterations", "3", "--models", "lenet"],
                ),
            ],
            60,
        ),
        Part(
            "denoise",
            f"Mjölnir's reverse chain with the {unet} UNet: N uploads batched vs one at a time",
            [
                python,
                f"{bench}/mjolnir_denoise_batching.py",
                "--device",
                device,
                "--unet",
                unet,
                *size(["--uploads", "8"], ["--uploads", "2", "--side", "32", "--noise-level", "0.05"]),
            ],
            90,
        ),
        Part(
            "mjolnir",
            f"one epoch of the {unet} UNet on {gradients:,} gradients of the LeNet on mnist-5k "
            f"(the paper's epoch: 60,000)",
            [
                python,
                "-m",
                "fedguard",
                "train-mjolnir",
                "--set",
                "data.name=mnist-5k",
                "--set",
                "model.name=lenet",
                "--set",
                "train.batch-size=1",
                "--surrogate-lr",
                "0",
                "--surrogate-epochs",
                "1",
                "--split",
                "test" if smoke else "train",
                "--gradients",
                str(gradients),
                "--unet",
                unet,
                "--device",
                device,
                "--epochs",
                "1",
                "--checkpoint-every",
                "0",
                "--out",
                str(scratch / "mjolnir" / "mnist-5k-lenet.npz"),
            ],
            120,
            matches(r"fedguard: (?!saved)"),
        ),
        Part(
            "simulation",
            f"`fedguard run`: 2 clients, 2 rounds, sim.client-gpus = {gpus}, IG on the uploads (attack device auto)",
            simulation,
            150,
            matches(r"(fedguard: |round )"),
            env={"PATH": f"{commands}{os.pathsep}{os.environ.get('PATH', '')}"} if commands else {},
            skip=simulation_skip(),
        ),
        Part(
            "compiled",
            "IG and the bare loop on the LeNet, both compiled (torch.compile)",
            [
                python,
                f"{bench}/ig_vs_bare_loop.py",
                "--device",
                device,
                "--compile",
                "on",
                "--model",
                "lenet",
                "--out",
                str(scratch / "ig_vs_bare_loop_compiled.json"),
                *size(["--uploads", "8", "--iterations", "100"], ["--uploads", "2", "--iterations", "3"]),
            ],
            150,
            matches(r"(?!wrote )"),
            skip=""
            if facts.get("compiles", True)
            else "torch.compile cannot build kernels here (triton or a C compiler missing)",
        ),
        Part(
            "breaching",
            "fedguard vs breaching 0.1.2 on the same uploads, at a fraction of the iterations",
            [
                python,
                f"{bench}/vs_breaching.py",
                "--device",
                device,
                "--peer-dir",
                str(peers),
                "--out",
                str(scratch / "vs_breaching.json"),
                *size(
                    ["--uploads", "2", "--iterations-scale", "0.05"],
                    ["--cases", "ig-lenet", "--uploads", "1", "--iterations-scale", "0.002"],
                ),
            ],
            90,
            matches(r"(?!wrote |installing )"),
            skip="" if peers else "breaching is not importable (make gpu-wheels carries it)",
        ),
    ]


def stop(process: subprocess.Popen) -> None:
    """End ``process`` and what it started in its session: SIGTERM, again after GRACE_S (a second signal stops
    a ``fedguard run`` at once, every process of the run with it), SIGKILL after GRACE_S more."""
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(GRACE_S)


def run(part: Part, limit_s: float, scratch: Path, log: Path) -> Outcome:
    """Run ``part`` for at most ``limit_s`` seconds from the checkout, its output appended to ``log``."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        **part.env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    out, err = scratch / f"{part.name}.out", scratch / f"{part.name}.err"
    start = time.perf_counter()
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            part.command,
            cwd=ROOT,
            env=env,
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            code = process.wait(limit_s)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit_s:.0f} s"
        stop(process)  # after a timeout, the part; after an exit, whatever it left running
    seconds = time.perf_counter() - start
    printed = out.read_text(errors="replace").splitlines()
    errors = err.read_text(errors="replace").splitlines()
    with log.open("a") as handle:
        handle.write(f"=== {part.name}: {status}, {seconds:.1f} s\n$ {' '.join(part.command)}\n")
        handle.write("\n".join(printed) + "\n--- stderr\n" + "\n".join(errors) + "\n\n")
    figures = [line for line in printed if part.keep(line)][-FIGURE_LINES:]
    tail = [] if status == "ok" else (errors or printed)[-TAIL_LINES:]
    return Outcome(part, status, seconds, figures, tail)


def header(facts: dict[str, Any], device: str) -> list[str]:
    """The summary's first lines: the device and every version, or why they are unknown."""
    if "torch" not in facts:
        return [f"Device and versions unknown: the environment part did not finish ({facts.get('error', '')})."]
    host = f"{facts['cores']} cores of {facts['cpu']}"
    where = (
        f"**{facts['device']}**, {facts['memory_gib']} GiB, driver {facts.get('driver')}; host: {host}"
        if device == "cuda"
        else f"**{host}**"
    )
    return [
        where,
        "",
        f"Python {facts['python']}, torch {facts['torch']} (CUDA {facts['cuda']}, cuDNN {facts['cudnn']}), "
        f"triton {facts['triton']}, C compiler {facts['c_compiler']}; torch.compile builds kernels on {device}: "
        f"{facts['compiles']}; CUDA available: {facts['cuda_available']}, matmul correct: "
        f"{facts.get('matmul_ok', '-')}; flwr {facts['flwr']}, ray {facts['ray']}, breaching {facts['breaching']}",
    ]


def summary(facts: dict[str, Any], outcomes: list[Outcome], device: str, budget_s: float, smoke: bool) -> str:
    """gpu-check.md: the header, a table of parts, then each part's command, figures and (unless ok) tail."""
    lines = [
        "# fedguard GPU check" + (" (smoke sizes)" if smoke else ""),
        "",
        *header(facts, device),
        "",
        f"Budget {budget_s:.0f} s; the parts took {sum(o.seconds for o in outcomes):.0f} s.",
        "",
        "| part | status | seconds | what |",
        "|---|---|---|---|",
    ]
    lines += [f"| {o.part.name} | {o.status} | {o.seconds:.1f} | {o.part.what} |" for o in outcomes]
    for o in outcomes:
        lines += ["", f"## {o.part.name}: {o.status}, {o.seconds:.1f} s", "", f"`{' '.join(o.part.command)}`"]
        if o.figures:
            lines += ["", "```", *o.figures, "```"]
        if o.tail:
            lines += ["", "Last lines of output:", "", "```", *o.tail, "```"]
    return "\n".join(lines) + "\n"


def probe(device: str, scratch: Path, log: Path) -> tuple[Outcome, dict[str, Any]]:
    """The environment part, and the facts it printed (``error`` in them where it printed none)."""
    part = Part(
        "environment",
        "versions, the device, torch.compile's compiler, a CUDA matmul",
        [sys.executable, str(Path(__file__).resolve()), "--environment", "--device", device],
        90,
        matches(r"\{"),
    )
    outcome = run(part, part.limit_s, scratch, log)
    try:
        facts = json.loads(outcome.figures[-1])
    except (IndexError, json.JSONDecodeError):
        facts = {"error": outcome.status}
    return dataclasses.replace(outcome, figures=[]), facts


def check(device: str, budget_s: float, only: set[str], smoke: bool, out: Path) -> list[Outcome]:
    """Run the check, rewriting ``out``/gpu-check.md after every part; returns the outcomes."""
    deadline = time.monotonic() + budget_s
    out.mkdir(parents=True, exist_ok=True)
    log, report = out / "gpu-check.log", out / "gpu-check.md"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="fedguard-gpu-check-") as folder:
        scratch = Path(folder)
        first, facts = probe(device, scratch, log)
        outcomes = [first]
        report.write_text(summary(facts, outcomes, device, budget_s, smoke))
        for part in plan(device, smoke, facts, scratch):
            if part.name not in only:
                continue
            left = deadline - time.monotonic()
            if part.skip:
                outcome = Outcome(part, f"skipped: {part.skip}", 0.0, [], [])
            elif left < MIN_PART_S:
                outcome = Outcome(part, f"skipped: the budget of {budget_s:.0f} s is spent", 0.0, [], [])
            else:
                outcome = run(part, min(part.limit_s, left), scratch, log)
            outcomes.append(outcome)
            print(f"gpu-check: {part.name}: {outcome.status} ({outcome.seconds:.1f} s)", flush=True)
            report.write_text(summary(facts, outcomes, device, budget_s, smoke))
    print(f"gpu-check: wrote {report} and {log}")
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the parts run (default cuda)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all parts (default {BUDGET_S:g})")
    parser.add_argument("--only", default=",".join(PART_NAMES), help="comma-separated parts (default: all)")
    parser.add_argument("--smoke", action="store_true", help="every part at its smallest, to check this script")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or ROOT / "gpu-check"),
        help="output folder (default $OUT, else gpu-check/)",
    )
    parser.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.environment:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(environment(args.device)))
        return
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = sorted(only - set(PART_NAMES))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PART_NAMES)}")
    if args.budget <= 0:
        parser.error("--budget must be > 0")
    outcomes = check(args.device, args.budget, only, args.smoke, args.out.resolve())
    sys.exit(0 if all(o.status == "ok" or o.status.startswith("skipped") for o in outcomes) else 1)


if __name__ == "__main__":
    main()
