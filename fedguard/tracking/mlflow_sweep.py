"""One MLflow store for a sweep: a parent run named after the sweep with each of its runs nested under it.

The runs that log to MLflow at the same tracking URI and experiment as the sweep's first tracked run log to one
store: the URI they name, or ``mlflow.db`` in the sweep folder when they name none. ``fedguard sweep`` opens
the parent run (the one of an earlier, stopped run of the same sweep folder again) and gives each run its id as
``track.mlflow-parent``; MLflow then shows the runs nested under the sweep (tag ``mlflow.parentRunId``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fedguard.config import Config
from fedguard.tracking import local_store

log = logging.getLogger(__name__)
SWEEP_TAG = "fedguard.sweep"  # on a sweep's parent run: 'true'


@contextmanager
def sweep_parent(name: str, folder: Path, configs: list[Config]) -> Iterator[Callable[[Config], Config]]:
    """While open, the parent MLflow run of the sweep ``name`` in ``folder`` (none when no run logs to MLflow),
    ended ``FINISHED``, or ``FAILED`` when the sweep raised; yields what a run's configuration becomes to be
    nested under it. A store that cannot be opened is named in a warning and the runs are not nested."""
    tracked = [config.track for config in configs if config.track.mlflow]
    if not tracked:
        yield lambda config: config
        return
    from fedguard.tracking.mlflow_log import FOLDER_TAG, experiment_id, open_client

    given, experiment = tracked[0].mlflow_uri, tracked[0].mlflow_experiment
    uri, artifacts = (given, None) if given else local_store(folder)
    try:
        client = open_client(uri)
        experiment_of = experiment_id(client, experiment, artifacts)
        where = folder.absolute()
        found = client.search_runs(
            [experiment_of], f"tags.`{SWEEP_TAG}` = 'true' and tags.`{FOLDER_TAG}` = '{where}'", max_results=1
        )
        parent = (
            found[0].info.run_id
            if found
            else client.create_run(
                experiment_of, run_name=name, tags={SWEEP_TAG: "true", FOLDER_TAG: str(where)}
            ).info.run_id
        )
    except Exception as error:  # tracking never stops a sweep
        log.warning("tracking: the sweep's MLflow run could not be opened (%s: %s)", type(error).__name__, error)
        yield lambda config: config
        return

    def nest(config: Config) -> Config:
        track = config.track
        if not track.mlflow or (track.mlflow_uri, track.mlflow_experiment) != (given, experiment):
            return config
        return dataclasses.replace(config, track=dataclasses.replace(track, mlflow_uri=uri, mlflow_parent=parent))

    status = "FAILED"
    try:
        yield nest
        status = "FINISHED"
    finally:
        client.set_terminated(parent, status)
