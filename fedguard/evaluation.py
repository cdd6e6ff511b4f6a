"""Scoring attack outcomes against the ground truth the attacker never saw.

For every outcome the evaluator reads the true batch from the vault, matches
reconstructed to true images by linear assignment, computes MSE, PSNR, SSIM,
LPIPS, label accuracy, the count of images above ``LEAK_SSIM`` and the
scores of flat mean-colour images (the floor), saves both batches as PNG grids and appends one row
to ``attacks.jsonl`` (one write per row, strict JSON; see ``fedguard.store.folder``), so nothing is lost if
the run stops.

Every attacked upload gets exactly one row, whose ``status`` is one of ``ROW_STATUSES``: the attack's own
('ok', 'error', 'timeout', 'interrupted') or 'score-error' when the attack succeeded but scoring it failed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attackers.base import AttackOutcome, Reconstruction
from fedguard.aggregate import aggregated_clients
from fedguard.config import Component, Config
from fedguard.metrics import cosine_similarity, floor_scores, gradient_psnr, score_batch
from fedguard.metrics.image import PSNR_CAP_DB
from fedguard.metrics.scoring import LEAK_SSIM
from fedguard.models import global_model
from fedguard.observation import Observation
from fedguard.report.images import save_grid
from fedguard.store.folder import ATTACKS_FILE, VAULT_DIR, JsonlAppender, grid_name, image_prefix, recon_name
from fedguard.store.invocations import image_label, invocation_of
from fedguard.store.vault import read_round_truth, read_truth, write_batch, write_truth
from fedguard.training import compute_gradients

ROW_STATUSES = ("ok", "error", "timeout", "score-error", "interrupted")


def status_counts(rows: Sequence[Mapping[str, Any]]) -> str:
    """How many rows have each status, e.g. '3 ok, 1 interrupted': 'ok' always, the others when present."""
    counts = Counter(str(row.get("status")) for row in rows)
    shown = [status for status in ROW_STATUSES if status == "ok" or counts[status]]
    shown += sorted(status for status in counts if status not in ROW_STATUSES)
    return ", ".join(f"{counts[status]} {status}" for status in shown)


def _json_image_scores(scores: dict[str, Any]) -> dict[str, Any]:
    """One image's scores for JSON, which has no infinity: PSNR clipped at ``PSNR_CAP_DB`` (an exact copy), as
    the means are."""
    return {k: min(v, PSNR_CAP_DB) if k == "psnr" else v for k, v in scores.items()}


def attack_context(config: Config, attack: Component, **extra: Any) -> dict[str, Any]:
    """What every row of ``attack`` in a run carries: attack and defense with their parameters, model, data, seed."""
    return {
        "attack": attack.name,
        "attack_params": dataclasses.asdict(attack.params),
        "defense": config.defense.name,
        "defense_params": dataclasses.asdict(config.defense.params),
        "model": config.model.name,
        "dataset": config.data.name,
        "seed": config.run.seed,
        **extra,
    }


def attack_contexts(config: Config, **extra: Any) -> dict[str, dict[str, Any]]:
    """Attack name -> its ``attack_context``, for every attack of ``config``."""
    return {attack.name: attack_context(config, attack, **extra) for attack in config.attacks}


def clean_gradient(obs: Observation, images: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """The gradient the client's true batch gives at the model it received (what an undefended client sends)."""
    grads, _ = compute_gradients(global_model(obs), images, labels)
    return grads


def gradient_scores(
    obs: Observation, gradient: list[np.ndarray], images: torch.Tensor, labels: torch.Tensor
) -> dict[str, float]:
    """Cosine similarity and PSNR (dB, +inf clipped at ``PSNR_CAP_DB`` like image PSNR) to the clean gradient of
    the upload as sent (``_before``) and of the gradient the attack inverted (``_after``, e.g. denoised)."""
    clean = clean_gradient(obs, images, labels)
    sent = [torch.tensor(a) for a, t in zip(obs.upload, obs.trainable) if t]
    used = [torch.tensor(np.asarray(a)) for a in gradient]
    return {
        "cosine_before": cosine_similarity(sent, clean),
        "cosine_after": cosine_similarity(used, clean),
        "psnr_before": min(gradient_psnr(sent, clean), PSNR_CAP_DB),
        "psnr_after": min(gradient_psnr(used, clean), PSNR_CAP_DB),
    }


def describe_row(row: dict[str, Any]) -> str:
    """One line for a person: which attack on which upload, its status, time and scores (or its error)."""
    where = f"{row.get('attack')} round {row.get('round')} client {row.get('client')}"
    if row.get("psnr") is None:
        detail = str(row.get("error") or "").strip().splitlines()[-1:] or [""]
        return f"{where}: {row.get('status')} ({row.get('seconds', 0):.1f} s) {detail[0]}".rstrip()
    floor = (row.get("floor") or {}).get("psnr")
    against = f" (flat-image floor {floor:.1f} dB)" if floor is not None else ""
    best = f" (best image {row['best_ssim']:.3f})" if row.get("best_ssim") is not None else ""
    reason = (row.get("stats") or {}).get("not_adaptive")
    plain = f"; not adaptive: {reason}" if reason else ""
    return (
        f"{where}: {row['status']} ({row['seconds']:.1f} s) PSNR {row['psnr']:.2f} dB{against}, "
        f"SSIM {row['ssim']:.3f}{best}, {row.get('leaked_images', 0)} of {len(row.get('per_image') or [])} images "
        f"above SSIM {LEAK_SSIM:g}{plain}"
    )


class Evaluator:
    """Turns ``AttackOutcome`` objects into rows of ``attacks.jsonl`` and image grids in ``run_dir``.

    ``contexts`` maps an attack name to what is copied into each of its rows (attack and defense names and
    parameters, seed, ...); each of ``listeners`` is given each row once it is in the file (a tracker).
    """

    def __init__(
        self,
        run_dir: Path,
        contexts: dict[str, dict[str, Any]],
        lpips_net: str = "alex",
        listeners: Sequence[Callable[[dict[str, Any]], None]] = (),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.contexts = contexts
        self.lpips_net = lpips_net
        self.listeners = tuple(listeners)
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, outcome: AttackOutcome) -> dict[str, Any]:
        """Score ``outcome``, write its row and grids; returns the row. A scoring failure makes the row
        'score-error' with the reason, never drops it."""
        context = self.contexts.get(outcome.attack, {"attack": outcome.attack})
        row = self._row(outcome, context)
        if outcome.status == "ok" and outcome.reconstruction is not None:
            try:
                row.update(self._scores(outcome.observation, outcome.reconstruction, context))
            except Exception:
                row.update(status="score-error", error=f"scoring failed:\n{traceback.format_exc(limit=-3)}"[-2000:])
        row["at"] = round(time.time(), 3)
        with self._lock:
            self.rows.append(row)
            with JsonlAppender(self.run_dir / ATTACKS_FILE) as rows:
                rows.append(row)
            for listener in self.listeners:
                listener(row)
        return row

    @staticmethod
    def _row(outcome: AttackOutcome, context: dict[str, Any]) -> dict[str, Any]:
        """The row of ``outcome`` before scoring: where the upload came from, the attack, its status."""
        obs = outcome.observation
        return {
            "round": obs.round,
            "client": obs.client,
            **context,
            "manipulation": obs.manipulation,
            "batch_size": obs.num_examples
            if aggregated_clients(obs.declared)
            else obs.declared.batch(obs.num_examples),
            "status": outcome.status,
            "error": outcome.error,
            "seconds": round(outcome.seconds, 3),
            "mse": None,
            "psnr": None,
            "ssim": None,
            "lpips": None,
            "label_accuracy": None,
            "images": None,
        }

    def _truth(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The true batch behind ``obs``: its client's, or for a secure aggregate the batches of the clients it
        sums, in its declared order (also written to the vault under the aggregate's id, where the report and the
        API read it)."""
        vault = self.run_dir / VAULT_DIR
        clients = aggregated_clients(obs.declared)
        if clients is None:
            return read_truth(vault, obs.round, obs.client)
        truth = read_round_truth(vault, obs.round, clients)
        if truth is not None:
            write_truth(vault, obs.round, obs.client, *truth)
        return truth

    def _scores(self, obs: Observation, rec: Reconstruction, context: dict[str, Any]) -> dict[str, Any]:
        """What scoring adds to the row of a successful attack: its stats, the scores against the vault's
        true batch and the grids' prefix (a note instead when the vault has no batch for the upload)."""
        added: dict[str, Any] = {
            "stats": {k: v for k, v in rec.stats.items() if isinstance(v, (int, float, str, bool, list))}
        }
        truth = self._truth(obs)
        if truth is None:
            return {**added, "error": "no ground truth in the vault for this upload; not scored"}
        images, labels = truth
        known = bool((rec.labels >= 0).all())  # -1: a label the attack does not know, so none is scored
        scores = score_batch(
            rec.images, images, rec.labels if known else None, labels if known else None, self.lpips_net
        )
        added.update({key: scores[key] for key in ("mse", "psnr", "ssim", "lpips", "label_accuracy")})
        added["lpips_error"] = scores["lpips_error"]
        added["per_image"] = [_json_image_scores(image) for image in scores["per_image"]]
        added["leaked_images"] = sum(image["ssim"] > LEAK_SSIM for image in scores["per_image"])
        added["best_ssim"] = max(image["ssim"] for image in scores["per_image"])  # a one-image attack's figure
        added["floor"] = floor_scores(images, self.lpips_net)
        if rec.gradient is not None:
            added["gradient"] = gradient_scores(obs, rec.gradient, images, labels)
        invocation = invocation_of(context)
        prefix = image_prefix(obs.round, obs.client, image_label(str(context.get("attack", "attack")), invocation))
        save_grid(images, self.run_dir / grid_name(prefix, "truth"), scale=None)
        order = scores["order"]
        save_grid(rec.images[order], self.run_dir / grid_name(prefix, "recon"), scale=None)
        write_batch(self.run_dir / recon_name(prefix), rec.images[order], rec.labels[order])
        added["images"] = prefix
        return added
