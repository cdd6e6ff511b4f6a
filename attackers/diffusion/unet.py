"""The noise predictor eps_theta(x_t, t) of the gradient diffusion model: a small UNet on 1 x S x S grids.

Layout (after the lucidrains-style UNet of the Mjölnir code, without its
per-level linear attention and weight-standardized convolutions):

- a 1x1 input convolution to ``base_channels`` (the code's 7x7 became 1x1)
  from one channel, x_t, or from two, x_t and the condition, for the
  conditional variant ("Mjölnir (Condition)"; SR3-style concatenation);
- a sinusoidal embedding of the step t (width ``base_channels``), then
  Linear -> GELU -> Linear to ``4 * base_channels``; every residual block turns
  it into a per-channel scale and shift;
- one level per entry of ``channel_mults`` with ``blocks_per_level`` residual
  blocks of ``base_channels * mult`` channels; between levels a 2x2
  space-to-depth and a 1x1 convolution halve the side, so a side S must be a
  multiple of ``2 ** levels`` with ``levels = len(channel_mults) - 1``;
- a middle of two residual blocks, with full self-attention between them when
  ``mid_attention`` is set;
- the mirrored path up (skip concatenation, nearest upsampling and a 3x3
  convolution), a last residual block on the input features, and a 1x1
  convolution to one channel, zero-initialized so training starts from eps = 0.

Residual block: conv3x3 -> GroupNorm -> (1 + scale, shift) from the step
embedding -> SiLU -> conv3x3 -> GroupNorm -> SiLU, plus a 1x1 convolution on
the shortcut when the channel count changes.

Presets (the weight count does not depend on S):

- ``cpu``: base 16, mults (1, 2, 2), 1 block per level, no attention,
  0.21 M weights; 20 epochs over 256 grids of 32 x 32 (batch 16) take about
  15 s on two CPU cores, so a few hundred grids train for 50 to 100 epochs
  in about a minute.
- ``gpu``: base 120, mults (1, 2, 4), 2 blocks per level, mid attention with
  4 heads of 32: the code's widths (120, 240, 480) and depth; 44 M weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class UNetConfig:
    """Widths and depth of the denoiser; ``levels`` = ``len(channel_mults) - 1`` halvings of the side."""

    base_channels: int = 16
    channel_mults: tuple[int, ...] = (1, 2, 2)
    blocks_per_level: int = 1
    groups: int = 4
    mid_attention: bool = False
    heads: int = 4
    head_channels: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "channel_mults", tuple(self.channel_mults))
        for name in ("base_channels", "blocks_per_level", "groups", "heads", "head_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.channel_mults or min(self.channel_mults) < 1:
            raise ValueError(f"channel_mults must be a non-empty tuple of integers >= 1, got {self.channel_mults}")
        for width in self.widths:
            if width % self.groups:
                raise ValueError(f"width {width} is not a multiple of groups={self.groups}: GroupNorm needs one")

    @property
    def levels(self) -> int:
        """How many times the side is halved."""
        return len(self.channel_mults) - 1

    @property
    def widths(self) -> tuple[int, ...]:
        """Channels of each level."""
        return tuple(self.base_channels * mult for mult in self.channel_mults)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``channel_mults`` as a list)."""
        fields = asdict(self)
        fields["channel_mults"] = list(self.channel_mults)
        return fields


PRESETS = {
    "cpu": UNetConfig(),
    "gpu": UNetConfig(base_channels=120, channel_mults=(1, 2, 4), blocks_per_level=2, mid_attention=True),
}


def preset(name: str) -> UNetConfig:
    """The ``cpu`` or ``gpu`` configuration."""
    if name not in PRESETS:
        raise ValueError(f"UNet preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def check_side(config: UNetConfig, side: int) -> None:
    """Raises ``ValueError`` unless ``side`` is a positive multiple of ``2 ** config.levels``."""
    step = 2**config.levels
    if side < 1 or side % step:
        below, above = (side // step) * step, (side // step + 1) * step
        nearest = f"{below} or {above}" if below >= step else f"{above}"
        raise ValueError(
            f"side S={side}: this UNet halves the side {config.levels} times, so S must be a positive multiple "
            f"of {step} (nearest: {nearest})"
        )


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Steps ``t`` (N,) -> (N, dim): sin and cos of t at ``dim // 2`` geometric frequencies from 1 to 1e-4."""
    half = dim // 2
    frequencies = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device) / max(half - 1, 1))
    angles = t.float()[:, None] * frequencies[None, :]
    embedding = torch.cat([angles.sin(), angles.cos()], dim=1)
    return F.pad(embedding, (0, dim - 2 * half))


class ResBlock(nn.Module):
    """(N, c_in, H, W) and a step embedding (N, time_dim) -> (N, c_out, H, W)."""

    def __init__(self, c_in: int, c_out: int, time_dim: int, groups: int) -> None:
        super().__init__()
        self.time = nn.Sequential(nn.SiLU(), nn.Linear(time_dim, 2 * c_out))
        self.conv1, self.norm1 = nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(groups, c_out)
        self.conv2, self.norm2 = nn.Conv2d(c_out, c_out, 3, padding=1), nn.GroupNorm(groups, c_out)
        self.shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        scale, shift = self.time(time)[:, :, None, None].chunk(2, dim=1)
        h = F.silu(self.norm1(self.conv1(x)) * (1 + scale) + shift)
        h = F.silu(self.norm2(self.conv2(h)))
        return h + self.shortcut(x)


class SelfAttention(nn.Module):
    """Pre-normalized multi-head self-attention over the H * W positions, with a residual connection."""

    def __init__(self, channels: int, heads: int, head_channels: int, groups: int) -> None:
        super().__init__()
        self.heads, inner = heads, heads * head_channels
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * inner, 1, bias=False)
        self.out = nn.Conv2d(inner, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        parts = self.qkv(self.norm(x)).chunk(3, dim=1)
        q, k, v = (part.reshape(n, self.heads, -1, h * w).transpose(2, 3) for part in parts)
        attended = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(attended.transpose(2, 3).reshape(n, -1, h, w))


class Downsample(nn.Module):
    """(N, C, H, W) -> (N, C, H/2, W/2): each 2x2 patch into channels, then a 1x1 convolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.PixelUnshuffle(2), nn.Conv2d(4 * channels, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Upsample(nn.Module):
    """(N, C, H, W) -> (N, C, 2H, 2W): nearest upsampling, then a 3x3 convolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(channels, channels, 3, padding=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UNet(nn.Module):
    """eps_theta: noisy grids x_t (N, 1, S, S) and 0-based steps t (N,) -> predicted noise (N, 1, S, S).

    ``conditional``: the network also takes condition grids (N, 1, S, S), concatenated to x_t as a second
    input channel; it still predicts the noise of x_t alone."""

    def __init__(self, config: UNetConfig, side: int, conditional: bool = False) -> None:
        super().__init__()
        check_side(config, side)
        self.config, self.side, self.conditional = config, side, conditional
        base, widths, groups, blocks = config.base_channels, config.widths, config.groups, config.blocks_per_level
        time_dim = 4 * base
        self.time = nn.Sequential(nn.Linear(base, time_dim), nn.GELU(), nn.Linear(time_dim, time_dim))
        self.init = nn.Conv2d(2 if conditional else 1, base, 1)
        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        channels = base
        for level, width in enumerate(widths):
            self.down.append(
                nn.ModuleList(ResBlock(channels if i == 0 else width, width, time_dim, groups) for i in range(blocks))
            )
            channels = width
            self.downsample.append(Downsample(width) if level < config.levels else nn.Identity())
        self.mid1 = ResBlock(channels, channels, time_dim, groups)
        self.mid_attention = (
            SelfAttention(channels, config.heads, config.head_channels, groups)
            if config.mid_attention
            else nn.Identity()
        )
        self.mid2 = ResBlock(channels, channels, time_dim, groups)
        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for level, width in reversed(list(enumerate(widths))):
            self.up.append(
                nn.ModuleList(
                    ResBlock((channels if i == 0 else width) + width, width, time_dim, groups) for i in range(blocks)
                )
            )
            channels = width
            self.upsample.append(Upsample(width) if level > 0 else nn.Identity())
        self.final = ResBlock(channels + base, base, time_dim, groups)
        self.head = nn.Conv2d(base, 1, 1)
        nn.init.zeros_(self.head.weight)
        assert self.head.bias is not None  # a Conv2d made with its bias
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1:] != (1, self.side, self.side):
            raise ValueError(f"expected grids of shape (N, 1, {self.side}, {self.side}), got {tuple(x.shape)}")
        time = self.time(sinusoidal_embedding(t, self.config.base_channels))
        h = self.init(self._inputs(x, condition))
        first, skips = h, []
        for blocks, downsample in zip(self.down, self.downsample):
            for block in cast(nn.ModuleList, blocks):
                h = block(h, time)
                skips.append(h)
            h = downsample(h)
        h = self.mid2(self.mid_attention(self.mid1(h, time)), time)
        for blocks, upsample in zip(self.up, self.upsample):
            for block in cast(nn.ModuleList, blocks):
                h = block(torch.cat([h, skips.pop()], dim=1), time)
            h = upsample(h)
        return self.head(self.final(torch.cat([h, first], dim=1), time))

    def _inputs(self, x: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
        """x (N, 1, S, S), or x and the condition stacked as channels (N, 2, S, S) for a conditional UNet."""
        if not self.conditional:
            if condition is not None:
                raise ValueError("this UNet is unconditional: it takes no condition grids")
            return x
        if condition is None or condition.shape != x.shape:
            got = None if condition is None else tuple(condition.shape)
            raise ValueError(
                f"this UNet is conditional: it needs condition grids of x's shape {tuple(x.shape)}, got {got}"
            )
        return torch.cat([x, condition], dim=1)
