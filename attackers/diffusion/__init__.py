"""Mjölnir (Liu et al., AAAI 2025): a diffusion model trained on clean gradients denoises perturbed ones.

A gradient packed into a 1 x S x S grid and divided by a fixed scale is a
training sample of a DDPM (``ddpm``, with the UNet of ``unet``); a gradient
perturbed by noise of std M in those units, rescaled by 1 / sqrt(1 + M**2), is
a sample of the forward process at the step whose alpha-bar is 1 / (1 + M**2),
so the reverse chain from that step down to step 0 denoises it (``denoise``).
The conditional variant ("Mjölnir (Condition)", ``condition``) also feeds the
rescaled noisy gradient to the UNet as a second channel at every step.
``noise`` turns DP, Gaussian and Laplace parameters into M, or estimates it.
``store`` keeps a trained model in one ``.npz``, ``checkpoint`` a training run
to resume. ``packing`` turns a model's gradient into that grid and back,
exactly; ``surrogate`` collects the clean training gradients (Algorithm 1) from
a surrogate model trained on public data.
Pure torch.
"""

from attackers.diffusion.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from attackers.diffusion.condition import (
    DEFAULT_NOISE_RANGE,
    condition_of,
    draw_noise_levels,
    noisy_condition,
)
from attackers.diffusion.ddpm import (
    LOSSES,
    DDPMTrainOptions,
    Schedule,
    TrainState,
    diffusion_loss,
    q_sample,
    train_ddpm,
)
from attackers.diffusion.denoise import (
    SAMPLERS,
    VARIANCES,
    denoise,
    denoise_many,
    reverse_chain,
    reverse_coefficients,
    single_step_many,
    start_step,
    target_alpha_bar,
)
from attackers.diffusion.noise import (
    classical_gaussian_sigma,
    estimate_noise_level,
    noise_level,
    noise_level_dp,
    noise_level_epsilon,
    noise_level_from_c,
    noise_level_laplace,
)
from attackers.diffusion.packing import PackingSpec, fit_scale, pack, pack_many, packing_spec, unpack, unpack_many
from attackers.diffusion.store import TrainedDDPM, load_ddpm, save_ddpm
from attackers.diffusion.surrogate import (
    GradientSet,
    SurrogateOptions,
    collect_gradients,
    load_gradient_set,
    save_gradient_set,
)
from attackers.diffusion.unet import PRESETS, UNet, UNetConfig, check_side, preset
from fedguard.trained.fitting import EpochStats

__all__ = [
    "DEFAULT_NOISE_RANGE",
    "LOSSES",
    "PRESETS",
    "SAMPLERS",
    "VARIANCES",
    "Checkpoint",
    "DDPMTrainOptions",
    "EpochStats",
    "GradientSet",
    "PackingSpec",
    "Schedule",
    "SurrogateOptions",
    "TrainState",
    "TrainedDDPM",
    "UNet",
    "UNetConfig",
    "check_side",
    "classical_gaussian_sigma",
    "collect_gradients",
    "condition_of",
    "denoise",
    "denoise_many",
    "diffusion_loss",
    "draw_noise_levels",
    "estimate_noise_level",
    "fit_scale",
    "load_checkpoint",
    "load_ddpm",
    "load_gradient_set",
    "noise_level",
    "noise_level_dp",
    "noise_level_epsilon",
    "noise_level_from_c",
    "noise_level_laplace",
    "noisy_condition",
    "pack",
    "pack_many",
    "packing_spec",
    "preset",
    "q_sample",
    "reverse_chain",
    "reverse_coefficients",
    "save_checkpoint",
    "save_ddpm",
    "save_gradient_set",
    "single_step_many",
    "start_step",
    "target_alpha_bar",
    "train_ddpm",
    "unpack",
    "unpack_many",
]
