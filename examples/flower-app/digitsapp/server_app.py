"""The app's ServerApp: Flower's FedAvg, wrapped by fedguard's Audit."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from digitsapp.task import Net
from fedguard.flower import Audit

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation; fedguard writes its run folder beside it."""
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=float(context.run_config["fraction-evaluate"]))
    audited = Audit(strategy, context, accuracy="eval_acc", loss="eval_loss")
    audited.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
