"""Mjölnir's gradient packing (gradient <-> 1 x S x S image) and surrogate gradient collection (Algorithm 1)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from attackers.diffusion.packing import (
    PackingSpec,
    fit_scale,
    fitting_side,
    pack,
    pack_many,
    packing_spec,
    spec_from_dict,
    spec_to_dict,
    unpack,
    unpack_many,
    valid_mask,
)
from attackers.diffusion.surrogate import (
    GradientSet,
    SurrogateOptions,
    build_surrogate,
    collect_gradients,
    load_gradient_set,
    recording_steps,
    save_gradient_set,
    trajectory,
)
from fedguard.data import load_dataset
from fedguard.models.mlp import MLPParams
from fedguard.training import compute_gradients, evaluate, get_arrays, parameters

ODD_SHAPES = [(), (1,), (0,), (3, 4, 5), (2, 1, 7), (13,)]
SMALL = SurrogateOptions(epochs=1, gradients=12, seed=3)


def real_gradient(model: str, dataset: str) -> list[torch.Tensor]:
    """The FedSGD upload of a 4-sample train batch for a seeded model."""
    data = load_dataset(dataset)
    surrogate = build_surrogate(model, None, data.spec, seed=0)
    return compute_gradients(surrogate, *data.train.batch(np.arange(4)))[0]


def random_gradient(
    shapes: list[tuple[int, ...]], seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype) * 1e-3 for shape in shapes]


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in float32 units in the last place between same-signed entries of ``a`` and ``b``."""
    assert torch.equal(a.sign(), b.sign())
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def assert_exact(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)


# -- packing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "dataset", "side"), [("mlp", "mnist-5k", 520), ("lenet", "photos", 128)])
def test_real_gradients_round_trip_exactly_with_a_fitted_scale_and_within_an_ulp_otherwise(model, dataset, side):
    gradient = real_gradient(model, dataset)
    shapes = [tuple(g.shape) for g in gradient]
    scale = fit_scale([gradient])
    assert math.log2(scale) == round(math.log2(scale))
    spec = packing_spec(shapes, scale)
    assert spec.side == side and spec.numel == sum(g.numel() for g in gradient)
    image = pack(gradient, spec)
    assert image.shape == (1, side, side) and image.dtype == torch.float32
    assert_exact(unpack(image, spec), gradient)

    odd = packing_spec(shapes, scale * 1.37)
    back = unpack(pack(gradient, odd), odd)
    for got, want in zip(back, gradient):
        assert ulps_apart(got, want) <= 1
        torch.testing.assert_close(got, want, rtol=2**-23, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_shapes_with_scalars_and_empty_tensors_round_trip(dtype):
    gradient = random_gradient(ODD_SHAPES, dtype=dtype)
    spec = packing_spec(ODD_SHAPES, 2.0**-7, multiple=4)
    assert spec.numel == 1 + 1 + 0 + 60 + 14 + 13 and spec.side == 12
    image = pack(gradient, spec)
    assert image.dtype == dtype
    back = unpack(image, spec)
    assert back[0].shape == () and back[2].shape == (0,)
    assert_exact(back, gradient)


def test_the_side_is_the_smallest_fitting_multiple():
    for multiple in (1, 4, 8):
        for numel in range(0, 400):
            side = fitting_side(numel, multiple)
            assert side % multiple == 0 and side * side >= numel
            assert side == multiple or (side - multiple) ** 2 < numel
    assert fitting_side(64, 8) == 8 and fitting_side(65, 8) == 16
    assert fitting_side(13_426, 4) == 116  # the notes' LeNet on 28 x 28 digits
    with pytest.raises(ValueError, match="multiple"):
        fitting_side(10, 0)


def test_entries_are_the_gradient_over_the_scale_and_the_padding_is_zeros():
    gradient = random_gradient(ODD_SHAPES, seed=1)
    spec = packing_spec(ODD_SHAPES, 0.003)
    flat = pack(gradient, spec).flatten()
    values = torch.cat([g.reshape(-1).double() for g in gradient]) / 0.003
    assert torch.equal(flat[: spec.numel], values.float())
    assert torch.equal(flat[spec.numel :], torch.zeros(spec.side**2 - spec.numel))
    mask = valid_mask(spec)
    assert mask.shape == (1, spec.side, spec.side) and int(mask.sum()) == spec.numel
    assert torch.equal(pack(gradient, spec)[~mask], torch.zeros(spec.side**2 - spec.numel))


def test_padding_is_ignored_on_unpacking():
    gradient = random_gradient(ODD_SHAPES, seed=2)
    spec = packing_spec(ODD_SHAPES, 2.0**-9)
    image = pack(gradient, spec)
    image[~valid_mask(spec)] = 5.0
    assert_exact(unpack(image, spec), gradient)


def test_the_fitted_scale_gives_unit_ish_entries_and_rejects_zeros():
    gradients = [random_gradient(ODD_SHAPES, seed=s) for s in range(3)]
    scale = fit_scale(gradients)
    assert scale == 2.0**-10  # root mean square 1e-3, nearest power of two
    images = pack_many(gradients, packing_spec(ODD_SHAPES, scale))
    rms = float(images.double().square().sum() / (3 * packing_spec(ODD_SHAPES, scale).numel)) ** 0.5
    assert 2**-0.5 <= rms <= 2**0.5
    with pytest.raises(ValueError, match="only zeros"):
        fit_scale([[torch.zeros(3)], [torch.zeros(())]])


def test_spec_json_round_trip_is_exact():
    spec = packing_spec(ODD_SHAPES, 0.1)
    again = spec_from_dict(json.loads(json.dumps(spec_to_dict(spec))))
    assert again == spec and again.scale == 0.1 and again.shapes[0] == ()
    with pytest.raises(ValueError, match="lacks scale"):
        spec_from_dict({"shapes": [[2]], "side": 8})


def test_mismatches_name_what_was_expected_and_what_came():
    spec = packing_spec([(2, 3), (3,)], 1.0)
    with pytest.raises(ValueError, match=r"expected 2 tensors .* got 1"):
        pack([torch.zeros(2, 3)], spec)
    with pytest.raises(ValueError, match=r"tensor 1 has shape \(4,\), expected \(3,\)"):
        pack([torch.zeros(2, 3), torch.zeros(4)], spec)
    with pytest.raises(ValueError, match=r"expected shape \(1, 8, 8\), got \(1, 16, 16\)"):
        unpack(torch.zeros(1, 16, 16), spec)
    with pytest.raises(ValueError, match=r"expected shape \(N, 1, 8, 8\), got \(1, 8, 8\)"):
        unpack_many(torch.zeros(1, 8, 8), spec)
    with pytest.raises(ValueError, match="same leading job dimension"):
        pack_many([torch.zeros(2, 2, 3), torch.zeros(3, 3)], spec)
    with pytest.raises(ValueError, match="floating point"):
        pack([torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)], spec)
    with pytest.raises(ValueError, match="side 2 holds 4 entries, the gradient has 9"):
        PackingSpec(((2, 3), (3,)), 2, 1.0)
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            PackingSpec(((2,),), 8, scale)


def test_batched_packing_equals_the_single_versions():
    gradients = [random_gradient(ODD_SHAPES, seed=s) for s in range(4)]
    spec = packing_spec(ODD_SHAPES, 0.01)
    singles = torch.stack([pack(g, spec) for g in gradients])
    assert torch.equal(pack_many(gradients, spec), singles)
    stacked = [torch.stack(tensors) for tensors in zip(*gradients)]
    assert torch.equal(pack_many(stacked, spec), singles)
    batched = unpack_many(singles, spec)
    for index, image in enumerate(singles):
        assert_exact([t[index] for t in batched], unpack(image, spec))
    with pytest.raises(ValueError, match="at least one"):
        pack_many([], spec)


# -- surrogate collection --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_set() -> GradientSet:
    return collect_gradients("mlp", None, "mnist-5k", "test", SMALL)


def test_collection_records_n_packed_gradients_along_the_run(digits_set):
    steps_run = len(load_dataset("mnist-5k").test) // SMALL.batch_size
    assert len(digits_set) == 12 and digits_set.images.shape == (12, 1, 520, 520)
    assert digits_set.spec.side == 520 and digits_set.batches.shape == (12, 1) and digits_set.batch_size == 1
    assert digits_set.steps.tolist() == recording_steps(steps_run, 12)
    assert digits_set.steps[0] == 0 and digits_set.steps[-1] == steps_run - 1
    assert digits_set.model_params == dataclasses.asdict(MLPParams())
    assert (digits_set.dataset, digits_set.split, digits_set.start) == ("mnist-5k", "test", "seed")
    mask = valid_mask(digits_set.spec)
    assert torch.equal(digits_set.images[:, ~mask], torch.zeros(12, int((~mask).sum())))
    assert math.log2(digits_set.spec.scale) == round(math.log2(digits_set.spec.scale))


def test_collection_is_deterministic_for_a_seed(digits_set):
    again = collect_gradients("mlp", None, "mnist-5k", "test", SMALL)
    for name in ("images", "steps", "batches", "losses"):
        assert torch.equal(getattr(again, name), getattr(digits_set, name))
    other = collect_gradients("mlp", None, "mnist-5k", "test", dataclasses.replace(SMALL, seed=4))
    assert not torch.equal(other.images, digits_set.images)


def test_the_surrogate_trains_and_each_recording_is_the_upload_of_its_batch(digits_set):
    data = load_dataset("mnist-5k")
    x, y = data.test.batch()
    model = build_surrogate("mlp", None, data.spec, SMALL.seed)
    public_loss, gradients = {}, {}
    for record in trajectory(model, data.test, SMALL):
        if record.index in (0, 5, 11):
            public_loss[record.index] = evaluate(model, x, y)[0]
            gradients[record.index] = record.gradient
        if record.index == 5:  # recheck mid-run: the model is the one that produced the gradient
            assert_exact(compute_gradients(model, *data.test.batch(record.batch))[0], record.gradient)
            assert record.step == digits_set.steps[5] and record.batch.tolist() == digits_set.batches[5].tolist()
    assert public_loss[11] < public_loss[0] - 0.5
    assert not torch.allclose(gradients[0][-1], gradients[11][-1])
    for index, gradient in gradients.items():
        assert torch.equal(digits_set.images[index], pack(gradient, digits_set.spec))
        assert_exact(unpack(digits_set.images[index], digits_set.spec), gradient)


def test_the_first_recording_is_the_upload_of_the_rebuilt_start_model(digits_set):
    data = load_dataset("mnist-5k")
    model = build_surrogate(digits_set.model, digits_set.model_params, digits_set.data_spec, digits_set.options.seed)
    first = compute_gradients(model, *data.test.batch(digits_set.batches[0]))[0]
    assert_exact(unpack(digits_set.images[0], digits_set.spec), first)


def test_collection_can_start_from_given_weights_and_reports_progress():
    data = load_dataset("mnist-5k")
    params = MLPParams(hidden=16, depth=1)
    start = build_surrogate("mlp", params, data.spec, seed=99)
    options = SurrogateOptions(epochs=1, gradients=3, batch_size=4)
    seen = []
    got = collect_gradients("mlp", params, "mnist-5k", options=options, progress=seen.append, weights=get_arrays(start))
    assert got.start == "weights" and got.batches.shape == (3, 4)
    assert [(s.index, s.count, s.step) for s in seen] == [(1, 3, 0), (2, 3, 124), (3, 3, 249)]
    assert str(seen[-1]).startswith("gradient 3/3 at step 249/250: loss ")
    first = compute_gradients(start, *data.test.batch(got.batches[0]))[0]
    assert_exact(unpack(got.images[0], got.spec), first)
    assert [tuple(p.shape) for p in parameters(start)] == list(got.spec.shapes)


def test_a_zero_learning_rate_records_every_gradient_at_the_start_model():
    data = load_dataset("mnist-5k")
    params = MLPParams(hidden=16, depth=1)
    start = build_surrogate("mlp", params, data.spec, seed=5)
    got = collect_gradients("mlp", params, "mnist-5k", options=SurrogateOptions(epochs=1, gradients=4, lr=0.0, seed=5))
    for image, batch in zip(got.images, got.batches):
        assert_exact(unpack(image, got.spec), compute_gradients(start, *data.test.batch(batch))[0])


def test_photos_lenet_set_has_side_128_and_survives_save_and_load(tmp_path):
    gradient_set = collect_gradients("lenet", None, "photos", "test", SurrogateOptions(gradients=8))
    assert gradient_set.images.shape == (8, 1, 128, 128) and gradient_set.spec.numel == 15_826
    path = save_gradient_set(gradient_set, tmp_path / "sets" / "lenet.npz")
    loaded = load_gradient_set(path)
    for name in ("images", "steps", "batches", "losses"):
        assert torch.equal(getattr(loaded, name), getattr(gradient_set, name))
        assert getattr(loaded, name).dtype == getattr(gradient_set, name).dtype
    assert loaded.meta() == gradient_set.meta()
    assert loaded.spec == gradient_set.spec and loaded.options == gradient_set.options
    assert loaded.data_spec == gradient_set.data_spec


def test_loading_reports_a_missing_file_and_a_foreign_one(tmp_path):
    missing = tmp_path / "nothing.npz"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_gradient_set(missing)
    np.savez(tmp_path / "foreign.npz", weights=np.zeros(3))
    with pytest.raises(ValueError, match="not a Mjölnir gradient set: it lacks meta, images"):
        load_gradient_set(tmp_path / "foreign.npz")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epochs", 0),
        ("batch_size", 0),
        ("gradients", 0),
        ("multiple", 0),
        ("seed", -1),
        ("lr", -0.1),
        ("lr", float("nan")),
        ("epochs", 1.5),
    ],
)
def test_options_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        SurrogateOptions(**{field: value})


def test_impossible_collections_are_refused():
    with pytest.raises(ValueError, match="raise epochs or lower gradients"):
        collect_gradients("mlp", None, "mnist-5k", "test", SurrogateOptions(epochs=1, gradients=10_000))
    with pytest.raises(ValueError, match="fewer than one batch of 5000"):
        collect_gradients("mlp", None, "mnist-5k", "test", SurrogateOptions(batch_size=5000))
    with pytest.raises(ValueError, match="split 'valid'"):
        collect_gradients("mlp", None, "mnist-5k", "valid")
    with pytest.raises(ValueError, match="cannot record 3 gradients in 2"):
        recording_steps(2, 3)
