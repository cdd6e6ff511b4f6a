"""The ServerApp: Flower's FedAvg over every node, no federated evaluation; the global model is scored on the
held-out split after every round, and each round's wall time is appended to ``timing-file`` (JSON lines),
measured as fedguard's ``rounds.jsonl`` measures it: the time between two consecutive central evaluations."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from bareflower.task import build_model, dataset
from fedguard.training import evaluate  # the central evaluation fedguard's server runs

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = context.run_config
    num_clients, per_round = int(run_config["num-clients"]), int(run_config["clients-per-round"])
    model = build_model(run_config, seed=int(run_config["seed"]))
    x_test, y_test = dataset(run_config).test.batch()
    timing = Path(str(run_config["timing-file"])) if run_config["timing-file"] else None
    last = time.perf_counter()

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        nonlocal last
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, x_test, y_test)
        now = time.perf_counter()
        row = {"round": server_round, "accuracy": accuracy, "loss": loss, "seconds": round(now - last, 4)}
        last = now
        if timing is not None:
            with open(timing, "a") as handle:
                handle.write(json.dumps(row) + "\n")
        print(f"bareflower: {json.dumps(row)}", flush=True)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    strategy = FedAvg(
        fraction_train=per_round / num_clients,
        fraction_evaluate=0.0,
        min_train_nodes=per_round,
        min_available_nodes=num_clients,
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(run_config["num-server-rounds"]),
        evaluate_fn=evaluate_fn,
    )
