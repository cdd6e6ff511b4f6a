"""Surrogate gradient collection (Mjölnir Algorithm 1) and the gradient set file.

The attacker builds a surrogate of the client model (same architecture, hence the
same gradient structure), trains it with plain SGD on its public data (a split no
client trains on, by default 'test') and, at ``gradients`` steps spread evenly over
the run from the first step to the last, records the clean FedSGD upload of that
step's batch: the gradient of the mean cross-entropy over ``batch_size`` samples,
taken before the step is applied. The printed Algorithm 1 reads one gradient per
public sample off the surrogate; the paper's experiments take them from a surrogate
"trained on FashionMNIST". Recording along the training trajectory covers both: the
set holds gradients of the early, nearly untrained models and of the later ones.
Each gradient is then packed into a 1 x S x S image (``packing``) in units of one
scale fitted to the whole set, so that the images' entries have a root mean square
near 1.

The public data may come from another dataset than the run's, as in the paper (Fashion-MNIST gradients to
denoise MNIST uploads), provided its samples have the run's shape and classes (``check_surrogate_data``).

Batches have exactly ``batch_size`` samples: a shorter last batch of an epoch is
skipped, its samples join the next epoch's shuffle.

File format: one compressed ``.npz`` without pickles (gradients of ReLU networks on
digits are mostly exact zeros and compress about sixfold). Arrays ``images``
(N, 1, S, S) float32, ``steps`` (N,) int64, ``batches`` (N, B) int64 and ``losses``
(N,) float64; ``meta`` is a JSON string with the format version, the model name and
parameters, the dataset, split and sample shape, the collection options, the packing
spec and how the surrogate's weights started.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from attackers.diffusion.packing import PackingSpec, fit_scale, pack, packing_spec, spec_from_dict, spec_to_dict, unpack
from attackers.diffusion.store import beside_model_command
from fedguard.data import DataSpec, SourceOptions, Split, load_dataset
from fedguard.models import MODELS, build_model
from fedguard.trained.archive import save_archive
from fedguard.trained.files import FileKind, Layout, check_arrays, load_trained
from fedguard.trained.fitting import check_split
from fedguard.training import compute_gradients, minibatches, parameters, set_arrays

STARTS = ("seed", "weights")
FORMAT = "fedguard-mjolnir-gradients/1"


@dataclass(frozen=True)
class SurrogateOptions:
    """``epochs``: passes of SGD over the public split; ``batch_size``: samples per batch, the client's
    batch size; ``lr``: SGD step (0: the surrogate keeps its starting weights, so every gradient is taken at
    one model, e.g. the global model of the attacked round); ``gradients``: N, gradients recorded; ``seed``: the
    surrogate's initialization and the batch order; ``multiple``: the packed side S is a multiple of it."""

    epochs: int = 2
    batch_size: int = 1
    lr: float = 0.01
    gradients: int = 256
    seed: int = 0
    multiple: int = 8

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "gradients", "multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be finite and >= 0, got {self.lr!r}")


@dataclass(frozen=True, eq=False)
class Recording:
    """One recorded upload: the ``index``-th of the set, taken after ``step`` SGD steps on the batch at
    positions ``batch`` (B,) of the split; ``gradient`` in parameter order and the batch's mean ``loss``
    (nats)."""

    index: int
    step: int
    batch: np.ndarray
    gradient: list[torch.Tensor]
    loss: float


@dataclass(frozen=True)
class RecordStats:
    """Progress: gradient ``index`` (1-based) of ``count``, taken at SGD step ``step`` of ``steps``, its
    batch loss (nats) and the seconds since collection began."""

    index: int
    count: int
    step: int
    steps: int
    loss: float
    seconds: float

    def __str__(self) -> str:
        return (
            f"gradient {self.index}/{self.count} at step {self.step}/{self.steps}: "
            f"loss {self.loss:.3f} nats, {self.seconds:.1f} s"
        )


@dataclass(frozen=True, eq=False)
class GradientSet:
    """N packed surrogate gradients and where they come from.

    ``images`` (N, 1, S, S): gradient / ``spec.scale``, zero-padded; ``steps`` (N,) int64: SGD steps taken
    before each gradient; ``batches`` (N, B) int64: the batch's positions in the split; ``losses`` (N,)
    float64: the batch's mean loss in nats; ``model_params``: the model's parameters as a JSON-ready dict;
    ``data_spec``: the sample shape the model was built for; ``start``: 'seed' (the builder's
    initialization under ``options.seed``) or 'weights' (given weights)."""

    images: torch.Tensor
    spec: PackingSpec
    model: str
    model_params: dict[str, Any]
    dataset: str
    split: str
    data_spec: DataSpec
    options: SurrogateOptions
    steps: torch.Tensor
    batches: torch.Tensor
    losses: torch.Tensor
    start: str = "seed"

    def __post_init__(self) -> None:
        n, side = len(self.images), self.spec.side
        expected = {
            "images": ((n, 1, side, side), self.images),
            "steps": ((n,), self.steps),
            "batches": ((n, self.options.batch_size), self.batches),
            "losses": ((n,), self.losses),
        }
        for name, (shape, tensor) in expected.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if self.start not in STARTS:
            raise ValueError(f"start must be one of {', '.join(STARTS)}, got {self.start!r}")

    def __len__(self) -> int:
        return len(self.images)

    @property
    def batch_size(self) -> int:
        """Samples per recorded batch: the client batch size the gradients imitate."""
        return self.options.batch_size

    def meta(self) -> dict[str, Any]:
        """Every field but the arrays, JSON-ready."""
        spec = self.data_spec
        return {
            "format": FORMAT,
            "model": self.model,
            "model_params": self.model_params,
            "dataset": self.dataset,
            "split": self.split,
            "data_spec": [spec.channels, spec.height, spec.width, spec.num_classes],
            "options": dataclasses.asdict(self.options),
            "packing": spec_to_dict(self.spec),
            "start": self.start,
            "count": len(self),
        }


def model_params_dict(model: str, params: Any = None) -> dict[str, Any]:
    """``params`` of the registered ``model`` (its parameter dataclass, a dict of its fields, or None for the
    defaults) as a JSON-ready dict."""
    entry = MODELS.get(model)
    if params is None:
        params = entry.params()
    elif isinstance(params, Mapping):
        params = entry.params(**params)
    return dataclasses.asdict(params)


def build_surrogate(model: str, params: Any, spec: DataSpec, seed: int) -> nn.Module:
    """The registered ``model`` for samples of ``spec``, initialized under torch seed ``seed`` without
    touching the global random state; ``params`` as in ``model_params_dict``."""
    config = MODELS.get(model).params(**model_params_dict(model, params))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(model, spec, config)


def check_surrogate_data(run_data: str, surrogate_data: str, source: SourceOptions = SourceOptions()) -> DataSpec:
    """The sample spec of ``surrogate_data``, after checking that it equals ``run_data``'s: the surrogate is the
    run's model built for those samples, so its gradients have the run's shapes only for samples of the run's
    shape and number of classes (e.g. Fashion-MNIST for an MNIST run). ``ValueError`` naming both otherwise."""
    run_spec = load_dataset(run_data, source).spec
    spec = load_dataset(surrogate_data, source).spec
    if spec != run_spec:

        def shape(s: DataSpec) -> str:
            return f"{s.channels}x{s.height}x{s.width} images with {s.num_classes} classes"

        raise ValueError(
            f"the surrogate's data {surrogate_data!r} has {shape(spec)}, the run's data {run_data!r} "
            f"{shape(run_spec)}; its gradients would not have the shapes of the run's model: choose a dataset of the "
            f"run's shape"
        )
    return spec


def recording_steps(total: int, count: int) -> list[int]:
    """``count`` distinct SGD steps spread evenly over ``total`` steps, the first (0) and the last included."""
    if not 1 <= count <= total:
        raise ValueError(f"cannot record {count} gradients in {total} SGD steps; record at most one per step")
    if count == 1:
        return [0]
    return [i * (total - 1) // (count - 1) for i in range(count)]


def schedule(samples: int, options: SurrogateOptions) -> tuple[int, list[int]]:
    """SGD steps of a full run on ``samples`` public samples (full batches per epoch times epochs) and the
    steps at which gradients are recorded; raises ``ValueError`` when the run is too short."""
    if samples < options.batch_size:
        raise ValueError(f"the split has {samples} samples, fewer than one batch of {options.batch_size}")
    per_epoch = samples // options.batch_size
    total = options.epochs * per_epoch
    if options.gradients > total:
        raise ValueError(
            f"cannot record {options.gradients} gradients: {options.epochs} epochs of {per_epoch} batches of "
            f"{options.batch_size} make {total} SGD steps; raise epochs or lower gradients"
        )
    return total, recording_steps(total, options.gradients)


def trajectory(model: nn.Module, data: Split, options: SurrogateOptions) -> Iterator[Recording]:
    """Train ``model`` in place with SGD on ``data`` and yield the recorded uploads (Algorithm 1).

    Each recording is yielded before its step is applied, so the model the caller sees is the one that
    produced the gradient. Training stops after the last recording."""
    marks = schedule(len(data), options)[1]
    generator = np.random.default_rng(options.seed)
    weights = parameters(model)
    step, index = 0, 0
    for _ in range(options.epochs):
        for batch in minibatches(len(data), options.batch_size, generator):
            if len(batch) < options.batch_size:
                continue
            gradient, loss = compute_gradients(model, *data.batch(batch))
            if step == marks[index]:
                yield Recording(index, step, batch, gradient, loss)
                index += 1
                if index == len(marks):
                    return
            with torch.no_grad():
                for weight, grad in zip(weights, gradient):
                    weight.sub_(options.lr * grad)
            step += 1


def collect_gradients(
    model: str,
    model_params: Any,
    dataset: str,
    split: str = "test",
    options: SurrogateOptions = SurrogateOptions(),
    source: SourceOptions = SourceOptions(),
    progress: Callable[[RecordStats], None] | None = None,
    weights: Sequence[np.ndarray] | None = None,
) -> GradientSet:
    """Collect ``options.gradients`` surrogate uploads of ``model`` trained on ``split`` of ``dataset``.

    ``model_params``: the model's parameters (dataclass, dict or None for the defaults); ``weights``: the
    surrogate's starting ``state_dict`` arrays (e.g. the global model of the attacked round), None for the
    builder's initialization under ``options.seed``. The scale is ``fit_scale`` of the whole set."""
    check_split(split)
    data = load_dataset(dataset, source)
    public = getattr(data, split)
    total = schedule(len(public), options)[0]
    surrogate = build_surrogate(model, model_params, data.spec, options.seed)
    if weights is not None:
        set_arrays(surrogate, list(weights))
    trainable = parameters(surrogate)
    unit = packing_spec([tuple(p.shape) for p in trainable], 1.0, options.multiple)
    count, side = options.gradients, unit.side
    images = torch.zeros(count, 1, side, side, dtype=trainable[0].dtype)
    steps = torch.zeros(count, dtype=torch.int64)
    batches = torch.zeros(count, options.batch_size, dtype=torch.int64)
    losses = torch.zeros(count, dtype=torch.float64)
    began = time.perf_counter()
    for record in trajectory(surrogate, public, options):
        images[record.index] = pack(record.gradient, unit)
        steps[record.index] = record.step
        batches[record.index] = torch.from_numpy(np.asarray(record.batch, dtype=np.int64))
        losses[record.index] = record.loss
        if progress is not None:
            progress(RecordStats(record.index + 1, count, record.step, total, record.loss, time.perf_counter() - began))
    spec = dataclasses.replace(unit, scale=fit_scale(unpack(image, unit) for image in images))
    for image in images:
        image.copy_(pack(unpack(image, unit), spec))
    return GradientSet(
        images,
        spec,
        model,
        model_params_dict(model, model_params),
        dataset,
        split,
        data.spec,
        options,
        steps,
        batches,
        losses,
        "seed" if weights is None else "weights",
    )


def save_gradient_set(gradient_set: GradientSet, path: Path | str) -> Path:
    """Write ``gradient_set`` to ``path`` atomically (creating its folder); returns the path."""
    arrays = {
        name: getattr(gradient_set, name).detach().cpu().numpy() for name in ("images", "steps", "batches", "losses")
    }
    return save_archive(path, gradient_set.meta(), arrays, compressed=True)


def gradients_command(path: Path) -> str:
    """The command that writes a gradient set at ``path``."""
    return beside_model_command(path, ".gradients.npz")


GRADIENTS_FILE = FileKind(
    "Mjölnir gradient set",
    "a Mjölnir gradient set",
    FORMAT,
    ("meta", "images", "steps", "batches", "losses"),
    gradients_command,
)


def load_gradient_set(path: Path | str) -> GradientSet:
    """Read a set written by ``save_gradient_set``.

    Raises ``TrainedFileError`` (``MissingTrainedFile`` for a missing file) for a file that is not a gradient
    set, holds arrays its meta does not describe, or non-finite values."""
    return load_trained(path, GRADIENTS_FILE, gradient_set_of)


def gradient_set_of(meta: dict[str, Any], arrays: dict[str, np.ndarray], path: Path) -> GradientSet:
    """The set ``meta`` describes, with the ``arrays`` (checked) of the file at ``path``."""
    spec, options, count = spec_from_dict(meta["packing"]), SurrogateOptions(**meta["options"]), meta["count"]
    layout: Layout = {
        "images": ((count, 1, spec.side, spec.side), np.dtype(np.float32)),
        "steps": ((count,), np.dtype(np.int64)),
        "batches": ((count, options.batch_size), np.dtype(np.int64)),
        "losses": ((count,), np.dtype(np.float64)),
    }
    check_arrays(arrays, layout, path, GRADIENTS_FILE, "gradient")
    return GradientSet(
        spec=spec,
        model=meta["model"],
        model_params=meta["model_params"],
        dataset=meta["dataset"],
        split=meta["split"],
        data_spec=DataSpec(*meta["data_spec"]),
        options=options,
        start=meta["start"],
        **{name: torch.from_numpy(array) for name, array in arrays.items()},
    )
