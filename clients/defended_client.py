"""The Flower client: the configured detectors on the model received, a local step, the configured defense, then
the upload."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn as nn
from flwr.app import RecordDict
from flwr.client import NumPyClient

from clients.local_batch_norm import KEY_PREFIX as FEDBN_PREFIX
from clients.local_batch_norm import after_step, as_sent_back, load_local, without_batch_norm
from clients.state import ClientState, RecordState
from fedguard.config import Component, Config, DataSection, PartitionSection
from fedguard.data import Split, load_dataset
from fedguard.data.federated import client_split
from fedguard.defenses import Defense, LocalStep, build_defense, defense_report
from fedguard.defenses.base import defense_traits, step_gradient
from fedguard.detect import STATE_PREFIX, Action, Detector, Received, Verdict, build_detector, detect
from fedguard.models import build_model
from fedguard.protocols import Schedule
from fedguard.protocols import protocol as run_protocol
from fedguard.seeding import client_generators
from fedguard.store.vault import write_truth
from fedguard.training import get_arrays, loss_fn, merge_by_mask, set_arrays, split_by_mask, trainable_mask
from fedguard.wire.records import PROXIMAL_MU_KEY, ROUND_KEY, ClientReply
from fedguard.wire.sparse import SPARSE, byte_counts, encode_arrays


@functools.lru_cache(maxsize=2)
def _model(name: str, params: Any, data: DataSection) -> nn.Module:
    """One model instance per process and architecture; weights are loaded every round."""
    return build_model(name, load_dataset(data.name, data.source_options()).spec, params)


@functools.lru_cache(maxsize=2)
def _defense(name: str, params: Any) -> Defense:
    return build_defense(name, params)


@functools.lru_cache(maxsize=2)
def _detectors(chosen: tuple[Component, ...]) -> dict[str, Detector]:
    return {c.name: build_detector(c.name, c.params) for c in chosen}


DETECT_STREAM = 0x64657463  # seeds the batch the detectors check, apart from the training batches


class ModelDeclined(Exception):
    """The client's detectors flagged the model and ``detect.action`` declines the round (skip or refuse)."""

    def __init__(self, client: int, verdict: Verdict) -> None:
        super().__init__(f"client {client} declines the model ({verdict.action})")
        self.client = client
        self.verdict = verdict


def _local_data(data: DataSection, partition: PartitionSection, seed: int, client: int) -> Split:
    return client_split(
        data.name, data.source_options(), partition.name, partition.options(), partition.num_clients, seed, client
    )


class DefendedClient(NumPyClient):
    """Runs the configured protocol on one partition and defends every upload.

    Parameters
    ----------
    config : Config
        The run configuration.
    client_id : int
        The partition this client holds (0 <= client_id < partition.num-clients).
    state : ClientState | RecordDict
        Where the defense's state is kept across rounds (``clients.state``); a ``RecordDict`` is a node's
        ``Context.state``.
    vault : Path | None
        Where the true batches of targeted uploads are written for scoring, as the client's own configuration
        names it (``fedguard.runtime.client_app.truth_vault``); None: nowhere.
    """

    def __init__(
        self, config: Config, client_id: int, state: ClientState | RecordDict, vault: Path | None = None
    ) -> None:
        if not 0 <= client_id < config.partition.num_clients:
            raise ValueError(f"client_id {client_id} outside [0, {config.partition.num_clients})")
        self.config = config
        self.client_id = client_id
        self.state: ClientState = RecordState(state) if isinstance(state, RecordDict) else state
        self.vault = vault

    def _targeted(self, round_: int) -> bool:
        """Whether the server captures this client's upload of ``round_`` (``capture.rounds``, ``.clients``)."""
        capture = self.config.capture
        return round_ in capture.round_selection() and self.client_id in capture.client_selection()

    def _inspect(self, model: nn.Module, local: Split, state: dict[str, torch.Tensor], round_: int) -> Verdict:
        """The configured detectors' verdict on the received ``model``, checked on a batch of ``train.batch-size``
        of the client's examples drawn for the round (apart from its training batches); their part of ``state``
        is updated in place."""
        cfg = self.config
        rng = np.random.default_rng(np.random.SeedSequence([cfg.run.seed, self.client_id, round_, DETECT_STREAM]))
        x, y = local.batch(rng.choice(len(local), size=min(cfg.train.batch_size, len(local)), replace=False))
        own = {k: v for k, v in state.items() if k.startswith(STATE_PREFIX)}
        action = cast(Action, cfg.detect.action)  # one of ACTIONS: the configuration checks it
        verdict = detect(_detectors(cfg.detectors), Received(model, x, y, loss_fn), own, action)
        state.update(own)
        return verdict

    def _load_model(self, arrays: list[np.ndarray]) -> nn.Module:
        model = _model(self.config.model.name, self.config.model.params, self.config.data)
        set_arrays(model, arrays)
        return model

    def fit(
        self, parameters_in: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        """Flower's ``NumPyClient.fit``: the round's ``round_reply`` as (upload, number of examples, one flat
        mapping of what the client declares, its ``defense.*`` reports and its detectors' ``detect.*`` findings)."""
        reply = self.round_reply(parameters_in, config)
        return reply.upload, reply.num_examples, reply.metrics()

    def round_reply(self, parameters_in: list[np.ndarray], config: dict[str, Any]) -> ClientReply:
        """One round: detectors, local step, defense, upload.

        The configured detectors check the model received first; when they flag it and ``detect.action`` is
        ``skip`` or ``refuse``, nothing is trained or uploaded: ``ModelDeclined`` is raised with their verdict.
        ``config['server-round']`` is the server round; in a targeted round the true batch is written to
        ``vault`` for scoring (never uploaded, and never to a folder the server names);
        ``config['proximal-mu']`` (Flower's FedProx) adds the proximal term to FedAvg's local training. Under
        ``train.fedbn`` the BatchNorm layers are the client's own (``clients.local_batch_norm``): loaded from its
        state before the detectors and the step, kept after it, hidden from the defense, and sent back as the
        server sent them.
        A defense that ``defends_steps`` (DP-SGD) under a protocol that uploads models is followed by every local
        step instead of applied to the round's change.
        Returns the reply: the upload (coordinate-encoded when that halves it at least, marked by ``encoding``),
        the number of examples, what the client declares (hyper-parameters, ``labels`` where the threat model
        grants them, sizes), the defense's reports and the detectors' findings.
        """
        round_ = int(config[ROUND_KEY])
        cfg = self.config
        rng, generator = client_generators(cfg.run.seed, self.client_id, round_)
        local = _local_data(cfg.data, cfg.partition, cfg.run.seed, self.client_id)
        model = self._load_model(parameters_in)
        state = self.state.load(round_)
        if cfg.train.fedbn:
            load_local(model, state)
        start = get_arrays(model) if cfg.train.fedbn else parameters_in
        findings: dict[str, float | str] = {}
        if cfg.detectors:
            verdict = self._inspect(model, local, state, round_)
            if verdict.declines:
                self.state.store(round_, state)
                raise ModelDeclined(self.client_id, verdict)
            findings = verdict.row()
        mask = trainable_mask(model)
        protocol = run_protocol(cfg.train.protocol)
        mu = float(config.get(PROXIMAL_MU_KEY, 0.0))
        defense = _defense(cfg.defense.name, cfg.defense.params)
        defense_state = {k: v for k, v in state.items() if not k.startswith((STATE_PREFIX, FEDBN_PREFIX))}
        every_step = defense_traits(cfg.defense.name, cfg.defense.params).defends_steps
        every_step = every_step and protocol.upload_kind == "weights"
        gradient = step_gradient(defense, defense_state, generator, round_, self.client_id, len(local))
        schedule = Schedule(
            cfg.train.lr, cfg.train.batch_size, cfg.train.local_epochs, gradient=gradient if every_step else None
        )
        update = protocol.local_step(model, local, schedule, rng, proximal_mu=mu)
        x, y, grads = update.x, update.y, update.direction
        _, buffers = split_by_mask(get_arrays(update.buffers_from), mask)
        if update.buffers_from is model:  # the step ran through the model it started from: its statistics go back
            set_arrays(model, start)
        if cfg.train.fedbn:
            state.update(after_step(model, grads, buffers, protocol.upload_kind, cfg.train.lr))
            grads = without_batch_norm(model, grads)
        declared = update.declared.with_fields(
            client=self.client_id,
            protocol=protocol.name,
            lr=cfg.train.lr,
            proximal_mu=mu if mu > 0 else None,
            labels=tuple(int(v) for v in y.tolist()) if cfg.threat.labels else None,
        )
        if self.vault is not None and self._targeted(round_):
            write_truth(self.vault, round_, self.client_id, x, y)

        kept = {k: v for k, v in state.items() if k.startswith((STATE_PREFIX, FEDBN_PREFIX))}
        step = LocalStep(model, x, y, grads, loss_fn, generator, round_, self.client_id, len(local))
        sent = grads if every_step else defense(step, defense_state)  # every step followed the defended gradient
        reports = defense_report(defense, defense_state)
        self.state.store(round_, {**defense_state, **kept})

        if cfg.train.fedbn:
            set_arrays(model, parameters_in)  # the upload is made from the model the server sent
        upload = merge_by_mask(protocol.upload(model, sent), buffers, mask)
        if cfg.train.fedbn:
            upload = as_sent_back(model, upload, parameters_in, protocol.upload_kind)
        size = byte_counts(upload)
        # a pruned upload travels coordinate-encoded (strategies.SparseUploads)
        encoded = 2 * size.encoded <= size.dense
        declared = declared.with_fields(
            encoding=SPARSE if encoded else None,
            upload_bytes=size.encoded if encoded else size.dense,
            dense_bytes=size.dense,
        )
        sent_arrays = encode_arrays(upload) if encoded else upload
        return ClientReply(sent_arrays, len(y), declared, reports, findings)
