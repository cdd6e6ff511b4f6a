"""``fedguard``: run simulations and inspect configurations."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from attackers.diffusion import DEFAULT_NOISE_RANGE, PRESETS, DDPMTrainOptions, SurrogateOptions
from attackers.generators import SPLITS, TrainOptions
from fedguard.config import Config, ConfigError, load_config, schema
from fedguard.data import DatasetNotFoundError
from fedguard.defenses.evalnet import EvalNetOptions
from fedguard.limits import writable_problem

if TYPE_CHECKING:
    import numpy as np


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("preset", nargs="?", help="experiment preset, a TOML file (see experiments/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set train.rounds=5 (repeatable; `fedguard config --keys` lists keys)",
    )


def _add_trained_network_arguments(
    parser: argparse.ArgumentParser,
    data: str,
    defaults: TrainOptions | EvalNetOptions,
    options: tuple[tuple[str, type, str], ...],
    folder: str,
    data_hint: str = "",
) -> None:
    """The arguments of a command that trains a network on a public split: ``--data`` (default ``data``),
    ``--split``, one flag per field of ``defaults`` in ``options`` (flag, type, meaning), ``--out`` (default
    ``<folder>/<data>.npz``) and ``--data-root``."""
    hint = f"; {data_hint}" if data_hint else ""
    parser.add_argument("--data", default=data, help=f"dataset name (default {data}{hint})")
    parser.add_argument(
        "--split", choices=SPLITS, default="test", help="'test' (default): the held-out split clients never train on"
    )
    for flag, kind, meaning in options:
        default = getattr(defaults, flag.replace("-", "_"))
        parser.add_argument(f"--{flag}", type=kind, default=default, help=f"{meaning} (default {default})")
    parser.add_argument("--out", type=Path, help=f"output .npz (default {folder}/<data>.npz)")
    parser.add_argument("--data-root", default="", help="folder of datasets that do not ship with the packages")


GENERATOR_OPTIONS = (
    ("epochs", int, "passes over the split"),
    ("latent-dim", int, "latent dimension"),
    ("batch-size", int, "minibatch size"),
    ("lr", float, "Adam learning rate"),
    ("seed", int, "seed of weights, shuffling and noise"),
)
EVALNET_OPTIONS = (
    ("epochs", int, "passes over the split"),
    ("width", int, "channels of the first layer"),
    ("mixes", int, "noise mixes (Adam steps) per minibatch"),
    ("batch-size", int, "minibatch size"),
    ("lr", float, "Adam learning rate"),
    ("seed", int, "seed of weights, shuffling, ratios and noise"),
)


def _add_mjolnir_arguments(parser: argparse.ArgumentParser) -> None:
    surrogate, training = SurrogateOptions(), DDPMTrainOptions()
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="test",
        help="the public split the surrogate trains on ('test' (default): no client trains on it)",
    )
    parser.add_argument(
        "--surrogate-data",
        metavar="NAME",
        help="the dataset whose public split the surrogate trains on (default: the preset's "
        "data.name); its samples must have the run's shape and classes, e.g. fashion-mnist for "
        "an MNIST run",
    )
    for flag, kind, default, meaning in (
        ("gradients", int, surrogate.gradients, "clean gradients recorded along the surrogate's training"),
        ("surrogate-epochs", int, surrogate.epochs, "passes of the surrogate over the public split"),
        (
            "surrogate-lr",
            float,
            surrogate.lr,
            "SGD step of the surrogate (0: every gradient at its starting "
            "weights, the run's round-1 global model under the preset's seed)",
        ),
        ("epochs", int, training.epochs, "DDPM training epochs"),
        ("ddpm-batch-size", int, training.batch_size, "DDPM minibatch size"),
        ("lr", float, 1e-3, "DDPM Adam step"),
    ):
        parser.add_argument(f"--{flag}", type=kind, default=default, help=f"{meaning} (default {default})")
    parser.add_argument(
        "--seed",
        type=int,
        help="seed of the surrogate's initialization, the batches and the DDPM "
        "(default: the preset's seed, which initializes the global model)",
    )
    parser.add_argument(
        "--at",
        type=Path,
        metavar="OBSERVATION",
        help="a captured upload (runs/<run>/observations/round-R_client-C.npz): the surrogate starts "
        "at the global model the server sent in that round (default: the seeded initialization)",
    )
    parser.add_argument("--unet", choices=sorted(PRESETS), default="cpu", help="denoiser size (default cpu)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help="where the denoiser trains (default cpu; auto: CUDA when available)",
    )
    parser.add_argument(
        "--conditional",
        action="store_true",
        help="train the conditional denoiser (Mjölnir (Condition)): the UNet also sees the noisy "
        "gradient, learned from pairs of each clean gradient and a freshly noised copy; "
        "default output mjolnir/<data>-<model>-conditional.npz (default: the unconditional one)",
    )
    parser.add_argument(
        "--noise-range",
        metavar="MIN,MAX",
        help="with --conditional: the noise levels M (noise std over the packing scale) of the "
        "training pairs, log-uniform on [MIN, MAX]; one value fixes M (default "
        f"{DEFAULT_NOISE_RANGE[0]:g},{DEFAULT_NOISE_RANGE[1]:g}: every level the M-adaptive "
        "start resolves)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="output .npz (default mjolnir/<data>-<model>.npz, <data> the "
        "surrogate's dataset; the training gradients go beside it, as "
        "<name>.gradients.npz)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        metavar="N",
        help="write the training state to <name>.checkpoint.npz beside the output after every N-th "
        "epoch and the last (default 1; 0: never)",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="CHECKPOINT",
        help="go on from a checkpoint of this run (same preset, --set and options; --epochs the "
        "total): the result equals one uninterrupted run",
    )


def _resolve(args: argparse.Namespace) -> Config:
    config = load_config(args.preset, args.overrides)
    if config.run.resume and getattr(args, "resume", None) is None:
        raise ValueError("resume = true: resume a run with `fedguard run --resume RUN_DIR`")
    if getattr(args, "out", None):
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(args.out)))
    return config


def _planned(args: argparse.Namespace) -> Config:
    """The configuration of the run plan in ``args.plan`` (``fedguard.run_plan``), rebuilt without validating it
    again, into ``args.out`` when given; ``ValueError`` or ``ConfigError`` saying why it cannot be read."""
    if args.preset is not None or args.overrides or args.resume is not None:
        raise ValueError(
            f"--plan {args.plan}: the plan holds the whole configuration; drop the preset, --set and --resume"
        )
    try:
        text = args.plan.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--plan {args.plan}: cannot be read ({error})") from None
    config = Config.from_plan(text)
    if args.out:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(args.out)))
    return config


def _resumed(args: argparse.Namespace) -> Config:
    """The configuration of the run in ``args.resume``, set to go on from its checkpoint
    (``fedguard.runtime.preflight.resumed``); ``ValueError`` saying why it cannot."""
    from fedguard.runtime.preflight import resumed
    from fedguard.store.folder import CONFIG_FILE

    if args.preset is not None or args.out is not None:
        raise ValueError(
            f"--resume {args.resume}: the run's own {CONFIG_FILE} and folder are used; drop the preset and --out"
        )
    return resumed(args.resume, args.overrides)


def _run_config(args: argparse.Namespace) -> Config:
    """The configuration ``fedguard run`` was given: a plan (``--plan``), a stopped run (``--resume``), or a preset
    and ``--set``."""
    if args.plan is not None:
        return _planned(args)
    if args.resume is not None:
        return _resumed(args)
    return _resolve(args)


def cmd_run(args: argparse.Namespace) -> int:
    """Run a Flower simulation of the configured federation: check the configuration, data and files first,
    then follow the run to its end (rounds, attacks, report). Exits 0 when the run completed, 1 when it failed,
    2 when it was refused (the configuration, this machine, a folder another run writes) or a plugin's code
    stopped it, 128 + N when signal N stopped it."""
    # A light process (fedguard.runtime.launcher) takes this one's place and waits for the run.
    from fedguard.runtime.preflight import ready
    from fedguard.runtime.simulation import prepare

    config, line = ready(_run_config(args), args.out)
    plan = prepare(config, verbose=args.verbose)
    print(line, flush=True)
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "fedguard.runtime.launcher", str(plan.save())])
    return 1  # not reached: execv replaces this process


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved configuration, or every key with its default and meaning."""
    if args.keys:
        for key, (kind, default, help_text) in schema().items():
            print(f"{key} = {json.dumps(default)}  ({kind.__name__}) {help_text}")
        return 0
    config = _resolve(args)
    for key, value in config.to_flat().items():
        print(f"{key} = {json.dumps(value)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Write report.html in a run folder (curves, attack scores, reconstructions, in one file), or sweep.html in
    a sweep's folder (privacy against utility, leakage per round, cost, the tables)."""
    from fedguard.report.html import build_report
    from fedguard.report.sweep_html import build_sweep_page
    from fedguard.store.folder import SWEEP_FILE

    if (Path(args.run_dir) / SWEEP_FILE).is_file():
        print(build_sweep_page(args.run_dir))
    else:
        print(build_report(args.run_dir))
    return 0


def _seed_list(text: str) -> list[int]:
    """``--seeds 0,1,2``: distinct whole numbers >= 0 (argparse names the bad value)."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct whole numbers >= 0 separated by commas, e.g. 0,1")
    return seeds


def _interrupt(signum: int, _frame: object) -> None:
    """Turn SIGTERM into the KeyboardInterrupt that Ctrl-C raises."""
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run every setting x variant of a sweep preset (e.g. every defense), then print the summary table."""
    from fedguard.commands.sweep import load_sweep, run_sweep
    from fedguard.runtime.preflight import machine_problems
    from fedguard.store.folder import SUMMARY_FILE

    sweep = load_sweep(args.preset, args.out, args.overrides, args.only, args.seeds)
    problems = machine_problems([(f"{run.setting}/{run.variant}", run.config) for run in sweep.runs])
    if problem := writable_problem("--out", args.out) if args.out else writable_problem("sweep folder", sweep.folder):
        problems.append(problem)
    if problems:
        raise ConfigError(problems)
    signal.signal(signal.SIGTERM, _interrupt)  # a terminated sweep stops its run as Ctrl-C does, results kept
    print(f"fedguard: sweep {sweep.name}: {len(sweep.runs)} runs in {sweep.folder}", flush=True)
    start = time.perf_counter()
    rows = run_sweep(sweep, lambda line: print(line, flush=True), warm=not args.cold)
    print((sweep.folder / SUMMARY_FILE).read_text(), end="")
    print(f"fedguard: sweep done in {time.perf_counter() - start:.0f} s; summary in {sweep.folder / SUMMARY_FILE}")
    return 0 if all(row["status"] == "ok" and not row["failed_seeds"] for row in rows) else 1


def cmd_attack(args: argparse.Namespace) -> int:
    """Run an attack on the observations a run captured, score it, and rebuild the report."""
    from fedguard.commands.attack import attack_capture

    run_dir, rows = attack_capture(args.capture_dir, args.overrides)
    if not rows:
        print(
            f"fedguard: no observation of {run_dir} was attacked (none readable, or none captured under the "
            f"manipulation the chosen attacks exploit); see the lines above",
            file=sys.stderr,
        )
        return 2
    return 0


def cmd_train_generator(args: argparse.Namespace) -> int:
    """Train a generator (a VAE's decoder) on public data for the generative-prior attack 'ggl'."""
    from attackers.generators import default_generator_path, save_generator, train_generator
    from fedguard.data import SourceOptions

    options = TrainOptions(args.epochs, args.batch_size, args.lr, args.latent_dim, seed=args.seed)
    trained = train_generator(
        args.data,
        args.split,
        options,
        SourceOptions(root=args.data_root),
        progress=lambda stats: print(f"fedguard: {stats}", flush=True),
    )
    print(f"fedguard: saved {save_generator(trained, args.out or default_generator_path(args.data))}")
    return 0


def global_weights_of(path: Path, config: Config) -> list[np.ndarray]:
    """The global model's arrays a captured upload was computed at; ``ConfigError`` when the capture is not one
    of the run ``config`` describes (``fedguard.store.observations``)."""
    from fedguard.store.observations import ObservationRefused, RunExpectations, read_observation

    if not path.is_file():
        raise ConfigError([f"--at {path}: no such captured upload (look in runs/<run>/observations/)"])
    try:
        obs = read_observation(path, path.parent.parent, RunExpectations.of(config))
    except ObservationRefused as refused:
        raise ConfigError([f"--at {refused}; pass the run's preset or --set model.*"]) from None
    print(f"fedguard: the surrogate starts at the global model of round {obs.round} ({path})", flush=True)
    return list(obs.global_arrays)


def _training_noise_range(args: argparse.Namespace) -> tuple[float, float] | None:
    """The conditional denoiser's training noise range from --conditional and --noise-range; None: unconditional."""
    from attackers.diffusion.condition import parse_noise_range

    if args.noise_range is not None and not args.conditional:
        raise ValueError(f"--noise-range {args.noise_range} is for the conditional denoiser: add --conditional")
    if not args.conditional:
        return None
    return DEFAULT_NOISE_RANGE if args.noise_range is None else parse_noise_range(args.noise_range)


def cmd_train_mjolnir(args: argparse.Namespace) -> int:
    """Train Mjölnir's gradient diffusion model on a surrogate's clean gradients, for the run a preset describes."""
    from attackers.diffusion import load_checkpoint, save_ddpm, save_gradient_set
    from attackers.diffusion.pipeline import train_mjolnir
    from attackers.diffusion.surrogate import check_surrogate_data
    from attackers.jobs import resolve_device

    if args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got {args.checkpoint_every}")
    device = resolve_device(args.device)
    resume = None if args.resume is None else load_checkpoint(args.resume)
    config = load_config(args.preset, args.overrides)
    seed = config.run.seed if args.seed is None else args.seed
    surrogate = SurrogateOptions(
        args.surrogate_epochs, config.train.batch_size, args.surrogate_lr, args.gradients, seed
    )
    training = DDPMTrainOptions(
        args.epochs, args.ddpm_batch_size, args.lr, seed, noise_range=_training_noise_range(args)
    )
    data = args.surrogate_data or config.data.name
    if data != config.data.name:
        check_surrogate_data(config.data.name, data, config.data.source_options())
    weights = None if args.at is None else global_weights_of(args.at, config)
    out = args.out or Path("mjolnir") / f"{data}-{config.model.name}{'-conditional' if args.conditional else ''}.npz"
    checkpoint = None if args.checkpoint_every == 0 else out.with_suffix(".checkpoint.npz")
    print(
        f"fedguard: {args.gradients} surrogate gradients of {config.model.name} (batch {config.train.batch_size}) "
        f"on the public {args.split} split of {data}, then a {args.unet} DDPM",
        flush=True,
    )
    if resume is not None:
        print(f"fedguard: resuming {args.resume} after epoch {resume.state.epoch} of {args.epochs}", flush=True)
    trained, gradients = train_mjolnir(
        config.model.name,
        config.model.params,
        data,
        surrogate,
        args.unet,
        training,
        args.split,
        config.data.source_options(),
        on_epoch=lambda stats: print(f"fedguard: {stats}", flush=True),
        weights=weights,
        checkpoint=checkpoint,
        checkpoint_every=args.checkpoint_every or 1,
        resume=resume,
        device=device,
    )
    print(f"fedguard: saved {save_ddpm(trained, out)}")
    print(
        f"fedguard: saved the training gradients to {save_gradient_set(gradients, out.with_suffix('.gradients.npz'))}"
    )
    if checkpoint is not None:
        print(f"fedguard: the training state to resume from is {checkpoint}")
    return 0


def cmd_train_evalnet(args: argparse.Namespace) -> int:
    """Train the evaluation network (a noise-ratio regressor) on public data for the defense 'refiner'."""
    from fedguard.data import SourceOptions
    from fedguard.defenses.evalnet import default_evalnet_path, save_evalnet, train_evalnet

    options = EvalNetOptions(args.epochs, args.batch_size, args.lr, args.width, args.mixes, args.seed)
    trained = train_evalnet(
        args.data,
        args.split,
        options,
        SourceOptions(root=args.data_root),
        progress=lambda stats: print(f"fedguard: {stats}", flush=True),
    )
    print(f"fedguard: saved {save_evalnet(trained, args.out or default_evalnet_path(args.data))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = argparse.ArgumentParser(
        prog="fedguard",
        description="Gradient leakage in federated learning: simulate, capture, attack, defend.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help=cmd_run.__doc__, description=cmd_run.__doc__)
    _add_config_arguments(run)
    run.add_argument("--out", type=Path, help="output folder (default runs/<name>, or runs/<name>-N if taken)")
    run.add_argument("--verbose", action="store_true", help="show Flower's and Ray's own logs")
    run.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="go on with a stopped run from its last completed round (its own config.toml; --set "
        "only train.rounds, sim.* or pool.*): the rounds equal one uninterrupted run's",
    )
    run.add_argument(
        "--plan",
        type=Path,
        metavar="PLAN_FILE",
        help="run a configuration validated already: the run plan (JSON) that the Python API and fedguard sweep "
        "write, in place of a preset and --set",
    )
    run.set_defaults(handler=cmd_run)

    config = commands.add_parser("config", help=cmd_config.__doc__, description=cmd_config.__doc__)
    _add_config_arguments(config)
    config.add_argument("--keys", action="store_true", help="list every key with its default and meaning")
    config.set_defaults(handler=cmd_config)

    sweep = commands.add_parser("sweep", help=cmd_sweep.__doc__, description=cmd_sweep.__doc__)
    sweep.add_argument("preset", type=Path, help="a sweep preset: a TOML file with a [sweep] table (see experiments/)")
    sweep.add_argument("--out", type=Path, help="folder of the sweep (default runs/<name>); finished runs are kept")
    sweep.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key in every run, after the setting's and the variant's (repeatable), "
        "e.g. --set train.rounds=2 for a quick pass",
    )
    sweep.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="[SETTING/]VARIANT",
        help="run only this variant (in every setting, or in the one named); repeatable",
    )
    sweep.add_argument(
        "--seeds",
        type=_seed_list,
        metavar="N[,N...]",
        help="run these seeds instead of the preset's [sweep] seeds, e.g. --seeds 0",
    )
    sweep.add_argument(
        "--cold",
        action="store_true",
        help="run each run as its own `fedguard run` process (its own Python, SuperLink and Flower submission) "
        "instead of one after another in one warm runner; the results are the same",
    )
    sweep.set_defaults(handler=cmd_sweep)

    attack = commands.add_parser("attack", help=cmd_attack.__doc__, description=cmd_attack.__doc__)
    attack.add_argument(
        "capture_dir",
        type=Path,
        metavar="CAPTURE_DIR",
        help="a run folder or its observations/ folder; the run's config.toml is the starting point",
    )
    attack.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="e.g. --set attack.name=ig --set attack.ig.iterations=500 (repeatable)",
    )
    attack.set_defaults(handler=cmd_attack)

    report = commands.add_parser("report", help=cmd_report.__doc__, description=cmd_report.__doc__)
    report.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR",
        help="a run folder, e.g. runs/quickstart, or a sweep folder, e.g. runs/defenses",
    )
    report.set_defaults(handler=cmd_report)

    generator = commands.add_parser(
        "train-generator", help=cmd_train_generator.__doc__, description=cmd_train_generator.__doc__
    )
    _add_trained_network_arguments(generator, "mnist-5k", TrainOptions(), GENERATOR_OPTIONS, "generators")
    generator.set_defaults(handler=cmd_train_generator)

    mjolnir = commands.add_parser(
        "train-mjolnir", help=cmd_train_mjolnir.__doc__, description=cmd_train_mjolnir.__doc__
    )
    _add_config_arguments(mjolnir)
    _add_mjolnir_arguments(mjolnir)
    mjolnir.set_defaults(handler=cmd_train_mjolnir)

    evalnet = commands.add_parser(
        "train-evalnet", help=cmd_train_evalnet.__doc__, description=cmd_train_evalnet.__doc__
    )
    _add_trained_network_arguments(
        evalnet, "photos", EvalNetOptions(), EVALNET_OPTIONS, "evalnets", "mnist-5k for digits"
    )
    evalnet.set_defaults(handler=cmd_train_evalnet)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fedguard`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, DatasetNotFoundError, FileExistsError, FileNotFoundError) as error:  # incl. ConfigError
        print(f"fedguard: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedguard: interrupted; finished rounds are in the run folder", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
