"""fedguard's optimization attacks against breaching 0.1.2 (Geiping et al.), side by side, on the same inputs.

Each case builds one model once (fixed seed) and captures U batch-1 FedSGD
gradients of U distinct held-out 32x32 photos, as attack_throughput.py does.
The very same weights and gradients go to both tools, which run one after
the other in this process with the same thread count: fedguard with all U
uploads in one ``reconstruct_many`` call (batched) and one upload per call
(one at a time), breaching one upload per call, as it works. Each tool uses
its own default attack configuration, except where a case names fedguard
settings (ig-convnet: the winner of ``attack_defaults.py --case ig-convnet``,
where the default, chosen on the LeNet, reconstructs worse than breaching);
a case with ``quality_iterations`` adds a batched fedguard row at that count,
the fewest iterations measured to reach breaching's quality;
only the iteration count and the device (``--device``, both tools on the same one) are set, and for
breaching the data shape and normalization (images in [0, 1]: mean 0, std 1).
``--precision bfloat16`` runs fedguard's dummy gradients in bfloat16 (attacks
with a ``precision`` parameter; eager on the CPU). Neither tool is given the labels: fedguard infers
them (ig) or optimizes soft labels (dlg), breaching runs its config's label
strategy. Both see BatchNorm on batch statistics, as the client's training
step did (breaching: no buffers shared). Only the reconstruction calls are
timed, after one short untimed warm-up per tool. fedguard's warm-up runs the
batched and the one-upload program for a few iterations with the timed runs'
``compile`` decision, so a compiled program is built there (its seconds are
printed as the warm-up: on a cold Inductor cache, the whole compile) and the
timed calls pay only tracing and the cache lookup (about 2 s per call).
``--compile off`` times fedguard eager. On CUDA the clock stops after the
device's queue is drained and each row reports its peak GPU memory.
Reconstructions are scored against the true images with fedguard.metrics (PSNR, SSIM).

Cases (rows per tool; breaching config in brackets):
    ig-lenet    Inverting Gradients [invertinggradients], 2,000 iterations, DLG LeNet
    ig-convnet  Inverting Gradients [invertinggradients], 500 iterations, ConvNet width 64;
                fedguard with lr 0.1, TV weight 2 and the cosine schedule; a batched row at 100 iterations
    dlg-lenet   DLG [deepleakage], DLG LeNet: fedguard's default 2,000 L-BFGS iterations; breaching's 300
                L-BFGS steps (torch.optim.LBFGS.step, up to 20 iterations each: the DLG code's setting)

    make bench-breaching
    .venv/bin/python benchmarks/vs_breaching.py [--cases ig-lenet,ig-convnet,dlg-lenet] [--uploads 8]
        [--iterations-scale 1.0] [--fedguard-iterations N] [--threads N] [--seed 0] [--device auto|cpu|cuda]
        [--compile auto|on|off] [--precision float32|bfloat16] [--peer-dir DIR] [--out PATH]

On first run breaching==0.1.2 and those of its dependencies missing from
this environment are installed with pip (pinned, --no-deps) into --peer-dir
(default benchmarks/.peers/breaching-0.1.2), never into the venv; the folder
goes last on sys.path, so this environment's torch is the one used. Prints a
table (mean PSNR in dB, mean SSIM, uploads with SSIM > 0.9, seconds,
reconstructions per second and their ratio to breaching's) and writes it as
JSON to --out with the torch version, threads, device and each tool's exact
configuration. ``--iterations-scale 0.01 --uploads 2`` is a quick smoke run.
``--fedguard-iterations N`` runs fedguard for N iterations in every case while
breaching keeps the case's count: the speed of each tool at the quality it
reaches, where fedguard reaches breaching's quality in fewer iterations.

Targets of the project, on 2 cores with 8 uploads: fedguard batched at 5x
breaching's reconstructions per second on the LeNet and 3x on the ConvNet,
at equal or better mean SSIM, and one upload at a time not slower than
breaching. After the table a line per case says whether the run met them
(the fastest batched row whose mean SSIM is at least breaching's); the JSON
has them under ``targets``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import os
import shlex
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from attackers.base import ATTACKS, COMPILE_MODES, DEVICES, build_attack
from attackers.engine.compiled import compiles
from attackers.engine.spec import PRECISIONS
from attackers.jobs import resolve_device
from fedguard.data import DataSpec, load_dataset
from fedguard.metrics.image import clip_psnr, psnr, ssim
from fedguard.metrics.matching import match
from fedguard.metrics.scoring import LEAK_SSIM
from fedguard.models import MODELS, build_model
from fedguard.models.convnet import ConvNetParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import compute_gradients, get_arrays, trainable_mask

HERE = Path(__file__).resolve().parent
BREACHING = "0.1.2"
DATA = "photos"
WARM_UP_ITERATIONS = 2
PEER_PINS = {
    "hydra-core": "1.3.2",
    "omegaconf": "2.3.0",
    "antlr4-python3-runtime": "4.9.3",
    "scipy": "1.17.1",
    "lpips": "0.1.4",
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: fedguard attack ``fedguard`` vs breaching attack config ``breaching`` (None: fedguard
    only, ``attack_defaults.py``) on ``model``, each for its own count of ``iterations``
    (``breaching_iterations`` when they differ in unit); ``fedguard_settings``: parameters of fedguard's attack
    set instead of its defaults; ``quality_iterations``: fedguard's count for one more batched row, the fewest
    iterations measured to reach breaching's mean SSIM (the verdict checks that it did); ``target``: the
    project's ratio to breaching's reconstructions per second, batched, at equal or better mean SSIM; uploads
    of ``batch`` distinct test images of dataset ``data``."""

    fedguard: str
    breaching: str | None
    model: str
    model_params: Any
    iterations: int
    breaching_iterations: int | None = None
    fedguard_settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    quality_iterations: int | None = None
    target: float | None = None
    data: str = DATA
    batch: int = 1

    @property
    def model_label(self) -> str:
        width = getattr(self.model_params, "width", None)
        return self.model if width is None else f"{self.model}-{width}"


CASES = {
    "ig-lenet": Case("ig", "invertinggradients", "lenet", None, 2000, target=5.0),
    "ig-convnet": Case(
        "ig",
        "invertinggradients",
        "convnet",
        ConvNetParams(width=64),
        500,
        fedguard_settings={"lr": 0.1, "tv": 2.0, "schedule": "cosine"},
        quality_iterations=100,
        target=3.0,
    ),
    "dlg-lenet": Case("dlg", "deepleakage", "lenet", None, 2000, breaching_iterations=300, target=5.0),
}
BATCHED, ONE_AT_A_TIME, FEWER = "fedguard batched", "fedguard one at a time", "fedguard batched, fewer"
TARGET_UPLOADS = 8  # the setting the cases' targets are set for (with the cases' own iterations)


@dataclasses.dataclass
class Inputs:
    """One case's inputs: the global ``model`` (training mode), one observation per upload, the true images."""

    model: nn.Module
    spec: DataSpec
    observations: list[Observation]
    truth: torch.Tensor  # (U * batch, C, H, W) in [0, 1], upload by upload
    labels: torch.Tensor  # (U * batch,) int64, in the same order


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence breaching's and hydra's prints and warnings."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def missing_requirements() -> list[str]:
    """breaching and its pinned dependencies absent from this environment (torchvision: torch's release)."""
    _, minor, patch = (int(v) for v in torch.__version__.split("+")[0].split(".")[:3])
    pins = {**PEER_PINS, "torchvision": f"0.{minor + 15}.{patch}"}  # torch 2.N.p's torchvision is 0.(N+15).p

    def present(name: str) -> bool:
        try:
            return bool(metadata.version(name))
        except metadata.PackageNotFoundError:
            return False

    return [f"breaching=={BREACHING}"] + [f"{n}=={v}" for n, v in pins.items() if not present(n)]


def import_breaching(folder: Path) -> Any:
    """The breaching package from ``folder`` (installed there with pip on first use), last on ``sys.path``."""
    if not (folder / "breaching" / "__init__.py").is_file():
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-deps",
            "--upgrade",
            "--target",
            str(folder),
            *missing_requirements(),
        ]
        print(f"installing the peer: {shlex.join(command[3:])}", flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(
                f"installing breaching into {folder} failed:\n{done.stderr.strip()[-3000:]}\n\n"
                f"Install it by hand into that folder, then run again:\n  {shlex.join(command)}"
            )
    sys.path.append(str(folder))
    with quiet():
        import breaching
    return breaching


def capture(case: Case, uploads: int, seed: int) -> Inputs:
    """The case's model (built once with ``seed``) and ``uploads`` gradient observations of ``case.batch``
    distinct test images each (every 7th of the test split), client buffers included."""
    data = load_dataset(case.data)
    params = case.model_params if case.model_params is not None else MODELS.get(case.model).params()
    torch.manual_seed(seed)
    model = build_model(case.model, data.spec, params)
    arrays = get_arrays(model)
    card = ModelCard(
        case.model, dataclasses.asdict(params), data.spec, tuple(model.state_dict()), tuple(trainable_mask(model))
    )
    state = {n: torch.tensor(a) for n, a in zip(card.names, arrays)}
    batch = case.batch
    truth, labels = data.test.batch([index * 7 for index in range(uploads * batch)])
    observations = []
    for index in range(uploads):
        model.load_state_dict(state)
        images = slice(index * batch, (index + 1) * batch)
        grads, _ = compute_gradients(model, truth[images], labels[images])
        after = iter(grads)
        upload = [
            next(after).numpy() if t else a.detach().numpy().copy()
            for t, a in zip(card.trainable, model.state_dict().values())
        ]
        observations.append(card.observe(1, index, "gradient", arrays, upload, batch, {"batch-size": batch}))
    model.load_state_dict(state)
    return Inputs(model.train(), data.spec, observations, truth, labels)


@dataclasses.dataclass(frozen=True)
class Timing:
    """What one timed call gave: ``seconds``, its ``result`` on the host, the peak GPU memory in GiB over the
    call (``None`` off CUDA)."""

    seconds: float
    result: torch.Tensor
    peak_memory_gib: float | None


def measured(device: torch.device, fn: Callable[[], torch.Tensor]) -> Timing:
    """``fn`` timed on ``device``: on CUDA the queue is drained before the clock starts and stops, and the peak
    memory counter starts from the memory in use."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    result = fn().cpu()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return Timing(seconds, result, torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None)


def timed(device: torch.device, fn: Callable[[], list[torch.Tensor]]) -> Timing:
    """``fn``, which returns one (1, C, H, W) batch per upload, timed on ``device``; the result (U, C, H, W)."""
    return measured(device, lambda: torch.cat(fn()).detach())


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA, else the CPU's model."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def fedguard_params(case: Case, iterations: int, compile_mode: str, precision: str, device: torch.device) -> Any:
    """The attack's default parameters with the case's settings, ``iterations`` and ``device``, ``compile`` and
    (where the attack has it) ``precision`` as given."""
    params = dataclasses.replace(
        ATTACKS.get(case.fedguard).params(),
        iterations=iterations,
        device=device.type,
        compile=compile_mode,
        **case.fedguard_settings,
    )
    return dataclasses.replace(params, precision=precision) if hasattr(params, "precision") else params


def compiled(params: Any) -> bool:
    """Whether fedguard's search with ``params`` compiles on its device."""
    return compiles(
        params.compile,
        torch.device(params.device),
        params.iterations,
        precision=getattr(params, "precision", "float32"),
    )


def run_fedguard(name: str, params: Any, observations: list[Observation], batched: bool, seed: int) -> Timing:
    """All uploads in one ``reconstruct_many`` call, or one per call; the images (U, C, H, W)."""
    attack = build_attack(name, params)
    groups = [observations] if batched else [[o] for o in observations]
    return timed(
        torch.device(params.device),
        lambda: [r.images for group in groups for r in attack.reconstruct_many(group, seed=seed)],
    )


def breaching_attacker(
    breaching: Any, case: Case, iterations: int, model: nn.Module, device: torch.device
) -> tuple[Any, Any]:
    """(config, attacker): breaching's default config ``case.breaching`` with ``iterations``, on ``device``."""
    with quiet():
        cfg = breaching.get_attack_config(case.breaching, overrides=[f"optim.max_iterations={iterations}"])
    setup = dict(dtype=torch.float, device=device)
    return cfg, breaching.attacks.prepare_attack(copy.deepcopy(model), nn.CrossEntropyLoss(), cfg, setup)


def breaching_payload(obs: Observation, device: torch.device | str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(server payload, shared data) of one upload on ``device``, as breaching's server hands them to its attacker:
    global parameters and gradient, no buffers (BatchNorm on batch statistics, as in the client's step), no
    labels (breaching infers them from the gradient, on its device), images in [0, 1] (mean 0, std 1)."""
    from omegaconf import OmegaConf

    spec = obs.spec
    data = OmegaConf.create(
        dict(
            modality="vision",
            task="classification",
            shape=list(spec.shape),
            classes=spec.num_classes,
            mean=[0.0] * spec.channels,
            std=[1.0] * spec.channels,
        )
    )
    parameters = [torch.tensor(a, device=device) for a, t in zip(obs.global_arrays, obs.trainable) if t]
    gradients = [torch.tensor(a, device=device) for a, t in zip(obs.upload, obs.trainable) if t]
    shared = dict(
        gradients=gradients,
        buffers=None,
        metadata=dict(num_data_points=obs.num_examples, labels=None, local_hyperparams=None),
    )
    return dict(parameters=parameters, buffers=None, metadata=data), shared


def run_breaching(attacker: Any, observations: list[Observation], seed: int) -> Timing:
    """One ``reconstruct`` call per upload; the images (U, C, H, W) in breaching's normalized space, which is
    pixel space here."""
    payloads = [breaching_payload(o, attacker.setup["device"]) for o in observations]
    torch.manual_seed(seed)
    with quiet():
        return timed(
            attacker.setup["device"],
            lambda: [attacker.reconstruct([p], [s], {}, dryrun=False)[0]["data"] for p, s in payloads],
        )


def check_layout(model: nn.Module, obs: Observation) -> None:
    """breaching (and ``ig_vs_bare_loop.py``'s bare loop) pair gradients with ``model.parameters()``; they must be
    the observation's trainable entries."""
    expected = [n for n, t in zip(obs.names, obs.trainable) if t]
    if [n for n, _ in model.named_parameters()] != expected:
        raise ValueError(f"{obs.model}: parameter order differs from the state_dict's trainable entries")


def score(
    tool: str,
    case: Case,
    attack: str,
    iterations: int,
    seconds: float,
    recon: torch.Tensor,
    truth: torch.Tensor,
    peak_memory_gib: float | None = None,
) -> dict[str, Any]:
    """One table row: mean PSNR (dB, capped), mean SSIM, leaked count and speed of ``recon`` vs ``truth``
    (both (U * batch, C, H, W), upload by upload; each upload's images matched to its true ones by MSE)."""
    recon = torch.nan_to_num(recon.float(), nan=0.5).clamp(0, 1)
    order = [
        start + int(i)
        for start in range(0, len(truth), case.batch)
        for i in match(recon[start : start + case.batch], truth[start : start + case.batch])
    ]
    recon, uploads = recon[order], len(truth) // case.batch
    structure = ssim(recon, truth)
    return {
        "tool": tool,
        "model": case.model_label,
        "attack": attack,
        "iterations": iterations,
        "uploads": uploads,
        "psnr_db": float(clip_psnr(psnr(recon, truth)).mean()),
        "ssim": float(structure.mean()),
        "ssim_over_0.9": int((structure > LEAK_SSIM).sum()),
        "seconds": seconds,
        "recon_per_s": uploads / seconds,
        "peak_memory_gib": peak_memory_gib,
    }


def warm_up_fedguard(case: Case, params: Any, observations: list[Observation], seed: int) -> float:
    """Seconds of a few iterations of the batched and the one-upload search, compiled when the timed runs
    compile (the programs they run are built here)."""
    warm = dataclasses.replace(params, iterations=WARM_UP_ITERATIONS, compile="on" if compiled(params) else "off")
    start = time.perf_counter()
    run_fedguard(case.fedguard, warm, observations, True, seed)
    run_fedguard(case.fedguard, warm, observations[:1], True, seed)
    return time.perf_counter() - start


def scaled(iterations: int, scale: float) -> int:
    """``iterations`` times ``--iterations-scale``, at least 1."""
    return max(1, round(iterations * scale))


def run_case(
    breaching: Any,
    name: str,
    case: Case,
    uploads: int,
    scale: float,
    seed: int,
    compile_mode: str,
    precision: str,
    device: torch.device,
    fedguard_iterations: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The case's rows (fedguard batched, fedguard one at a time, fedguard batched at the case's
    ``quality_iterations`` where it has them, breaching) and each tool's configuration; ``fedguard_iterations``:
    fedguard's count instead of the case's in every fedguard row (breaching keeps its own)."""
    from omegaconf import OmegaConf

    iterations = scaled(fedguard_iterations or case.iterations, scale)
    breaching_iterations = scaled(case.breaching_iterations or case.iterations, scale)
    inputs = capture(case, uploads, seed)
    check_layout(inputs.model, inputs.observations[0])
    params = fedguard_params(case, iterations, compile_mode, precision, device)
    cfg, attacker = breaching_attacker(breaching, case, breaching_iterations, inputs.model, device)
    warm_up = warm_up_fedguard(case, params, inputs.observations, seed)
    run_breaching(
        breaching_attacker(breaching, case, WARM_UP_ITERATIONS, inputs.model, device)[1], inputs.observations[:1], seed
    )
    runs = [(BATCHED, params, True, warm_up), (ONE_AT_A_TIME, params, False, warm_up)]
    if case.quality_iterations and not fedguard_iterations:
        fewer = dataclasses.replace(params, iterations=scaled(case.quality_iterations, scale))
        runs.append((FEWER, fewer, True, warm_up_fedguard(case, fewer, inputs.observations, seed)))
    rows = []
    for tool, tool_params, batched, tool_warm_up in runs:
        run = run_fedguard(case.fedguard, tool_params, inputs.observations, batched, seed)
        rows.append(
            score(
                tool,
                case,
                case.fedguard,
                tool_params.iterations,
                run.seconds,
                run.result,
                inputs.truth,
                run.peak_memory_gib,
            )
        )
        rows[-1].update(
            compiled=compiled(tool_params),
            warm_up_s=tool_warm_up,
            precision=getattr(tool_params, "precision", "float32"),
        )
    run = run_breaching(attacker, inputs.observations, seed)
    rows.append(
        score(
            "breaching",
            case,
            f"{case.breaching}.yaml",
            breaching_iterations,
            run.seconds,
            run.result,
            inputs.truth,
            run.peak_memory_gib,
        )
    )
    for row in rows:
        row["case"], row["vs_breaching"] = name, row["recon_per_s"] / rows[-1]["recon_per_s"]
    config = {
        "model": case.model,
        "model_params": dataclasses.asdict(case.model_params) if case.model_params else {},
        "fedguard": {"attack": case.fedguard, "params": dataclasses.asdict(params)},
        "breaching": {
            "config": f"breaching/config/attack/{case.breaching}.yaml",
            "attack": OmegaConf.to_container(cfg, resolve=True),
            "setup": {
                "device": device.type,
                "dtype": "float32",
                "loss": "torch.nn.CrossEntropyLoss()",
                "data": {"shape": list(inputs.spec.shape), "mean": 0.0, "std": 1.0},
                "labels": None,
                "buffers": None,
                "num_data_points": 1,
            },
        },
    }
    return rows, config


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ('unknown' where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as plain aligned text."""
    print(
        f"{'tool':23} {'model':11} {'attack':24} {'iters':>6} {'uploads':>7} {'PSNR dB':>8} {'SSIM':>6} "
        f"{'>0.9':>4} {'seconds':>9} {'recon/s':>8} {'vs breaching':>12} {'compiled':>8} {'precision':>9} "
        f"{'warm-up s':>9} {'peak GiB':>8}"
    )
    for r in rows:
        compiled_text = {True: "yes", False: "no"}.get(r.get("compiled"), "-")
        warm_up = f"{r['warm_up_s']:.1f}" if "warm_up_s" in r else "-"
        memory = "-" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.2f}"
        print(
            f"{r['tool']:23} {r['model']:11} {r['attack']:24} {r['iterations']:>6} {r['uploads']:>7} "
            f"{r['psnr_db']:>8.2f} {r['ssim']:>6.3f} {r['ssim_over_0.9']:>4} {r['seconds']:>9.2f} "
            f"{r['recon_per_s']:>8.3f} {r['vs_breaching']:>11.2f}x {compiled_text:>8} "
            f"{r.get('precision', '-'):>9} {warm_up:>9} {memory:>8}"
        )


def verdicts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case with a target: the fastest batched fedguard row at equal or better mean SSIM than breaching's
    (None where none reached it), whether its ratio meets the target, and whether every one-upload-at-a-time
    row is at least as fast as breaching (the project's other target)."""
    results = {}
    for name, case in CASES.items():
        case_rows = [r for r in rows if r["case"] == name]
        if case.target is None or not case_rows:
            continue
        peer = next(r for r in case_rows if r["tool"] == "breaching")
        batched = [r for r in case_rows if r["tool"] in (BATCHED, FEWER) and r["ssim"] >= peer["ssim"]]
        best = max(batched, key=lambda r: r["vs_breaching"], default=None)
        alone = [r["vs_breaching"] for r in case_rows if r["tool"] == ONE_AT_A_TIME]
        results[name] = {
            "target": case.target,
            "breaching_ssim": peer["ssim"],
            "best": None if best is None else {k: best[k] for k in ("tool", "iterations", "ssim", "vs_breaching")},
            "met": best is not None and best["vs_breaching"] >= case.target,
            "one_at_a_time_not_slower": all(ratio >= 1.0 for ratio in alone),
        }
    return results


def print_verdicts(results: dict[str, dict[str, Any]]) -> None:
    """One line per case: the target, the best row at breaching's quality, met or not."""
    for name, v in results.items():
        best = v["best"]
        found = (
            "no batched row reached it"
            if best is None
            else f"{best['vs_breaching']:.2f}x ({best['tool']}, "
            f"{best['iterations']} iterations, SSIM {best['ssim']:.3f})"
        )
        print(
            f"{name}: target {v['target']:g}x at SSIM >= breaching's {v['breaching_ssim']:.3f}: {found}: "
            f"{'met' if v['met'] else 'NOT met'}; one upload at a time not slower than breaching: "
            f"{'yes' if v['one_at_a_time_not_slower'] else 'NO'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--uploads", type=int, default=TARGET_UPLOADS, help="batch-1 uploads attacked per case")
    parser.add_argument("--iterations-scale", type=float, default=1.0, help="multiplier of every case's iterations")
    parser.add_argument(
        "--fedguard-iterations",
        type=int,
        help="fedguard's iterations in every case instead of the case's; breaching keeps its own "
        "(the iterations fedguard needs for breaching's quality)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both tools")
    parser.add_argument("--seed", type=int, default=0, help="model weights and attack starting points")
    parser.add_argument("--device", default="auto", choices=DEVICES, help="both tools' device (auto: CUDA if any)")
    parser.add_argument("--compile", default="auto", choices=COMPILE_MODES, help="fedguard's compile parameter")
    parser.add_argument(
        "--precision",
        default="float32",
        choices=list(PRECISIONS),
        help="fedguard's precision parameter (attacks that have one)",
    )
    parser.add_argument("--peer-dir", type=Path, default=HERE / ".peers" / f"breaching-{BREACHING}")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "vs_breaching.json")
    args = parser.parse_args()
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.uploads < 1 or args.iterations_scale <= 0 or args.threads < 1 or (args.fedguard_iterations or 1) < 1:
        parser.error("--uploads, --threads and --fedguard-iterations must be >= 1 and --iterations-scale > 0")
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    breaching = import_breaching(args.peer_dir.resolve())
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, breaching {BREACHING}, {args.threads} thread(s), {device_name(device)}, "
        f"{args.uploads} uploads per case",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    configs: dict[str, Any] = {}
    for name in names:
        case_rows, configs[name] = run_case(
            breaching,
            name,
            CASES[name],
            args.uploads,
            args.iterations_scale,
            args.seed,
            args.compile,
            args.precision,
            device,
            args.fedguard_iterations,
        )
        rows += case_rows
        print(f"{name}: done", flush=True)
    print_table(rows)
    targets = verdicts(rows)
    if args.uploads != TARGET_UPLOADS or args.iterations_scale != 1.0 or args.fedguard_iterations:
        print(f"(the targets are set for {TARGET_UPLOADS} uploads at the cases' own iterations; this run differs)")
    print_verdicts(targets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "torch": torch.__version__,
        "breaching": BREACHING,
        "threads": args.threads,
        "device": device_name(device),
        "cpu": cpu_model(),
        "compile": args.compile,
        "precision": args.precision,
        "uploads": args.uploads,
        "iterations_scale": args.iterations_scale,
        "fedguard_iterations": args.fedguard_iterations,
        "seed": args.seed,
        "data": DATA,
        "cases": configs,
        "rows": rows,
        "targets": targets,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
