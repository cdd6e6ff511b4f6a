"""Random generators derived from (seed, client, round), never from process or actor order."""

from __future__ import annotations

import numpy as np
import torch


def client_generators(seed: int, client: int, round_: int) -> tuple[np.random.Generator, torch.Generator]:
    """Independent numpy and torch generators for one client in one round."""
    sequence = np.random.SeedSequence([seed, client, round_])
    numpy_state, torch_state = sequence.spawn(2)
    generator = torch.Generator().manual_seed(int(torch_state.generate_state(1, np.uint64)[0] >> np.uint64(1)))
    return np.random.default_rng(numpy_state), generator
