"""The device the attack tests run their searches on: ``FEDGUARD_TEST_DEVICE`` ('cpu', the default, or 'cuda')."""

from __future__ import annotations

import os

import torch

DEVICES = ("cpu", "cuda")
ATTACK_DEVICE = os.environ.get("FEDGUARD_TEST_DEVICE", "cpu")
if ATTACK_DEVICE not in DEVICES:
    raise ValueError(f"FEDGUARD_TEST_DEVICE={ATTACK_DEVICE!r}: choose one of {', '.join(DEVICES)}")
if ATTACK_DEVICE == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("FEDGUARD_TEST_DEVICE=cuda, but CUDA is not available here")
