"""The app's ClientApp: its own training and evaluation, with fedguard's mods around training."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from digitsapp.task import Net, load_data, test, train
from fedguard.flower import defense_mod, detect_mod, truth_mod

app = ClientApp()


def examples(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples this client trains on."""
    (x, y), _ = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    return x, y


@app.train(mods=[detect_mod(examples), truth_mod(examples), defense_mod])
def train_fn(msg: Message, context: Context) -> Message:
    """Train the received model on the client's examples."""
    net = Net()
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    x, y = examples(context)
    settings = context.run_config
    loss = train(
        net,
        x,
        y,
        int(settings["fedguard.train.local-epochs"]),
        float(settings["fedguard.train.lr"]),
        int(settings["fedguard.train.batch-size"]),
    )
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Score the received model on the held-out digits."""
    net = Net()
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    _, (x, y) = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss, accuracy = test(net, x, y)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(y)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
