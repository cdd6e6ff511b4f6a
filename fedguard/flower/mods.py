"""fedguard's client side as Flower mods: ``ClientApp(mods=[...])`` or ``@app.train(mods=[...])`` of any app.

Each mod is a callable ``(Message, Context, call_next) -> Message`` that acts on train messages only and passes
every other message through. They read fedguard's settings from the run config (``fedguard.*``,
``fedguard.flower.settings``) and the client's id from the node config (``partition-id``):

- ``defense_mod``: the configured update-level defense (``defense.name``: none, dp, dgp, prune, quantize, or a
  plugin's defense whose traits say ``update_only``) on what the app's own training changed, ``global - local``
  of every trainable entry; the reply carries ``global - defended``. Buffers (BatchNorm's running statistics and
  its integer ``num_batches_tracked``) go as the training left them, never defended or noised. State (residuals,
  the accountant's releases) lives in ``Context.state``; randomness comes from (``run.seed``, client, round),
  as in fedguard's own client, so that the same update gives the same upload there and here. The defense's
  reports (``defense.epsilon``, ...) and the upload's size (``upload-bytes``: coordinate-encoded where that
  halves it at least, as fedguard's client sends a pruned upload; ``dense-bytes``) are added to the reply's
  ``MetricRecord`` for any strategy to log.
- ``detect_mod(examples)``: the configured detectors (``detect.name``) on the model received, before the app
  trains on it; a flagged model is trained on anyway, skipped or refused as ``detect.action`` says.
- ``truth_mod(examples)``: the true examples of a round the server targets (``capture.rounds``,
  ``capture.clients``), written to the client's own vault for scoring, never sent.
- ``fedbn_mod``: every BatchNorm layer stays on its client (FedBN, ``train.fedbn``): the app trains its own layers
  and the server gets back the ones it sent; the defense is given zeros there.

``examples(context) -> (x, y)`` is the app's own: the examples the client trains on this round, ``x``
(N, C, H, W) in [0, 1] as the model takes them and ``y`` (N,) class indices. An entry is trainable when it is
floating point and not a BatchNorm running statistic (``running_mean``, ``running_var``): the mods need nothing
of the app but its arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.clientapp.typing import ClientAppCallable

from clients.defended_client import DETECT_STREAM, ModelDeclined
from clients.state import RecordState
from fedguard.config import Config
from fedguard.defenses import build_defense, defense_report
from fedguard.defenses.base import DEFENSES, REPORT_PREFIX, defense_traits, update_step
from fedguard.detect import STATE_PREFIX, Action, Received, build_detector, detect
from fedguard.flower.settings import PREFIX, audit_config, client_id
from fedguard.models import build_model
from fedguard.protocols import protocol as run_protocol
from fedguard.runtime.client_app import declined_reply, truth_vault
from fedguard.seeding import client_generators
from fedguard.store.vault import write_truth
from fedguard.training import loss_fn
from fedguard.wire.declared import Declared
from fedguard.wire.records import CLIENT_KEY, NUM_EXAMPLES, ROUND_KEY, annotate, array_record
from fedguard.wire.sparse import byte_counts

Examples = Callable[[Context], tuple[torch.Tensor, torch.Tensor]]
"""The app's own: ``context -> (x, y)``, the examples this client trains on in the round."""

DEFENSE_STATE = "fedguard.defense"
DETECT_STATE = "fedguard.detect"
FEDBN_STATE = "fedguard.fedbn"
RUNNING_STATISTICS = ("running_mean", "running_var")


def is_train(msg: Message) -> bool:
    """Whether ``msg`` is a train instruction (``train`` or ``train.<action>``)."""
    return msg.metadata.message_type.split(".")[0] == MessageType.TRAIN


def _only(records: dict[str, Any], kind: str, what: str) -> str:
    if len(records) != 1:
        raise ValueError(f"{what} holds {len(records)} {kind}s ({sorted(records)}); fedguard's mods need one")
    return next(iter(records))


def only_arrays(content: RecordDict, what: str) -> tuple[str, ArrayRecord]:
    """The key and the one ``ArrayRecord`` of ``content``; ``ValueError`` when there is not exactly one."""
    key = _only(dict(content.array_records), "ArrayRecord", what)
    return key, content.array_records[key]


def only_metrics(content: RecordDict, what: str) -> tuple[str, MetricRecord]:
    """The key and the one ``MetricRecord`` of ``content``; ``ValueError`` when there is not exactly one."""
    key = _only(dict(content.metric_records), "MetricRecord", what)
    return key, content.metric_records[key]


def train_round(msg: Message) -> int:
    """The server round of a train instruction (Flower's strategies send ``server-round``)."""
    for record in msg.content.config_records.values():
        value = record.get(ROUND_KEY)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"the train instruction holds no whole {ROUND_KEY!r}; send it in the train config")


def is_trainable(name: str, array: np.ndarray) -> bool:
    """Whether the entry ``name`` is a trainable parameter: floating point and no BatchNorm running statistic."""
    return np.issubdtype(array.dtype, np.floating) and name.rsplit(".", 1)[-1] not in RUNNING_STATISTICS


def _check_update_only(config: Config) -> None:
    name = config.defense.name
    if not defense_traits(name, config.defense.params).update_only:
        choices = [n for n in DEFENSES.names() if defense_traits(n).update_only]
        raise ValueError(
            f"{PREFIX}defense.name = {name!r} needs the model and the batch inside training, which a mod cannot "
            f"reach; a mod applies {', '.join(choices)}. Call fedguard.flower.defended_step from your own train "
            "function for the others"
        )


def examples_in(metrics: MetricRecord) -> int:
    """The reply's ``num-examples`` (0 when it gives none)."""
    counted = metrics.get(NUM_EXAMPLES, 0)
    return int(counted) if isinstance(counted, (int, float)) else 0


def defended_model(
    sent: list[np.ndarray], trained: list[np.ndarray], trainable: list[bool], defended: list[torch.Tensor]
) -> list[np.ndarray]:
    """The upload: ``sent - defended`` at the trainable entries (``defended``: one per trainable entry, in order),
    the ``trained`` buffers at the others."""
    moved = iter(defended)
    return [
        (torch.from_numpy(g) - next(moved).detach().cpu()).numpy() if keep else t
        for g, t, keep in zip(sent, trained, trainable)
    ]


def write_upload(
    reply: Message,
    names: list[str],
    upload: list[np.ndarray],
    reports: dict[str, float],
    config: Config,
    client: int,
    steps: int | None = None,
) -> Message:
    """``reply`` carrying ``upload`` (keyed by ``names``) in place of its arrays, the defense's ``reports`` and the
    upload's sizes added to its metrics, and what the client declares (``declared``: its ``client``, the protocol,
    the ``train.*`` schedule, ``steps`` local steps or as many as the schedule takes); ``defense``: the
    reports."""
    arrays_key, _ = only_arrays(reply.content, "the reply")
    metrics_key, metrics = only_metrics(reply.content, "the reply")
    examples = examples_in(metrics)
    size = byte_counts(upload)
    travels = size.encoded if 2 * size.encoded <= size.dense else size.dense  # as fedguard's client would send it
    schedule = config.train
    if steps is None:
        steps, _ = run_protocol(schedule.protocol).local_steps(examples, schedule.batch_size, schedule.local_epochs)
    declared = Declared(
        client=client,
        protocol=schedule.protocol,
        lr=schedule.lr,
        batch_size=min(schedule.batch_size, examples) if examples else schedule.batch_size,
        local_epochs=schedule.local_epochs,
        local_steps=steps,
        upload_bytes=travels,
        dense_bytes=size.dense,
    )
    content = reply.content
    content[arrays_key] = array_record(names, upload)
    content[metrics_key] = MetricRecord({**metrics, **reports, "upload-bytes": travels, "dense-bytes": size.dense})
    annotate(content, declared.record(), {k: v for k, v in reports.items() if k.startswith(REPORT_PREFIX)})
    return reply


def defend_reply(msg: Message, reply: Message, config: Config, client: int, state: RecordDict) -> Message:
    """``reply`` with the configured defense applied to the change its training made to ``msg``'s model
    (``write_upload``); ``state`` holds the defense's state across rounds. Under ``train.fedbn`` the defense is
    given zeros at the BatchNorm entries, and they go back as ``msg`` sent them (``fedbn_mod`` inside this mod
    kept the trained ones on the client)."""
    round_ = train_round(msg)
    _, sent_record = only_arrays(msg.content, "the train instruction")
    _, reply_record = only_arrays(reply.content, "the reply")
    _, metrics = only_metrics(reply.content, "the reply")
    names = list(sent_record.keys())
    if list(reply_record.keys()) != names:
        raise ValueError("the reply's arrays are not the model's entries in the model's order")
    sent = sent_record.to_numpy_ndarrays()
    trained = reply_record.to_numpy_ndarrays()
    trainable = [is_trainable(n, a) for n, a in zip(names, sent)]
    local = set(batch_norm_entries(names)) if config.train.fedbn else set()
    change = [
        torch.zeros(g.shape) if n in local else torch.from_numpy(g) - torch.from_numpy(t)
        for n, g, t, keep in zip(names, sent, trained, trainable)
        if keep
    ]
    examples = examples_in(metrics)
    _, generator = client_generators(config.run.seed, client, round_)
    home = RecordState(state, DEFENSE_STATE)
    kept = home.load(round_)
    defense = build_defense(config.defense.name, config.defense.params)
    defended = defense(update_step(change, generator, round_, client, examples), kept)
    home.store(round_, kept)
    upload = [
        g if n in local else u for n, g, u in zip(names, sent, defended_model(sent, trained, trainable, defended))
    ]
    return write_upload(reply, names, upload, defense_report(defense, kept), config, client)


def defense_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The configured update-level defense on every train reply (module docstring)."""
    if not is_train(msg):
        return call_next(msg, context)
    config = audit_config(context)
    _check_update_only(config)
    client = client_id(context)
    reply = call_next(msg, context)
    if reply.has_error() or not reply.content.array_records:
        return reply
    return defend_reply(msg, reply, config, client, context.state)


def received_model(msg: Message, config: Config) -> torch.nn.Module:
    """The configured model (``model.name``, registered with fedguard) at the arrays of ``msg``."""
    from fedguard.data import load_dataset

    spec = load_dataset(config.data.name, config.data.source_options()).spec
    model = build_model(config.model.name, spec, config.model.params)
    _, record = only_arrays(msg.content, "the train instruction")
    model.load_state_dict(record.to_torch_state_dict())
    return model


def detect_mod(examples: Examples) -> Callable[[Message, Context, ClientAppCallable], Message]:
    """A mod running the configured detectors on the model each train instruction carries, checked on a batch
    of ``train.batch-size`` of ``examples(context)`` drawn for the round as fedguard's client draws it; a model
    they flag is trained on (``detect.action = 'report'``), answered with its findings and no upload (``skip``)
    or with an error holding them (``refuse``). The findings travel in the reply's ``detect`` record."""

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        config = audit_config(context) if is_train(msg) else None
        if config is None or not config.detectors:
            return call_next(msg, context)
        client, round_ = client_id(context), train_round(msg)
        x, y = examples(context)
        rng = np.random.default_rng(np.random.SeedSequence([config.run.seed, client, round_, DETECT_STREAM]))
        batch = rng.choice(len(y), size=min(config.train.batch_size, len(y)), replace=False)
        detectors = {c.name: build_detector(c.name, c.params) for c in config.detectors}
        home = RecordState(context.state, DETECT_STATE)
        own = {k: v for k, v in home.load(round_).items() if k.startswith(STATE_PREFIX)}
        action: Action = config.detect.action  # type: ignore[assignment]  # one of ACTIONS: the configuration checks it
        received = Received(received_model(msg, config), x[batch], y[batch], loss_fn)
        verdict = detect(detectors, received, own, action)
        home.store(round_, own)
        if verdict.declines:
            return declined_reply(msg, ModelDeclined(client, verdict))
        reply = call_next(msg, context)
        if not reply.has_error():
            annotate(reply.content, {CLIENT_KEY: client}, findings=verdict.row())
        return reply

    return mod


def truth_mod(examples: Examples) -> Callable[[Message, Context, ClientAppCallable], Message]:
    """A mod writing ``examples(context)`` to the client's vault in the rounds whose uploads the server captures
    (``capture.rounds``, ``capture.clients``, ``capture.ground-truth``): in simulation the run folder's vault, on a
    SuperNode the node config's ``vault-dir``; nothing leaves the client."""

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if is_train(msg):
            config = audit_config(context)
            client, round_ = client_id(context), train_round(msg)
            capture = config.capture
            vault = truth_vault(context, config)
            if vault is not None and round_ in capture.round_selection() and client in capture.client_selection():
                x, y = examples(context)
                write_truth(vault, round_, client, x, y)
            reply = call_next(msg, context)
            if not reply.has_error():
                annotate(reply.content, {CLIENT_KEY: client})
            return reply
        return call_next(msg, context)

    return mod


def batch_norm_entries(names: list[str]) -> list[str]:
    """The entries of every BatchNorm layer: those sharing the prefix of a ``running_mean`` entry."""
    layers = {n[: -len(".running_mean")] for n in names if n.endswith(".running_mean")}
    return [n for n in names if n.rsplit(".", 1)[0] in layers]


def fedbn_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """FedBN (``train.fedbn = true``): the app trains the client's own BatchNorm layers (kept in ``Context.state``;
    the server's at its first round), and the reply holds at every BatchNorm entry what the server sent, so that
    the mean leaves the global ones unchanged. Put it after ``defense_mod`` (nearer the train function), or
    around a train function calling ``DefendedTraining``."""
    if not is_train(msg):
        return call_next(msg, context)
    if not audit_config(context).train.fedbn:
        raise ValueError(
            f"fedbn_mod needs {PREFIX}train.fedbn = true, so that the defense leaves the BatchNorm layers out and "
            "the attacks that read them are refused"
        )
    key, record = only_arrays(msg.content, "the train instruction")
    names = list(record.keys())
    local = batch_norm_entries(names)
    if not local:
        raise ValueError("fedbn_mod: the model has no BatchNorm layer (no '.running_mean' entry)")
    home = RecordState(context.state, FEDBN_STATE)
    kept = home.load(train_round(msg))
    sent = dict(zip(names, record.to_numpy_ndarrays()))
    own = {n: kept[n].numpy() if n in kept else sent[n] for n in names if n in local}
    msg.content[key] = array_record(names, [own.get(n, sent[n]) for n in names])
    reply = call_next(msg, context)
    msg.content[key] = record
    if reply.has_error() or not reply.content.array_records:
        return reply
    reply_key, trained = only_arrays(reply.content, "the reply")
    values = dict(zip(trained.keys(), trained.to_numpy_ndarrays()))
    home.store(train_round(msg), {n: torch.from_numpy(np.array(values[n])) for n in local})
    reply.content[reply_key] = array_record(names, [sent[n] if n in local else values[n] for n in names])
    return reply
