"""Gradient packing (Mjölnir's [Gradient Adjustment]): a model's gradient as a 1 x S x S image, and back.

A gradient is a list of tensors, one per trainable parameter in ``model.parameters()``
order. Packing flattens each tensor in row-major order, concatenates them into one
vector of L entries, divides it by the spec's ``scale``, pads it with zeros to S * S
entries and reshapes it to (1, S, S). Units: ``packed = gradient / scale``; unpacking
takes the first L entries (the padding is dropped, whatever it holds after denoising),
multiplies them by ``scale`` and restores the shapes.

S is the smallest multiple of ``multiple`` with S * S >= L, so that a UNet can halve the
side log2(multiple) times. The paper asks for the smallest g with g * g > L; the strict
inequality only adds a padding entry when L is a perfect square, and the rounding to a
multiple makes the two agree in almost every case. Padding is zeros, as the paper says
(the released code pads with the gradient's mean).

Exactness: the division and the multiplication run in float64 and are cast back to the
gradient's dtype once. With a power-of-two scale (``fit_scale`` returns one) both are exact,
so ``unpack(pack(g))`` equals ``g`` bit for bit, barring entries that leave the normal
range of the dtype. With any other scale each entry comes back within one unit in the last
place of the dtype (relative error at most 2**-23, about 1.2e-7, in float32).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PackingSpec:
    """How a gradient is packed: tensor ``shapes`` in parameter order, image ``side`` S, and ``scale``
    (gradient units per packed unit: packed = gradient / scale)."""

    shapes: tuple[tuple[int, ...], ...]
    side: int
    scale: float

    def __post_init__(self) -> None:
        if not isinstance(self.shapes, tuple) or not self.shapes:
            raise ValueError(f"shapes must be a non-empty tuple of shapes, got {self.shapes!r}")
        for shape in self.shapes:
            if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise ValueError(f"every shape must be a tuple of non-negative ints, got {shape!r}")
        if not isinstance(self.side, int) or self.side < 1:
            raise ValueError(f"side must be an int >= 1, got {self.side!r}")
        if self.side * self.side < self.numel:
            raise ValueError(f"side {self.side} holds {self.side * self.side} entries, the gradient has {self.numel}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {self.scale!r}")

    @property
    def sizes(self) -> list[int]:
        """Entries of each tensor, in order."""
        return [math.prod(shape) for shape in self.shapes]

    @property
    def numel(self) -> int:
        """L: entries of the whole gradient, padding excluded."""
        return sum(self.sizes)


def fitting_side(numel: int, multiple: int = 8) -> int:
    """The smallest multiple of ``multiple`` (>= 1) whose square holds ``numel`` entries."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    root = math.isqrt(numel - 1) + 1 if numel > 0 else 1
    return -(-root // multiple) * multiple


def packing_spec(shapes: Iterable[Sequence[int]], scale: float, multiple: int = 8) -> PackingSpec:
    """The spec for gradients of ``shapes``, divided by ``scale``, on the smallest side that is a multiple of
    ``multiple``."""
    sizes = tuple(tuple(int(n) for n in shape) for shape in shapes)
    return PackingSpec(sizes, fitting_side(sum(math.prod(s) for s in sizes), multiple), float(scale))


def fit_scale(gradients: Iterable[Sequence[torch.Tensor]]) -> float:
    """A scale that gives packed entries unit-ish size: the root mean square of every entry of ``gradients``
    (an iterable of gradients, each a list of tensors), rounded to the nearest power of two so that packing
    is exact. The packed entries' root mean square is then within [1/sqrt(2), sqrt(2)].

    The root mean square rather than a standard deviation: it is the signal power the noise-to-signal ratio
    sigma / RMS is measured against, and a DDPM's prior assumes data of about unit second moment."""
    total, count = 0.0, 0
    for gradient in gradients:
        for tensor in gradient:
            total += float(tensor.detach().to(torch.float64).square().sum())
            count += tensor.numel()
    if count == 0 or total == 0.0:
        raise ValueError("cannot fit a scale: the gradients have no entries or only zeros")
    return 2.0 ** round(math.log2(math.sqrt(total / count)))


def valid_mask(spec: PackingSpec) -> torch.Tensor:
    """Bool (1, S, S): True on the L entries that hold the gradient, False on the padding."""
    mask = torch.zeros(spec.side * spec.side, dtype=torch.bool)
    mask[: spec.numel] = True
    return mask.reshape(1, spec.side, spec.side)


def pack(gradient: Sequence[torch.Tensor], spec: PackingSpec) -> torch.Tensor:
    """(1, S, S) image of one gradient (tensors of ``spec.shapes``), in its dtype and on its device."""
    _check_shapes([tuple(t.shape) for t in gradient], spec, "gradient")
    image = torch.zeros(spec.side * spec.side, dtype=_dtype(gradient), device=gradient[0].device)
    _fill(image, gradient, spec)
    return image.reshape(1, spec.side, spec.side)


def pack_many(gradients: Sequence[Sequence[torch.Tensor]] | Sequence[torch.Tensor], spec: PackingSpec) -> torch.Tensor:
    """(N, 1, S, S) images of N gradients, given either as a list of N gradients or as one list of tensors
    with a leading job dimension N (tensor k of shape (N, *spec.shapes[k])). Row i equals ``pack`` of job i."""
    jobs = _jobs(gradients, spec)
    if not jobs:
        raise ValueError("pack_many needs at least one gradient")
    for index, job in enumerate(jobs):
        _check_shapes([tuple(t.shape) for t in job], spec, f"gradient {index}")
    images = torch.zeros(len(jobs), spec.side * spec.side, dtype=_dtype(jobs[0]), device=jobs[0][0].device)
    for row, job in zip(images, jobs):
        _fill(row, job, spec)
    return images.reshape(len(jobs), 1, spec.side, spec.side)


def unpack(image: torch.Tensor, spec: PackingSpec) -> list[torch.Tensor]:
    """The gradient in an image (1, S, S): tensors of ``spec.shapes`` in gradient units, in the image's dtype
    and on its device. The padding entries are ignored."""
    expected = (1, spec.side, spec.side)
    if tuple(image.shape) != expected:
        raise ValueError(f"image does not match the packing spec: expected shape {expected}, got {tuple(image.shape)}")
    return [t[0] for t in unpack_many(image.unsqueeze(0), spec)]


def unpack_many(images: torch.Tensor, spec: PackingSpec) -> list[torch.Tensor]:
    """The N gradients in images (N, 1, S, S), stacked: tensor k has shape (N, *spec.shapes[k]). Job i equals
    ``unpack(images[i])``."""
    if images.dim() != 4 or tuple(images.shape[1:]) != (1, spec.side, spec.side):
        raise ValueError(
            f"images do not match the packing spec: expected shape (N, 1, {spec.side}, {spec.side}), "
            f"got {tuple(images.shape)}"
        )
    flat = images.reshape(len(images), -1)[:, : spec.numel]
    values = torch.empty(flat.shape, dtype=images.dtype, device=images.device)
    for row, source in zip(values, flat):
        row.copy_(source.to(torch.float64) * spec.scale)
    pieces = values.split(spec.sizes, dim=1)
    return [piece.reshape(len(images), *shape) for piece, shape in zip(pieces, spec.shapes)]


def spec_to_dict(spec: PackingSpec) -> dict[str, Any]:
    """The spec as JSON-ready values; ``spec_from_dict`` inverts it exactly."""
    return {"shapes": [list(shape) for shape in spec.shapes], "side": spec.side, "scale": spec.scale}


def spec_from_dict(values: dict[str, Any]) -> PackingSpec:
    """The spec written by ``spec_to_dict``; raises ``ValueError`` for missing keys or invalid values."""
    missing = [key for key in ("shapes", "side", "scale") if key not in values]
    if missing:
        raise ValueError(f"packing spec lacks {', '.join(missing)}; it has {sorted(values)}")
    shapes = tuple(tuple(int(n) for n in shape) for shape in values["shapes"])
    return PackingSpec(shapes, int(values["side"]), float(values["scale"]))


def _fill(row: torch.Tensor, gradient: Sequence[torch.Tensor], spec: PackingSpec) -> None:
    """Write ``gradient / scale`` into the first L entries of the flat ``row`` (S * S,)."""
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in gradient])
    row[: spec.numel].copy_(flat.div_(spec.scale))


def _jobs(
    gradients: Sequence[Sequence[torch.Tensor]] | Sequence[torch.Tensor], spec: PackingSpec
) -> list[Sequence[torch.Tensor]]:
    """Per-job gradients from either form ``pack_many`` accepts."""
    if not gradients or not isinstance(gradients[0], torch.Tensor):
        return list(gradients)  # type: ignore[arg-type]
    stacked: Sequence[torch.Tensor] = gradients  # type: ignore[assignment]
    _check_shapes([tuple(t.shape[1:]) for t in stacked], spec, "stacked gradient (leading job dimension removed)")
    jobs = {t.shape[0] for t in stacked}
    if len(jobs) != 1:
        raise ValueError(f"stacked gradient: every tensor needs the same leading job dimension, got {sorted(jobs)}")
    return [list(job) for job in zip(*(t.unbind(0) for t in stacked))]


def _check_shapes(shapes: list[tuple[int, ...]], spec: PackingSpec, what: str) -> None:
    if len(shapes) != len(spec.shapes):
        raise ValueError(
            f"{what} does not match the packing spec: expected {len(spec.shapes)} tensors of shapes "
            f"{list(spec.shapes)}, got {len(shapes)} of shapes {shapes}"
        )
    for index, (expected, got) in enumerate(zip(spec.shapes, shapes)):
        if expected != got:
            raise ValueError(
                f"{what} does not match the packing spec: tensor {index} has shape {got}, expected {expected}"
            )


def _dtype(gradient: Sequence[torch.Tensor]) -> torch.dtype:
    """The promoted floating dtype of the gradient's tensors."""
    dtype = gradient[0].dtype
    for tensor in gradient[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"gradients must be floating point, got {dtype}")
    return dtype
