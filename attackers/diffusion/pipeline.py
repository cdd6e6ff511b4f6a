"""``fedguard train-mjolnir``: collect a surrogate's clean gradients, train the gradient DDPM on them, save it.

The saved model's ``normalization`` record says what it denoises: the packing of the gradient (shapes,
side, scale), the model and its parameters, the dataset and split the surrogate trained on, the batch size
of the recorded gradients, and ``signal_power``, the mean square of the packed training gradients over
their real entries (what ``estimate_noise_level`` subtracts). With a checkpoint file the training state is
written after epochs, and a later call that resumes it goes on where it stopped (``checkpoint``). Training
options with a ``noise_range`` train the conditional model (``condition``), its conditions noised on the
packing's real entries only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attackers.diffusion.checkpoint import Checkpoint, check_resumable, grids_digest, save_checkpoint
from attackers.diffusion.ddpm import DDPMTrainOptions, TrainState, train_ddpm
from attackers.diffusion.packing import PackingSpec, spec_from_dict, spec_to_dict, valid_mask
from attackers.diffusion.store import TrainedDDPM
from attackers.diffusion.surrogate import GradientSet, RecordStats, SurrogateOptions, collect_gradients
from attackers.diffusion.unet import preset
from fedguard.data import SourceOptions
from fedguard.trained.fitting import EpochStats


def signal_power(gradients: GradientSet) -> float:
    """Mean square of the packed training gradients over their real (unpadded) entries."""
    mask = valid_mask(gradients.spec)
    return float(gradients.images[:, mask].double().pow(2).mean())


def train_mjolnir(
    model: str,
    model_params: Any,
    dataset: str,
    surrogate: SurrogateOptions,
    unet: str,
    training: DDPMTrainOptions,
    split: str = "test",
    source: SourceOptions = SourceOptions(),
    on_gradient: Callable[[RecordStats], None] | None = None,
    on_epoch: Callable[[EpochStats], None] | None = None,
    weights: Sequence[np.ndarray] | None = None,
    checkpoint: Path | None = None,
    checkpoint_every: int = 1,
    resume: Checkpoint | None = None,
    device: torch.device | str = "cpu",
) -> tuple[TrainedDDPM, GradientSet]:
    """Algorithms 1 and 2: surrogate gradients of ``model`` on ``split`` of ``dataset``, then the DDPM; returns
    the model and the gradient data set it learned. ``weights``: the surrogate's starting ``state_dict`` arrays
    (e.g. a captured round's global model), None for the seeded initialization. ``checkpoint``: a file the
    training state is written to after every ``checkpoint_every``-th epoch and the last (None: none);
    ``resume``: a checkpoint of this very run (same gradients, record, UNet and options but epochs) to go on
    from; ``device``: where the DDPM trains (the gradients are collected on the CPU)."""
    gradients = collect_gradients(model, model_params, dataset, split, surrogate, source, on_gradient, weights)
    record = training_record(gradients, dataset, split, surrogate, unet)
    config, side, digest = preset(unet), gradients.spec.side, grids_digest(gradients.images)
    if resume is not None:
        check_resumable(resume, config, side, training, record, digest)

    def save(state: TrainState) -> None:
        assert checkpoint is not None  # save is handed on only with a checkpoint file
        save_checkpoint(Checkpoint(state, config, side, training, record, digest), checkpoint)

    network, losses = train_ddpm(
        gradients.images.to(device),
        config,
        training,
        on_epoch,
        None if resume is None else resume.state,
        None if checkpoint is None else save,
        checkpoint_every,
        valid_mask(gradients.spec).to(device),
    )
    return TrainedDDPM(network, training.schedule, record, tuple(losses), training.noise_range), gradients


def training_record(
    gradients: GradientSet, dataset: str, split: str, surrogate: SurrogateOptions, unet: str
) -> dict[str, Any]:
    """What a model trained on ``gradients`` denoises (module docstring), JSON-ready."""
    return {
        "packing": spec_to_dict(gradients.spec),
        "model": gradients.model,
        "model_params": gradients.model_params,
        "dataset": dataset,
        "split": split,
        "batch_size": surrogate.batch_size,
        "signal_power": signal_power(gradients),
        "unet": unet,
        "surrogate": asdict(surrogate),
        "start": gradients.start,
    }


def packing_of(trained: TrainedDDPM) -> PackingSpec:
    """The packing a saved model was trained with; ``ValueError`` when its record has none."""
    if "packing" not in trained.normalization:
        raise ValueError("this diffusion model records no gradient packing; train it with `fedguard train-mjolnir`")
    return spec_from_dict(trained.normalization["packing"])


def check_shapes(trained: TrainedDDPM, shapes: list[tuple[int, ...]]) -> PackingSpec:
    """The model's packing, after checking that it packs gradients of ``shapes`` (the trainable parameters)."""
    spec = packing_of(trained)
    if [tuple(s) for s in spec.shapes] != [tuple(s) for s in shapes]:
        record = trained.normalization
        raise ValueError(
            f"the diffusion model denoises gradients of {record.get('model')!r} "
            f"{record.get('model_params')} ({len(spec.shapes)} tensors, {spec.numel} entries), not of "
            f"this model ({len(shapes)} tensors, {sum(torch.Size(s).numel() for s in shapes)} entries); "
            f"train one with `fedguard train-mjolnir --model <name>`"
        )
    return spec
