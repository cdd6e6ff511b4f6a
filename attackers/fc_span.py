"""The inputs of the first Linear layer, read off the span of its update: an analytic honest-server attack on FedSGD
gradients and FedAvg updates.

Why it works. The first Linear layer ``y = W x + b`` of an MLP takes the flattened image itself. One example's
gradient of ``[W | b]`` is ``delta x~^T`` with ``x~ = [x; 1]``; a FedSGD gradient sums such terms over the batch, a
FedAvg update (``global - uploaded``) sums ``lr`` times them over every local step, however the client reshuffled
its batches and whatever the layers after the first do (BatchNorm in training mode included): the layer's input is
the raw image at every step. So ``G = [dW | db]`` (units, d + 1) is ``sum_i d_i x~_i^T`` over the N distinct images:
its row space is exactly their span, and its rank is N (on the realistic setting's FedAvg uploads its singular
values fall from about 0.1 to 3e-8 after the N-th).

Which points of the span are the images. With ``V`` (N, d + 1) an orthonormal basis of the row space (the top right
singular vectors of ``G``), every point is ``x~ = V^T a``. The images are the points with last coordinate 1 whose
pixels lie in the box [0, 1]: points of the polytope ``P = {x : [x; 1] = V^T a, 0 <= x <= 1}``. A vertex of ``P``
lies on N - 1 faces of the box in general; an image lies on one face per pixel at 0 or 1, which for a digit is most
of its background: the images are vertices of ``P`` on far more faces than the others. Each linear program over
``P`` maximizes one pixel (weight ``pull``), drawn among those the span can light, with a unit cost on every pixel,
which favours sparse vertices; HiGHS returns a vertex. Up to ``ROUNDS`` rounds of ``tries_per_image`` programs per
image still missing run (``span_images``), each after the first aimed at the pixels the images found so far leave
dark. The distinct vertices are ranked by the faces they lie on (counting only faces that not every point of the
span lies on), and the N best that are linearly independent are the images. Nothing here knows the images' values:
the box [0, 1] is every data set's.

Images with few pixels at 0 or 1 (photos) give vertices on few more faces than the generic ones, and the ranking
cannot tell images from mixtures; a defense that perturbs every entry (DP noise, quantization) makes ``G`` of full
rank, and N is then the declared example count.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from scipy.optimize import linprog

from attackers.base import Reconstruction, class_traits, images_per_upload, register_attack
from attackers.manipulation import HONEST
from attackers.trap_weights import as_images, first_layer_update, upload_labels
from fedguard.observation import Observation

FACE_TOLERANCE = 1e-5
"""A pixel within this of 0 or 1 (pixel units) lies on that face of the box."""
INDEPENDENT = 1e-3
"""Unit span coefficients within this singular value of the span of those chosen before are no new image."""
SURE = 0.6
"""A chosen vertex on at least this share of the faces of the first is taken for an image where the next round
aims (on the realistic setting's uploads images meet 0.67-1 of the most faces, mixtures 0.3-0.5; a mixture taken
for an image only narrows that round's aim, and the final choice is by faces whatever this says)."""
ROUNDS = 4
"""Rounds of programs at most, each aimed at the images the rounds before missed."""
TRIVIAL = 1e-9
"""A face whose coefficient vector in the span is shorter than this holds every point of the span."""


@dataclass(frozen=True)
class SpanParams:
    """``tries_per_image``: linear programs per image of the upload (each maximizes one pixel); ``pull``: the weight
    of that pixel against the unit cost on every pixel; ``rank_tolerance``: singular values below this share of the
    largest count as zero (float32 uploads leave about 1e-7)."""

    tries_per_image: int = 12
    pull: float = 200.0
    rank_tolerance: float = 1e-5

    def __post_init__(self) -> None:
        if not 1 <= self.tries_per_image <= 10_000:
            raise ValueError(f"tries_per_image must be in 1..10000, got {self.tries_per_image}")
        if not 0 < self.pull < 1e12:
            raise ValueError(f"pull must be > 0 and < 1e12, got {self.pull}")
        if not 0 < self.rank_tolerance < 1:
            raise ValueError(f"rank_tolerance must be in (0, 1), got {self.rank_tolerance}")


def input_span(update: torch.Tensor, examples: int, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """(an orthonormal basis ``V`` (N, d + 1) of the row space of ``update`` (units, d + 1) = ``[dW | db]``, its
    singular values (all of them, descending)): N is the numerical rank (singular values above ``tolerance`` times
    the largest), at most ``examples``."""
    _, singular, right = torch.linalg.svd(update.double(), full_matrices=False)
    rank = int((singular > tolerance * singular[0]).sum()) if singular[0] > 0 else 0
    count = max(1, min(examples, rank))
    return right[:count].numpy(), singular.numpy()


def face_vectors(basis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(zero-face coefficients (d, N), one-face coefficients (d, N)) of the span ``basis`` (N, d + 1): pixel p of
    ``V^T a`` is 0 where ``zero[p] . a = 0`` and 1 (with last coordinate 1) where ``one[p] . a = 0``."""
    pixels, last = basis[:, :-1].T, basis[:, -1]
    return pixels, pixels - last[None, :]


def faces_met(points: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """(n,) how many non-trivial box faces each flattened point (n, d) of the span lies on, within
    ``FACE_TOLERANCE``."""
    zero, one = face_vectors(basis)
    live_zero = np.linalg.norm(zero, axis=1) > TRIVIAL
    live_one = np.linalg.norm(one, axis=1) > TRIVIAL
    at_zero = (np.abs(points) <= FACE_TOLERANCE) & live_zero[None]
    at_one = (np.abs(points - 1) <= FACE_TOLERANCE) & live_one[None]
    return (at_zero | at_one).sum(1)


def lit_pixels(basis: np.ndarray) -> np.ndarray:
    """Indices of the pixels some point of the span ``basis`` (N, d + 1) lights (the others are 0 in all of it)."""
    return np.nonzero(np.linalg.norm(basis[:, :-1], axis=0) > TRIVIAL)[0]


def box_vertices(basis: np.ndarray, targets: np.ndarray, pull: float) -> tuple[np.ndarray, np.ndarray]:
    """(vertices of the polytope P (module docstring) as span coefficients (n, N), as flattened images (n, d)): one
    linear program per pixel of ``targets`` (lit pixels), maximizing it with weight ``pull`` against a unit cost on
    every pixel; programs without a solution are left out."""
    pixels, last = basis[:, :-1].T, basis[:, -1]
    lit = lit_pixels(basis)
    rows = pixels[lit]
    bounds_matrix = np.vstack([rows, -rows])
    bounds = np.concatenate([np.ones(len(lit)), np.zeros(len(lit))])
    coefficients: list[np.ndarray] = []
    for target in targets:
        weights = np.ones(len(lit))
        weights[np.searchsorted(lit, target)] = -pull
        solved = linprog(
            rows.T @ weights,
            A_ub=bounds_matrix,
            b_ub=bounds,
            A_eq=last[None],
            b_eq=[1.0],
            bounds=[(None, None)] * basis.shape[0],
            method="highs",
        )
        if solved.status == 0:
            coefficients.append(solved.x)
    found = np.array(coefficients).reshape(-1, basis.shape[0])
    return found, found @ pixels.T


def span_images(
    basis: np.ndarray, params: SpanParams, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, list[int], int]:
    """(the vertices found (n, d), the faces each meets (n,), the chosen ones, in rank order, how many of them are
    sure): up to ``ROUNDS`` rounds of ``tries_per_image`` programs per image still missing, the first over every
    lit pixel, each later one over the lit pixels that every sure image leaves at 0 (where a missing image must
    light some). A chosen vertex is sure when it meets at least ``SURE`` times the faces of the first."""
    count = basis.shape[0]
    lit = lit_pixels(basis)
    coefficients, points = np.zeros((0, count)), np.zeros((0, basis.shape[1] - 1))
    faces = np.zeros(0, dtype=int)
    chosen: list[int] = []
    sure: list[int] = []
    for _ in range(ROUNDS):
        dark = lit[(np.abs(points[sure][:, lit]) <= FACE_TOLERANCE).all(0)] if sure else lit
        if len(dark) == 0:
            break
        found, images = box_vertices(
            basis, rng.choice(dark, size=params.tries_per_image * (count - len(sure))), params.pull
        )
        coefficients, points = np.vstack([coefficients, found]), np.vstack([points, images])
        faces = faces_met(points, basis)
        chosen = independent_best(coefficients, faces, count)
        sure = [i for i in chosen if faces[i] >= SURE * faces[chosen[0]]] if chosen else []
        if len(sure) == count:
            break
    return points, faces, chosen, len(sure)


def independent_best(coefficients: np.ndarray, faces: np.ndarray, count: int) -> list[int]:
    """Indices of at most ``count`` vertices (span coefficients (n, N)), in decreasing order of ``faces``, each
    linearly independent (its unit span coefficients, up to ``INDEPENDENT``) of those before it: a repeat of a vertex
    (which programs solved to about 1e-5 return a little apart), or a mixture of chosen ones, is passed over."""
    directions = coefficients / np.linalg.norm(coefficients, axis=1, keepdims=True)
    chosen: list[int] = []
    for index in np.argsort(-faces, kind="stable"):
        if np.linalg.matrix_rank(directions[[*chosen, index]], tol=INDEPENDENT) == len(chosen) + 1:
            chosen.append(int(index))
        if len(chosen) == count:
            break
    return chosen


def first_layer_matrix(obs: Observation) -> torch.Tensor:
    """(units, d + 1) float64: the first Linear layer's update ``[dW | db]`` of ``obs``."""
    _, weight, bias = first_layer_update(obs)
    return torch.cat([weight, bias[:, None]], 1)


def first_layer_is_linear(model: nn.Module) -> None:
    """Raise ``ValueError`` unless the first module with parameters is a Linear layer with a bias."""
    first = next((m for m in model.modules() if list(m.parameters(recurse=False))), None)
    if not isinstance(first, nn.Linear) or first.bias is None:
        kind = type(first).__name__ if first is not None else "no layer"
        raise ValueError(
            f"fc-span reads the inputs of a first Linear layer with bias on the flattened image; this model's "
            f"first layer is {kind} (choose model.name = 'mlp')"
        )


class SpanAttack:
    """The images behind one upload as the most degenerate vertices of the box inside the span of its first-layer
    update (module docstring)."""

    needs: frozenset[str] = frozenset()
    needs_by_upload: Mapping[str, frozenset[str]] = {}
    uploads: frozenset[str] = frozenset({"gradient", "weights"})
    sums: frozenset[str] = frozenset({"gradient", "weights"})  # an aggregate's first layer spans every image
    manipulation = HONEST
    check_model = staticmethod(first_layer_is_linear)

    def __init__(self, params: SpanParams) -> None:
        self.params = params

    def reconstruct_one(self, obs: Observation, rng: np.random.Generator) -> Reconstruction:
        """The images (and inferred or declared labels) of one upload."""
        return self.read_span(obs, first_layer_matrix(obs), rng, time.perf_counter())

    def read_span(
        self, obs: Observation, update: torch.Tensor, rng: np.random.Generator, start: float
    ) -> Reconstruction:
        """The images (and labels) of ``obs`` read off the span of ``update`` (units, d + 1) = ``[dW | db]``, its
        first layer's update; ``start``: when the attack on it began (``time.perf_counter``)."""
        batch = images_per_upload(obs)
        basis, singular = input_span(update, batch, self.params.rank_tolerance)
        count = basis.shape[0]
        points, faces, chosen, sure = span_images(basis, self.params, rng)
        labels, inferred = upload_labels(obs, batch)
        picked = [torch.from_numpy(points[i]) for i in chosen]
        stats = {
            "rank": count,
            "singular_gap": float(singular[count] / singular[count - 1]) if count < len(singular) else None,
            "vertices": len(points),
            "faces_met": [int(faces[i]) for i in chosen],
            "sure": sure,
            "labels_inferred": inferred,
            "seconds": time.perf_counter() - start,
        }
        return Reconstruction(as_images(picked, batch, obs.spec), labels, stats)

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        """``reconstruct_one`` of each upload, the pixels the programs maximize drawn from ``seed``."""
        rng = np.random.default_rng(seed)
        return [self.reconstruct_one(obs, rng) for obs in observations]


@register_attack("fc-span", params=SpanParams, traits=class_traits(SpanAttack))
def build_span_attack(params: SpanParams) -> SpanAttack:
    """The first Linear layer's inputs as the most degenerate vertices of the pixel box in its update's row space."""
    return SpanAttack(params)
