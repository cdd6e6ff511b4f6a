"""FedSGD: every selected client uploads the gradient of one local batch.

The server averages the uploads uniformly (the setting of the gradient-leakage
papers) and takes one SGD step: ``theta <- theta - lr * mean(g)``. Upload
entries that are buffers (BatchNorm running statistics) are averaged and
replace the global ones.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from flwr.common import FitIns, FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg


class FedSGD(FedAvg):
    """Federated SGD with a uniform average of client gradients.

    Parameters
    ----------
    lr : float
        Server learning rate (> 0).
    trainable : Sequence[bool]
        For each array of the model, True if it is a trainable parameter
        (updated by SGD) and False if it is a buffer (averaged).
    **kwargs
        Passed on to ``FedAvg`` (client sampling, evaluation, initial parameters).
    """

    def __init__(self, *, lr: float, trainable: Sequence[bool], **kwargs: Any) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not trainable:
            raise ValueError("trainable must list at least one array")
        super().__init__(**kwargs)
        self.lr = lr
        self.trainable = list(trainable)
        self._current: list[np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"FedSGD(lr={self.lr}, accept_failures={self.accept_failures})"

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Remember the global model, then sample clients as FedAvg does."""
        self._current = parameters_to_ndarrays(parameters)
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """One SGD step on the uniform mean of the uploaded gradients."""
        if not results or (failures and not self.accept_failures):
            return None, {}
        if self._current is None:
            raise RuntimeError("aggregate_fit called before configure_fit")
        uploads = [parameters_to_ndarrays(res.parameters) for _, res in results]
        for upload in uploads:
            if len(upload) != len(self.trainable):
                raise ValueError(f"an upload has {len(upload)} arrays, the model has {len(self.trainable)}")
        updated = [
            fedsgd_update(current, [u[i] for u in uploads], self.lr, is_param)
            for i, (current, is_param) in enumerate(zip(self._current, self.trainable))
        ]
        metrics: dict[str, Scalar] = {}
        if self.fit_metrics_aggregation_fn:
            metrics = self.fit_metrics_aggregation_fn([(res.num_examples, res.metrics) for _, res in results])
        return ndarrays_to_parameters(updated), metrics


def fedsgd_update(current: np.ndarray, uploads: list[np.ndarray], lr: float, is_param: bool) -> np.ndarray:
    """``current - lr * mean(uploads)`` for a parameter; ``mean(uploads)`` for a buffer."""
    mean = np.mean(np.stack(uploads), axis=0)
    if is_param:
        return (current - lr * mean).astype(current.dtype)
    if np.issubdtype(current.dtype, np.integer):
        return np.rint(mean).astype(current.dtype)
    return mean.astype(current.dtype)
