"""MLflow bookkeeping: one parent run per pipeline run, one nested run per step.

The parent run is found by its ``pipeline_run_id`` tag, so any step (and the exit handler) can attach to
it without passing MLflow ids around, and a retried step re-attaches instead of creating a second parent.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterable, Iterator

log = logging.getLogger(__name__)

PIPELINE_RUN_TAG = "pipeline_run_id"
STEP_TAG = "pipeline_step"
_BATCH = 1000  # MLflow's log_batch limit on metrics per call


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def experiment_id(tracking_uri: str, name: str, artifact_location: str = "") -> str:
    client = _client(tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location or None)


def flatten(config: dict[str, Any]) -> dict[str, str]:
    """{'training': {'lr': 0.1}} -> {'training.lr': '0.1'}."""
    return {f"{section}.{key}": str(value) for section, values in config.items() for key, value in values.items()}


def find_parent_run(tracking_uri: str, experiment: str, pipeline_run_id: str):
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.{PIPELINE_RUN_TAG} = '{pipeline_run_id}' and tags.{STEP_TAG} = 'pipeline'",
        max_results=1,
    )
    return runs[0] if runs else None


def start_parent_run(tracking_uri: str, experiment: str, pipeline_run_id: str, *, artifact_location: str = "",
                     params: dict[str, str], tags: dict[str, str]) -> str:
    """Create (or find, on a retry) the parent run; returns its MLflow run id."""
    existing = find_parent_run(tracking_uri, experiment, pipeline_run_id)
    if existing is not None:
        return existing.info.run_id
    client = _client(tracking_uri)
    run = client.create_run(experiment_id(tracking_uri, experiment, artifact_location), run_name=pipeline_run_id,
                            tags={PIPELINE_RUN_TAG: pipeline_run_id, STEP_TAG: "pipeline", **tags})
    log_params(client, run.info.run_id, params)
    return run.info.run_id


def log_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), 100):  # MLflow's per-call limit on params
        client.log_batch(run_id, params=items[start : start + 100])


def log_metric_records(client, run_id: str, records: Iterable[dict[str, float]], step_key: str = "step") -> int:
    """Log per-step dicts ({'step': 3, 'loss': …}) with log_batch; returns the metric count."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(key, float(value), int(record.get("time", now / 1000) * 1000), int(record[step_key]))
               for record in records for key, value in record.items() if key not in (step_key, "time")]
    for start in range(0, len(metrics), _BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + _BATCH])
    return len(metrics)


@contextlib.contextmanager
def step_run(tracking_uri: str, experiment: str, pipeline_run_id: str, step: str) -> Iterator[tuple[Any, str]]:
    """A nested run for one pipeline step: yields (client, run_id); FINISHED on success, FAILED on error."""
    parent = find_parent_run(tracking_uri, experiment, pipeline_run_id)
    if parent is None:
        raise RuntimeError(f"no MLflow parent run tagged {PIPELINE_RUN_TAG}={pipeline_run_id} in experiment "
                           f"{experiment!r} at {tracking_uri}: the prepare step creates it")
    client = _client(tracking_uri)
    run = client.create_run(parent.info.experiment_id, run_name=step,
                            tags={"mlflow.parentRunId": parent.info.run_id, PIPELINE_RUN_TAG: pipeline_run_id,
                                  STEP_TAG: step})
    try:
        yield client, run.info.run_id
    except BaseException:
        client.set_terminated(run.info.run_id, status="FAILED")
        raise
    client.set_terminated(run.info.run_id, status="FINISHED")
