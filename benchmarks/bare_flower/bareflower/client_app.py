"""The ClientApp: the gradient of one batch of the node's own partition, through fedguard's DGP with error
feedback (``defense = "dgp"``; residual in ``Context.state``) or not (``"none"``); the reply is the model after one
SGD step with what was sent."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from bareflower.task import client_batch, defended_gradients, local_split, process_model, sgd_step

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    run_config = context.run_config
    partition_id = int(context.node_config["partition-id"])
    local = local_split(run_config, partition_id, int(context.node_config["num-partitions"]))
    model = process_model(run_config)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    server_round = int(msg.content["config"]["server-round"])
    batch, generator = client_batch(
        len(local), int(run_config["batch-size"]), int(run_config["seed"]), partition_id, server_round
    )
    x, y = local.batch(batch)
    sent, loss = defended_gradients(
        model, x, y, str(run_config["defense"]), context.state, generator, server_round, partition_id, len(local)
    )
    sgd_step(model, sent, float(run_config["lr"]))
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)}),
        }
    )
    return Message(content=content, reply_to=msg)
