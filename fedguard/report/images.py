"""Image grids: a batch of images as one PNG, large enough to see 32-pixel inputs; reading one back."""

from __future__ import annotations

import math
from io import BytesIO
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from fedguard.store.folder import write_atomic

MIN_CELL = 64  # pixels: the automatic scale makes every cell at least this large
SEPARATOR = 255  # white lines between cells


def auto_scale(height: int, width: int) -> int:
    """The smallest integer factor that makes a ``height`` x ``width`` cell at least ``MIN_CELL`` pixels a side."""
    return max(1, math.ceil(MIN_CELL / max(1, min(height, width))))


def grid_array(images: torch.Tensor | np.ndarray, columns: int | None = None, scale: int | None = 1) -> np.ndarray:
    """The grid as ``uint8`` pixels, (H, W) for grayscale or (H, W, 3) for colour.

    ``images`` is (N, C, H, W) in [0, 1] with C = 1 (grayscale) or 3 (RGB;
    a fourth, alpha channel is dropped). Values outside [0, 1] are clipped and
    NaNs drawn black. Cells are ``columns`` wide (default: a near-square
    grid), upscaled ``scale`` times by pixel repetition (``None``: cells of at
    least ``MIN_CELL`` pixels), and parted by 1-pixel white lines; cells past
    the last image stay white.
    """
    if not isinstance(images, torch.Tensor):
        images = torch.as_tensor(np.asarray(images))
    if images.dim() != 4:
        raise ValueError(f"images must be (N, C, H, W); got shape {tuple(images.shape)}")
    count, channels, height, width = images.shape
    if count == 0:
        raise ValueError("no images to draw")
    if channels == 4:
        images, channels = images[:, :3], 3
    if channels not in (1, 3):
        raise ValueError(f"images must have 1 (grayscale) or 3 (RGB) channels; got {channels}")
    if columns is None:
        columns = math.ceil(math.sqrt(count))
    if columns < 1:
        raise ValueError(f"columns must be >= 1; got {columns}")
    columns = min(columns, count)
    if scale is None:
        scale = auto_scale(height, width)
    if scale < 1:
        raise ValueError(f"scale must be >= 1; got {scale}")
    rows = math.ceil(count / columns)

    unit = images.detach().to("cpu", torch.float32).nan_to_num(0.0).clamp(0.0, 1.0)
    pixels = (unit * 255.0).round().to(torch.uint8).numpy()  # (N, C, H, W)
    pixels = pixels.transpose(0, 2, 3, 1)  # (N, H, W, C)
    if scale > 1:
        pixels = pixels.repeat(scale, axis=1).repeat(scale, axis=2)
    cell_h, cell_w = height * scale, width * scale

    grid = np.full((rows * cell_h + rows - 1, columns * cell_w + columns - 1, channels), SEPARATOR, dtype=np.uint8)
    for index in range(count):
        row, column = divmod(index, columns)
        top, left = row * (cell_h + 1), column * (cell_w + 1)
        grid[top : top + cell_h, left : left + cell_w] = pixels[index]
    return grid[:, :, 0] if channels == 1 else grid


def save_grid(images: torch.Tensor, path: Path, columns: int | None = None, scale: int | None = 1) -> Path:
    """Write ``images`` (N, C, H, W in [0, 1]) as one PNG grid at ``path``; returns ``path``.

    Grayscale batches (C = 1) give an 8-bit grayscale PNG, RGB batches an RGB
    one. ``columns`` defaults to a near-square grid; ``scale`` repeats every
    pixel (nearest neighbour) so small inputs stay visible and sharp, and
    ``None`` picks the smallest factor giving cells of at least 64 pixels.
    Cells are parted by 1-pixel white lines. The file appears atomically.
    """
    grid = grid_array(images, columns, scale)
    image = Image.fromarray(grid)  # uint8 (H, W) -> "L", (H, W, 3) -> "RGB"
    buffer = BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return write_atomic(Path(path), buffer.getvalue())


def load_png(data: bytes) -> Image.Image:
    """The PNG ``data`` decoded whole; ``ValueError`` saying why when it is not a readable PNG (another format,
    damaged, truncated, or more pixels than Pillow's ``MAX_IMAGE_PIXELS`` allows)."""
    try:
        image = Image.open(BytesIO(data), formats=["PNG"])
        image.load()
    except UnidentifiedImageError:
        raise ValueError("not a readable PNG (Pillow finds no PNG image in it)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"not a readable PNG ({type(error).__name__}: {error})") from None
    return image
