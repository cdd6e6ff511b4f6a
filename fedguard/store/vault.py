"""The ground-truth vault: the true batches behind targeted uploads, for scoring only.

In simulation, clients write the batch of each targeted round to the run folder's
``vault/``; a SuperNode writes only when its own node config opts in, under its
own folder (``fedguard.runtime.client_app.truth_vault``). Attackers never read it (they
receive only ``Observation`` objects); the evaluator does. One file per upload:
``round-RRRR_client-CCCC.npz`` with ``images`` (B, C, H, W) float32 in [0, 1]
and ``labels`` (B,) int64.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedguard.store.folder import VAULT_DIR, recon_name, replacing, upload_file_name


def truth_path(vault: Path, round_: int, client: int) -> Path:
    """Where the batch of ``client`` in ``round_`` is kept."""
    return Path(vault) / upload_file_name(round_, client)


def write_truth(vault: Path, round_: int, client: int, images: torch.Tensor, labels: torch.Tensor) -> Path:
    """Store one true batch atomically."""
    return write_batch(truth_path(vault, round_, client), images, labels)


def write_batch(path: Path, images: torch.Tensor, labels: torch.Tensor) -> Path:
    """Store a batch atomically at ``path`` as ``.npz``: ``images`` float32 (N, C, H, W), ``labels`` int64."""
    with replacing(path, sync=False) as handle:
        np.savez(handle, images=images.detach().cpu().float().numpy(), labels=labels.detach().cpu().long().numpy())
    return path


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The batch ``write_batch`` stored at ``path`` (images, labels), or None when there is none."""
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as archive:
        return archive["images"], archive["labels"]


def read_truth(vault: Path, round_: int, client: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The true batch (images, labels), or None when the vault does not hold it."""
    batch = read_batch(truth_path(vault, round_, client))
    return None if batch is None else (torch.from_numpy(batch[0]), torch.from_numpy(batch[1]))


def read_round_truth(vault: Path, round_: int, clients: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batches of ``clients`` in ``round_`` one after the other (the truth behind their aggregate), or None
    when one is missing."""
    batches = [read_truth(vault, round_, client) for client in clients]
    if any(batch is None for batch in batches):
        return None
    present = [batch for batch in batches if batch is not None]
    return torch.cat([images for images, _ in present]), torch.cat([labels for _, labels in present])


def read_scored_images(
    run_dir: Path, round_: int, client: int, prefix: str
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(truth, reconstruction) images of the attack whose grids are named ``prefix`` on the upload of ``client``
    in ``round_``, each (N, C, H, W) float32 in [0, 1], image i of one matched to image i of the other; None
    where ``run_dir`` does not hold it."""
    truth = read_batch(truth_path(run_dir / VAULT_DIR, round_, client))
    recon = read_batch(run_dir / recon_name(prefix))
    return (None if truth is None else truth[0]), (None if recon is None else recon[0])
