"""fedguard's client side as Flower mods around an app's own train function: the same upload as fedguard's client,
the accountant's epsilon, buffers never defended, refusals, the vault, FedBN."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from attackers.manipulation import build_manipulation
from clients import DefendedClient
from fedguard.config import Config, ConfigError
from fedguard.data import load_dataset
from fedguard.data.federated import client_split
from fedguard.defenses.accountant import epsilon_spent
from fedguard.defenses.gaussian_mechanism import epsilon_after
from fedguard.flower import DefendedTraining, defense_mod, detect_mod, fedbn_mod, truth_mod
from fedguard.flower.mods import batch_norm_entries, is_trainable
from fedguard.models import build_model
from fedguard.seeding import client_generators
from fedguard.store.card import model_card
from fedguard.store.vault import truth_path
from fedguard.training import local_sgd, minibatches
from fedguard.wire.records import DECLARED, DETECT, REFUSED
from fedguard.wire.sparse import SPARSE, decode_arrays
from tests.helpers import config

FEDAVG = ("train.protocol=fedavg", "train.local-epochs=2", "train.lr=0.1")


def node(cfg: Config, client: int, **node_config: object) -> Context:
    """A node whose run config holds ``cfg`` as ``fedguard.*`` keys."""
    run_config = {f"fedguard.{k}": v for k, v in cfg.to_flat().items()}
    return Context(
        run_id=7,
        node_id=100 + client,
        node_config={"partition-id": client, "num-partitions": cfg.partition.num_clients, **node_config},
        state=RecordDict(),
        run_config=run_config,
    )


def model_of(cfg: Config) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(cfg.model.name, load_dataset(cfg.data.name).spec, cfg.model.params)


def local_examples(cfg: Config, client: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = client_split(
        cfg.data.name, cfg.data.source_options(), cfg.partition.name, cfg.partition.options(),
        cfg.partition.num_clients, cfg.run.seed, client,
    )  # fmt: skip
    return local.batch()


def app_train(cfg: Config, client: int, calls: list[int] | None = None):
    """A Flower app's own train function: SGD over its examples from the model received, the trained state_dict
    and ``num-examples`` back (its batches drawn as fedguard's FedAvg client draws them)."""

    def train(msg: Message, context: Context) -> Message:
        if calls is not None:
            calls.append(1)
        round_ = int(msg.content["config"]["server-round"])
        model = model_of(cfg)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        rng, _ = client_generators(cfg.run.seed, client, round_)
        x, y = local_examples(cfg, client)
        local_sgd(model, x, y, cfg.train.lr, cfg.train.local_epochs, cfg.train.batch_size, rng)
        content = RecordDict(
            {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(y)})}
        )
        return Message(content, reply_to=msg)

    return train


def instruction(arrays: ArrayRecord, round_: int, client: int) -> Message:
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": round_})})
    return Message(content, dst_node_id=100 + client, message_type="train")


@pytest.mark.parametrize(
    "defense",
    [
        ("defense.name=dgp",),
        ("defense.name=prune", "defense.prune.keep=0.2", "defense.prune.error-feedback=true"),
        ("defense.name=quantize", "defense.quantize.bits=4"),
        ("defense.name=dp", "defense.dp.clip=0.5", "defense.dp.noise-multiplier=0.3"),
    ],
)
def test_the_mod_uploads_what_fedguards_client_uploads(defense: tuple[str, ...]) -> None:
    cfg = config(*FEDAVG, *defense)
    model = model_of(cfg)
    names = list(model.state_dict())
    arrays = [t.numpy().copy() for t in model.state_dict().values()]
    fedguard_state, context = RecordDict(), node(cfg, 1)
    for round_ in (1, 2):  # the second round carries the first's error feedback
        theirs, _, declared = DefendedClient(cfg, 1, fedguard_state).fit(arrays, {"server-round": round_})
        if declared.get("encoding") == SPARSE:
            theirs = decode_arrays(theirs)
        reply = defense_mod(instruction(ArrayRecord(model.state_dict()), round_, 1), context, app_train(cfg, 1))
        ours = reply.content["arrays"].to_numpy_ndarrays()
        assert list(reply.content["arrays"].keys()) == names
        for name, a, b in zip(names, ours, theirs):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=name)
        assert reply.content[DECLARED]["client"] == 1 and reply.content[DECLARED]["local-epochs"] == 2
        assert reply.content["metrics"]["upload-bytes"] == declared["upload-bytes"]
        assert reply.content[DECLARED]["upload-bytes"] == declared["upload-bytes"]


def test_the_dp_mods_epsilon_is_the_accountants_and_batch_norm_buffers_are_never_noised() -> None:
    cfg = config(
        *FEDAVG, "model.mlp.depth=2", "model.mlp.batch-norm=true",
        "defense.name=dp", "defense.dp.clip=0.5", "defense.dp.noise-multiplier=1.1",
    )  # fmt: skip
    model = model_of(cfg)
    context, train, fedguard_state = node(cfg, 0), app_train(cfg, 0), RecordDict()
    arrays = [t.numpy().copy() for t in model.state_dict().values()]
    for round_ in (1, 2, 3):
        _, _, fedguards = DefendedClient(cfg, 0, fedguard_state).fit(arrays, {"server-round": round_})
        msg = instruction(ArrayRecord(model.state_dict()), round_, 0)
        trained = train(instruction(ArrayRecord(model.state_dict()), round_, 0), context).content["arrays"]
        reply = defense_mod(msg, context, train)
        want = epsilon_after(round_, 1.1, 2.0, cfg.defense.params.delta)
        assert reply.content["metrics"]["defense.epsilon"] == pytest.approx(want, rel=1e-12)
        assert reply.content["defense"]["defense.epsilon"] == fedguards["defense.epsilon"]
        got = dict(zip(reply.content["arrays"].keys(), reply.content["arrays"].to_numpy_ndarrays()))
        expected = dict(zip(trained.keys(), trained.to_numpy_ndarrays()))
        buffers = [n for n in got if not is_trainable(n, got[n])]
        assert buffers and any(n.endswith("num_batches_tracked") for n in buffers)
        for name in buffers:
            assert got[name].dtype == expected[name].dtype and np.array_equal(got[name], expected[name]), name
        noised = [n for n in got if is_trainable(n, got[n]) and not np.array_equal(got[n], expected[n])]
        assert noised == [n for n in got if is_trainable(n, got[n])]


def test_the_rule_for_trainable_entries_is_the_models_own() -> None:
    cfg = config("model.mlp.depth=2", "model.mlp.batch-norm=true")
    model = model_of(cfg)
    card = model_card(cfg, model)
    assert [is_trainable(n, t.numpy()) for n, t in model.state_dict().items()] == list(card.trainable)


def test_a_defense_that_needs_the_batch_is_refused_with_the_choices() -> None:
    cfg = config(*FEDAVG, "defense.name=soteria")
    model = model_of(cfg)
    with pytest.raises(ValueError, match=r"soteria.*none, dp, dgp, prune, quantize|soteria.*dgp"):
        defense_mod(instruction(ArrayRecord(model.state_dict()), 1, 0), node(cfg, 0), app_train(cfg, 0))


def test_messages_other_than_train_pass_through_untouched() -> None:
    cfg = config(*FEDAVG, "defense.name=dgp")
    msg = Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=100, message_type="evaluate")
    answered = Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.5})}), reply_to=msg)
    assert defense_mod(msg, node(cfg, 0), lambda m, c: answered) is answered


def imprinted(cfg: Config, model: torch.nn.Module) -> ArrayRecord:
    card = model_card(cfg, model)
    honest = [t.numpy().copy() for t in model.state_dict().values()]
    manipulation = build_manipulation("imprint", cfg.manipulation("imprint").params)
    sent = manipulation(honest, card, np.random.default_rng(0))
    return ArrayRecord({n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in zip(card.names, sent)})


def test_the_detector_mod_refuses_an_imprinted_model_before_training_and_reports_on_an_honest_one() -> None:
    cfg = config(
        *FEDAVG, "detect.name=structure", "detect.action=refuse", "threat.malicious=1:imprint",
        "manipulation.imprint.bins=16",
    )  # fmt: skip
    model, calls = model_of(cfg), []
    mod = detect_mod(lambda context: local_examples(cfg, 0))
    refused = mod(instruction(imprinted(cfg, model), 1, 0), node(cfg, 0), app_train(cfg, 0, calls))
    assert (
        refused.has_error()
        and refused.error.reason.startswith(REFUSED)
        and '"structure.flagged": 1.0' in (refused.error.reason)
    )
    assert calls == []
    honest = mod(instruction(ArrayRecord(model.state_dict()), 1, 0), node(cfg, 0), app_train(cfg, 0, calls))
    assert not honest.has_error() and calls == [1]
    assert honest.content[DETECT]["flagged"] == 0.0 and honest.content[DECLARED]["client"] == 0


def test_the_truth_mod_writes_the_targeted_rounds_of_the_targeted_clients_to_the_nodes_vault(tmp_path: Path) -> None:
    cfg = config(*FEDAVG, "capture.rounds=2", "capture.clients=1")
    model = model_of(cfg)
    for client in (0, 1):
        context = node(cfg, client, **{"vault-dir": str(tmp_path)})
        mod = truth_mod(lambda context, client=client: local_examples(cfg, client))
        for round_ in (1, 2):
            mod(instruction(ArrayRecord(model.state_dict()), round_, client), context, app_train(cfg, client))
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.npz"))
    assert written == [truth_path(Path("run-7"), 2, 1)]
    with np.load(tmp_path / written[0]) as stored:
        np.testing.assert_array_equal(stored["labels"], local_examples(cfg, 1)[1].numpy())


def test_fedbn_keeps_each_clients_batch_norm_layers_and_sends_back_the_servers() -> None:
    cfg = config(*FEDAVG, "model.mlp.depth=2", "model.mlp.batch-norm=true", "train.fedbn=true")
    model = model_of(cfg)
    sent = dict(model.state_dict())
    context, train = node(cfg, 0), app_train(cfg, 0)
    first = fedbn_mod(instruction(ArrayRecord(model.state_dict()), 1, 0), context, train)
    first_arrays = dict(zip(first.content["arrays"].keys(), first.content["arrays"].to_numpy_ndarrays()))
    local = [n for n in sent if n.split(".")[0] == "4"]  # the one BatchNorm layer: 4.weight ... 4.num_batches_tracked
    assert len(local) == 5 and batch_norm_entries(list(sent)) == local
    for name in local:
        np.testing.assert_array_equal(first_arrays[name], sent[name].numpy())
    assert not np.array_equal(first_arrays["1.weight"], sent["1.weight"].numpy())
    seen: dict[str, np.ndarray] = {}

    def spy(msg: Message, context: Context) -> Message:
        seen.update(zip(msg.content["arrays"].keys(), msg.content["arrays"].to_numpy_ndarrays()))
        return train(msg, context)

    fedbn_mod(instruction(ArrayRecord(model.state_dict()), 2, 0), context, spy)
    kept = train(instruction(ArrayRecord(model.state_dict()), 1, 0), node(cfg, 0)).content["arrays"]
    kept_arrays = dict(zip(kept.keys(), kept.to_numpy_ndarrays()))
    for name in local:  # round 2 trains from the layers round 1 left on the client
        np.testing.assert_array_equal(seen[name], kept_arrays[name])


def hooked_train(cfg: Config, client: int, sgd: bool = True):
    """A Flower app's train function calling ``DefendedTraining`` for each step, its batches drawn as fedguard's
    FedAvg client draws them."""

    def train(msg: Message, context: Context) -> Message:
        round_ = int(msg.content["config"]["server-round"])
        model = model_of(cfg)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = local_examples(cfg, client)
        guard = DefendedTraining(msg, context, model, x, y)
        rng, _ = client_generators(cfg.run.seed, client, round_)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
        for _ in range(cfg.train.local_epochs):
            for batch in minibatches(len(y), cfg.train.batch_size, rng):
                guard.step(x[batch], y[batch], optimizer)
        return guard.reply({"train_loss": 0.0})

    return train


def test_an_in_training_defense_through_the_hook_uploads_what_fedguards_client_uploads() -> None:
    cfg = config(*FEDAVG, "defense.name=soteria")
    model = model_of(cfg)
    arrays = [t.numpy().copy() for t in model.state_dict().values()]
    theirs, _, declared = DefendedClient(cfg, 2, RecordDict()).fit(arrays, {"server-round": 1})
    reply = hooked_train(cfg, 2)(instruction(ArrayRecord(model.state_dict()), 1, 2), node(cfg, 2))
    ours = reply.content["arrays"].to_numpy_ndarrays()
    for name, a, b in zip(model.state_dict(), ours, theirs):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=name)
    examples = len(local_examples(cfg, 2)[1])
    assert reply.content[DECLARED]["local-steps"] == declared["local-steps"] == 2 * -(-examples // 8)
    assert reply.content["metrics"]["num-examples"] == examples


def test_refiner_defends_one_batch_gradient_and_is_refused_for_a_flower_apps_model_uploads() -> None:
    with pytest.raises(ConfigError, match="refiner.*fedsgd uploads only"):
        config(*FEDAVG, "defense.name=refiner")


def test_dp_sgd_through_the_hook_uploads_what_fedguards_client_uploads_and_its_epsilon_is_the_accountants() -> None:
    cfg = config(*FEDAVG, "defense.name=dp-sgd", "defense.dp-sgd.clip=1.0", "defense.dp-sgd.noise-multiplier=1.1")
    model = model_of(cfg)
    arrays = [t.numpy().copy() for t in model.state_dict().values()]
    fedguard_state, context = RecordDict(), node(cfg, 3)
    examples = len(local_examples(cfg, 3)[1])
    for round_ in (1, 2):
        theirs, _, declared = DefendedClient(cfg, 3, fedguard_state).fit(arrays, {"server-round": round_})
        reply = hooked_train(cfg, 3)(instruction(ArrayRecord(model.state_dict()), round_, 3), context)
        for name, a, b in zip(model.state_dict(), reply.content["arrays"].to_numpy_ndarrays(), theirs):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=f"round {round_} {name}")
        steps = round_ * 2 * -(-examples // 8)  # two epochs a round, each step one step of the accountant
        metrics = reply.content["metrics"]
        assert metrics["defense.steps"] == declared["defense.steps"] == steps
        assert metrics["defense.epsilon"] == pytest.approx(epsilon_spent(1.1, 8 / examples, steps), rel=1e-12)
        assert metrics["defense.epsilon"] == declared["defense.epsilon"]


def test_the_hook_steps_the_apps_own_optimizer() -> None:
    cfg = config(*FEDAVG, "defense.name=none")
    model, plain = model_of(cfg), model_of(cfg)
    x, y = local_examples(cfg, 0)
    guard = DefendedTraining(instruction(ArrayRecord(model.state_dict()), 1, 0), node(cfg, 0), model, x, y)
    loss = guard.step(x[:8], y[:8], torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    want = torch.nn.functional.cross_entropy(plain(x[:8]), y[:8])
    want.backward()
    optimizer.step()
    assert loss == pytest.approx(float(want.detach()))
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_hook_refuses_a_model_its_defense_cannot_defend() -> None:
    cfg = config(*FEDAVG, "defense.name=soteria", "defense.soteria.layer=3")  # a Linear layer of the registered MLP
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))  # the app's own has no layer 3
    x, y = local_examples(cfg, 0)
    with pytest.raises(ValueError, match="'3' is not a Linear layer"):
        DefendedTraining(instruction(ArrayRecord(model.state_dict()), 1, 0), node(cfg, 0), model, x, y)


def test_under_fedbn_the_mods_upload_what_fedguards_client_uploads_and_the_layers_stay_on_the_client() -> None:
    cfg = config(
        *FEDAVG, "model.mlp.depth=2", "model.mlp.batch-norm=true", "train.fedbn=true",
        "defense.name=dp", "defense.dp.clip=0.5", "defense.dp.noise-multiplier=0.3",
    )  # fmt: skip
    model = model_of(cfg)
    arrays = [t.numpy().copy() for t in model.state_dict().values()]
    fedguard_state, context = RecordDict(), node(cfg, 1)

    def app(msg: Message, context: Context) -> Message:
        return fedbn_mod(msg, context, app_train(cfg, 1))

    for round_ in (1, 2):  # round 2 trains from the BatchNorm layers round 1 left on each side
        theirs, _, _ = DefendedClient(cfg, 1, fedguard_state).fit(arrays, {"server-round": round_})
        reply = defense_mod(instruction(ArrayRecord(model.state_dict()), round_, 1), context, app)
        for name, a, b, sent in zip(model.state_dict(), reply.content["arrays"].to_numpy_ndarrays(), theirs, arrays):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=f"round {round_} {name}")
            if name.startswith("4."):
                np.testing.assert_array_equal(a, sent)


def test_the_fedbn_mod_needs_the_setting_that_tells_the_defense_and_the_attacks() -> None:
    cfg = config(*FEDAVG, "model.mlp.depth=2", "model.mlp.batch-norm=true")
    model = model_of(cfg)
    with pytest.raises(ValueError, match="fedguard.train.fedbn = true"):
        fedbn_mod(instruction(ArrayRecord(model.state_dict()), 1, 0), node(cfg, 0), app_train(cfg, 0))
