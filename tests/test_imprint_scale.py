"""Imprint at a large FedSGD batch, on a FedAvg update of several local steps, and its bins fitted to public
data: uploads made by ``fedguard.protocols`` on real MNIST digits (``benchmarks/malicious_batch_sizes.py``)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from attackers.base import Reconstruction, build_attack
from attackers.imprint import ImprintParams, bin_edges, build_imprint
from attackers.imprint_edges import LOW_EDGE_STDS, normal_edges, public_means, quantile_edges
from fedguard.data import load_dataset
from fedguard.data.dataset import ImageData, Split
from fedguard.observation import Observation
from fedguard.protocols import Schedule
from tests.benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("malicious_batch_sizes")


@pytest.fixture(scope="module")
def digits() -> ImageData:
    return load_dataset("mnist-5k")


def held_in(data: ImageData, count: int, seed: int = 0) -> Split:
    """``count`` random training digits (the client's batch)."""
    picked = np.random.default_rng(seed).choice(len(data.train), size=count, replace=False)
    return Split(data.train.images[picked], data.train.labels[picked])


def recovered_share(
    bench: ModuleType, params: ImprintParams, data: ImageData, protocol: str, schedule: Schedule, count: int
) -> tuple[float, Reconstruction, Observation]:
    """(share of ``count`` digits recovered above SSIM 0.9, the reconstruction) from one imprint upload."""
    obs, truth = bench.capture_upload(
        build_imprint(params),
        "imprint",
        held_in(data, count),
        data.spec,
        data.name,
        protocol,
        schedule,
        params.bins,
        seed=0,
    )
    recon = build_attack("imprint").reconstruct_many([obs], 0)[0]
    return bench.recovered(recon.images, truth)["ssim_share"], recon, obs


def test_imprint_keeps_nine_tenths_of_a_fedsgd_batch_of_256(bench: ModuleType, digits: ImageData) -> None:
    params = ImprintParams(bins=4096, edges="public", public="mnist-5k")
    share, recon, obs = recovered_share(bench, params, digits, "fedsgd", Schedule(0.1, 256, 1), 256)
    print("fedsgd 256:", share, recon.stats)
    assert obs.kind == "gradient" and recon.images.shape == (256, 1, 28, 28)
    assert share >= 0.9, (share, recon.stats)


def test_imprint_with_its_defaults_reads_a_fedavg_update_of_two_local_steps(
    bench: ModuleType, digits: ImageData
) -> None:
    """The defaults: the paper's normal prior fitted to the run's own held-out digits; 1,024 bins."""
    params = ImprintParams(bins=1024)
    share, recon, obs = recovered_share(bench, params, digits, "fedavg", Schedule(0.1, 32, 1), 64)
    print("fedavg 2 x 32:", share, recon.stats, obs.declared)
    assert obs.kind == "weights" and obs.declared.local_steps == 2
    assert recon.images.shape == (64, 1, 28, 28)
    assert share >= 0.5, (share, recon.stats)


@pytest.mark.skipif(
    not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").is_file(),
    reason="Debian package dataset-fashion-mnist not installed (.ci/run installs it where apt-get may)",
)
def test_imprint_with_its_defaults_keeps_nine_tenths_of_256_fashion_images(bench: ModuleType) -> None:
    """The defaults (the paper's normal prior fitted to the held-out Fashion-MNIST images) and 4,096 bins on a
    FedSGD batch of 256."""
    params = ImprintParams(bins=4096)
    share, recon, _ = recovered_share(
        bench, params, load_dataset("fashion-mnist"), "fedsgd", Schedule(0.1, 256, 1), 256
    )
    print("fashion fedsgd 256, defaults:", share, recon.stats)
    assert share >= 0.9, (share, recon.stats)


def test_public_edges_are_the_quantiles_of_the_public_means() -> None:
    means = np.array([0.3, 0.1, 0.4, 0.0, 0.2])  # sorted: 0, 0.1, 0.2, 0.3, 0.4
    edges = quantile_edges(4, means)
    assert edges[1:] == pytest.approx([0.1, 0.2, 0.3])  # the 1/4, 2/4, 3/4 quantiles
    assert edges[0] == pytest.approx(0.0 - LOW_EDGE_STDS * np.sqrt(0.02))  # min - 10 std (population std)
    assert quantile_edges(2, np.array([0.0, 1.0]))[1] == pytest.approx(0.5)  # interpolated median


def test_public_edges_hold_equal_shares_of_the_held_out_digits(digits: ImageData) -> None:
    params = ImprintParams(bins=8, edges="public", public="mnist-5k")
    means = digits.test.images.flatten(1).double().mean(1).numpy() / 255.0
    edges = bin_edges(params)
    assert np.array_equal(public_means("mnist-5k"), means)
    assert edges[1:] == pytest.approx(np.quantile(means, np.arange(1, 8) / 8))
    counts = np.bincount(np.searchsorted(edges, means, side="right") - 1, minlength=8)
    assert counts.sum() == len(means) and abs(counts - len(means) / 8).max() <= 2, counts


def test_public_normal_edges_are_the_normal_quantiles_of_the_public_mean_and_std(digits: ImageData) -> None:
    means = digits.test.images.flatten(1).double().mean(1).numpy() / 255.0
    edges = bin_edges(ImprintParams(bins=4, edges="public-normal", public="mnist-5k"))
    assert edges == pytest.approx(normal_edges(4, means.mean(), means.std()))
    assert edges[2] == pytest.approx(means.mean())  # the median edge is the public mean
    assert edges[3] == pytest.approx(means.mean() + 0.6744897501960817 * means.std())  # Phi^-1(3/4)


def test_the_manipulation_sends_the_fitted_edges(bench: ModuleType, digits: ImageData) -> None:
    params = ImprintParams(bins=16, edges="public", public="mnist-5k", gain=2.0)
    obs, _ = bench.capture_upload(
        build_imprint(params), "imprint", held_in(digits, 4), digits.spec, "", "fedsgd", Schedule(0.1, 4, 1), 32, 0
    )
    assert -obs.global_arrays[1][:16] / 2.0 == pytest.approx(bin_edges(params).astype(np.float32), abs=1e-6)
    assert torch.equal(torch.tensor(obs.global_arrays[1][16:]), torch.full((16,), -2.0))


def test_the_default_edges_fit_the_runs_own_held_out_split(bench: ModuleType, digits: ImageData) -> None:
    """``public`` unset: the normal prior is fitted to the data set the model card names, the run's."""
    obs, _ = bench.capture_upload(
        build_imprint(ImprintParams(bins=8)),
        "imprint",
        held_in(digits, 4),
        digits.spec,
        "mnist-5k",
        "fedsgd",
        Schedule(0.1, 4, 1),
        16,
        0,
    )
    fitted = bin_edges(ImprintParams(bins=8, public="mnist-5k"))
    assert -obs.global_arrays[1][:8] == pytest.approx(fitted.astype(np.float32), abs=1e-6)
    means = public_means("mnist-5k")
    assert fitted[4] == pytest.approx(means.mean())  # the median edge: the held-out digits' mean brightness


def test_fitted_edges_without_a_data_set_are_refused_with_the_choices(bench: ModuleType, digits: ImageData) -> None:
    with pytest.raises(ValueError, match="neither public nor the model card names a data set.*edges = 'normal'"):
        bench.capture_upload(
            build_imprint(ImprintParams(bins=8)),
            "imprint",
            held_in(digits, 4),
            digits.spec,
            "",
            "fedsgd",
            Schedule(0.1, 4, 1),
            16,
            0,
        )
