"""What a server sees under secure aggregation (``threat.aggregation = "secure"``): one round's aggregate of the
clients' defended uploads, and nothing of any single one.

Secure aggregation (Bonawitz et al., CCS 2017; Flower's SecAgg+) lets the server unmask only the sum of what the
clients submit. A client submits its upload scaled by its example count, so the server learns the example-weighted
mean ``sum_c n_c u_c / sum_c n_c`` and ``sum_c n_c``: exactly what FedAvg (or FedSGD, on gradients) aggregates.
Simulated here exactly, from the uploads the strategy aggregates: float arrays averaged in float64 and cast back,
integer buffers (BatchNorm's batch counts) averaged and rounded.

The aggregate is captured as one ``Observation`` of the reserved client id ``AGGREGATE_CLIENT``, whose declaration
names the clients it sums (``AGGREGATE_KEY``) and keeps what they declared alike (protocol, learning rate, local
epochs, batch size); a FedSGD aggregate is the gradient of the union of the batches, so its declared batch is their
total. Its ground truth is the clients' batches in that order (``fedguard.evaluation``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedguard.limits import MAX_CLIENTS
from fedguard.wire.declared import Declared

AGGREGATE_CLIENT = MAX_CLIENTS
"""The client id of an aggregate: above every real one (client ids are below ``partition.num-clients``)."""
AGGREGATE_KEY = "aggregate-of"
AGGREGATIONS = ("plain", "secure")
SHARED_FIELDS = ("protocol", "lr", "local_epochs", "batch_size", "proximal_mu")
"""Declared fields an aggregate keeps when every client declared the same value."""


def weighted_mean(uploads: Sequence[Sequence[np.ndarray]], counts: Sequence[int]) -> list[np.ndarray]:
    """The example-weighted mean of ``uploads`` (one list of arrays per client, all of one layout), each array in
    its own dtype (integers rounded)."""
    weights = np.asarray(counts, dtype=np.float64) / float(sum(counts))
    mean = []
    for arrays in zip(*uploads):
        total = sum(w * a.astype(np.float64) for w, a in zip(weights, arrays))
        kind = arrays[0].dtype
        mean.append(np.rint(total).astype(kind) if np.issubdtype(kind, np.integer) else np.asarray(total).astype(kind))
    return mean


def aggregate_declaration(
    clients: Sequence[int], declared: Sequence[Declared], counts: Sequence[int], one_batch: bool
) -> Declared:
    """What an aggregate of ``clients`` declares: the clients (``AGGREGATE_KEY``, in its ``extra``), each field of
    ``SHARED_FIELDS`` that every client declared alike, and for a one-batch protocol (FedSGD) the batch of the
    union, ``sum(counts)``."""
    shared: dict[str, Any] = {
        name: getattr(declared[0], name)
        for name in SHARED_FIELDS
        if all(getattr(d, name) == getattr(declared[0], name) for d in declared)
    }
    if one_batch:
        shared["batch_size"] = int(sum(counts))
    return Declared(**shared, extra={AGGREGATE_KEY: [int(c) for c in clients]})


def aggregated_clients(declared: Declared) -> list[int] | None:
    """The clients an observation's declaration says it aggregates, or None for a single client's upload."""
    clients = declared.extra.get(AGGREGATE_KEY)
    return None if clients is None else [int(c) for c in clients]
