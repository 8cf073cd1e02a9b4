"""One spooled record applied to the MLflow server: find or create the runs, log in batches, replace a table.

The journal, its order and its bookmarks are components.tracking's; this module is what a record does on the
server (``MlflowServer.deliver``) and how a failure is told apart: an outage (``is_outage``: retried later,
``TrackingUnavailable``) or a refusal (set aside in rejected.jsonl). Every delivery is idempotent: runs are
found again by their tags before one is created, metrics keep their timestamps, a table is written whole.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import requests

from trainer.config.model import DEFAULT_MODEL_TYPE

PIPELINE_RUN_TAG = "pipeline_run_id"
STEP_TAG = "pipeline_step"
SPOOL_KEY_TAG = "spool_key"
PARENT = "pipeline"  # the spool's name for the parent run
# KFP's MLflow integration (KFP >= 2.17, KEP-12862) sets this in each task's container: the task's nested run,
# whose parent (tag mlflow.parentRunId) is the run KFP made for the pipeline run, in experiment MLFLOW_EXPERIMENT_ID.
KFP_RUN_ENV = "MLFLOW_RUN_ID"
_METRICS_PER_CALL = 1000  # MLflow's log_batch limits
_PARAMS_PER_CALL = 100


class TrackingUnavailable(Exception):
    """The tracking server could not be reached; the record stays spooled."""


class MlflowServer:
    """The tracking server of one pipeline run; `tables_dir`: where a table is written before it is sent."""

    def __init__(self, tracking_uri: str, experiment: str, pipeline_run_id: str, artifact_location: str,
                 tables_dir: Path):
        self.tracking_uri, self.experiment, self.pipeline_run_id = tracking_uri, experiment, pipeline_run_id
        self.artifact_location, self._tables_dir = artifact_location, Path(tables_dir)
        self._client = None
        self._adopted_experiment: str | None = None  # KFP's experiment, once its runs were adopted

    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient  # mlflow: 1.4 s to import, and the spool works without it

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def connect(self) -> None:
        """Import MLflow's client and open its store now (a deliverer warms up while the first steps start)."""
        self.check_reachable()
        self.client().search_experiments(max_results=1)

    def check_reachable(self) -> None:
        if not self.tracking_uri.startswith(("http://", "https://")):
            return  # a local store: errors surface from the calls themselves
        try:
            requests.get(self.tracking_uri.rstrip("/") + "/health", timeout=3)
        except requests.RequestException as err:
            raise TrackingUnavailable(str(err)) from err

    def _experiment_id(self) -> str:
        """Get or create, safe when several runs start at once: losing the race to create is not an error."""
        from mlflow.exceptions import MlflowException  # mlflow: 1.4 s to import, and the spool works without it

        if self._adopted_experiment is not None:
            return self._adopted_experiment
        client = self.client()
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(self.experiment, artifact_location=self.artifact_location or None)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return client.get_experiment_by_name(self.experiment).experiment_id

    def _find_run(self, tags: dict[str, str]):
        experiment_id = self._adopted_experiment
        if experiment_id is None:
            experiment = self.client().get_experiment_by_name(self.experiment)
            if experiment is None:
                return None
            experiment_id = experiment.experiment_id
        filter_string = " and ".join(f"tags.{key} = '{value}'" for key, value in tags.items())
        runs = self.client().search_runs([experiment_id], filter_string=filter_string, max_results=1)
        return runs[0] if runs else None

    def deliver(self, op: dict[str, Any], state: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag  # mlflow: 1.4 s to import, and the spool works without it

        client = self.client()
        self._adopted_experiment = state.get("kfp_experiment_id")
        if op["op"] == "start_run":
            state["runs"][op["run"]] = self._adopt(op, state) if op.get("adopt") else self._create_or_find_run(op, state)
            return
        run_id = state["runs"][op["run"]]  # the spool checked that it exists (Tracker._blocked_by)
        if op["op"] == "metrics":
            metrics = [Metric(key, value, timestamp, step) for key, value, timestamp, step in op["rows"]]
            for start in range(0, len(metrics), _METRICS_PER_CALL):
                client.log_batch(run_id, metrics=metrics[start : start + _METRICS_PER_CALL])
        elif op["op"] == "tags":
            client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in op["tags"].items()])
        elif op["op"] == "artifact":
            client.log_artifact(run_id, op["path"], op["artifact_path"])
        elif op["op"] == "table":
            self._replace_table(run_id, op["data"], op["artifact_file"])
        elif op["op"] == "table_part":
            self._log_table(run_id, op["data"], table_part_file(op["artifact_file"], op["first_row"]))
        elif op["op"] == "end_run":
            client.set_terminated(run_id, status=op["status"], end_time=int(op["time"] * 1000))
        elif op["op"] == "logged_model":
            self._logged_model(run_id, op, state)
        elif op["op"] == "dataset":
            self._dataset_input(run_id, op)
        else:
            raise AssertionError(f"unknown spool record {op['op']}")

    def _logged_model(self, run_id: str, op: dict[str, Any], state: dict[str, Any]) -> None:
        from mlflow.entities import Metric  # mlflow: see deliver

        client = self.client()
        key = f"{op['run']}/{op['name']}"
        model_id = state.setdefault("models", {}).get(key)
        if model_id is None:
            found = client.search_logged_models([self._experiment_id()], max_results=1,
                                                filter_string=f"name = '{op['name']}' AND source_run_id = '{run_id}'")
            model_id = found[0].model_id if found else client.create_logged_model(
                self._experiment_id(), name=op["name"], source_run_id=run_id,
                model_type=op.get("model_type", DEFAULT_MODEL_TYPE)).model_id
            state["models"][key] = model_id
        if op["params"]:
            client.log_model_params(model_id, {k: str(v) for k, v in op["params"].items()})
        if op["tags"]:
            client.set_logged_model_tags(model_id, op["tags"])
        if op["metrics"]:
            client.log_batch(run_id, metrics=[Metric(k, float(v), int(op["time"] * 1000), int(op["step"]),
                                                     model_id=model_id) for k, v in op["metrics"].items()])
        if op["ready"]:
            client.finalize_logged_model(model_id, "READY")

    def _dataset_input(self, run_id: str, op: dict[str, Any]) -> None:
        from mlflow.data.dataset_source_registry import resolve_dataset_source  # mlflow: see deliver
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.exceptions import MlflowException

        # MLflow keeps 36 characters of a digest: the content hash's first 32 (128 bits), the whole one as a tag.
        dataset = MetaDataset(source=resolve_dataset_source(op["source"]), name=op["name"], digest=op["digest"][:32])
        tags = [InputTag("mlflow.data.context", op["context"]), InputTag("content_hash", op["digest"])]
        inputs = [DatasetInput(dataset._to_mlflow_entity(), tags=tags)]
        try:
            self.client().log_inputs(run_id, datasets=inputs)
        except MlflowException as err:
            # Runs on the same corpus race to create its dataset row: MLflow reads whether (experiment, name,
            # digest) exists, then inserts, without a lock (sqlalchemy_store.py _log_inputs_impl), and answers the
            # loser's key violation BAD_REQUEST. Once more finds the winner's row and only links it; a request
            # that is really bad is refused again.
            if err.error_code != "BAD_REQUEST":
                raise
            self.client().log_inputs(run_id, datasets=inputs)

    def _replace_table(self, run_id: str, data: dict[str, list], artifact_file: str) -> None:
        """The whole table, in log_table's own format (pandas' split orientation) and with its UI tag, replacing
        the last one: log_table itself appends to an existing file, so a live table would repeat rows."""
        self._log_table(run_id, data, artifact_file)

    def _log_table(self, run_id: str, data: dict[str, list], artifact_file: str) -> None:
        """One table file in log_table's own format (pandas' split orientation), listed in the run's
        mlflow.loggedArtifacts tag (the UI's table view) while that tag stays within MLflow's length limit."""
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS  # mlflow: see client()
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        columns = list(data)
        rows = [list(row) for row in zip(*(data[c] for c in columns))]
        folder = self._tables_dir / uuid.uuid4().hex
        folder.mkdir(parents=True)
        try:
            (folder / Path(artifact_file).name).write_text(json.dumps({"columns": columns, "data": rows}, default=str))
            parent = str(Path(artifact_file).parent) if Path(artifact_file).parent != Path(".") else None
            self.client().log_artifact(run_id, str(folder / Path(artifact_file).name), parent)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        tagged = json.loads(self.client().get_run(run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
        if {"path": artifact_file, "type": "table"} not in tagged:
            tagged.append({"path": artifact_file, "type": "table"})
            if len(json.dumps(tagged)) <= MAX_TAG_VAL_LENGTH:  # past it the parts are artifacts, unlisted
                self.client().set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps(tagged))

    def _adopt(self, op: dict[str, Any], state: dict[str, Any]) -> str:
        """KFP made the runs: its pipeline run is the parent (not a second one), its task run the step's. They get
        the tags and params ours would have; KFP keeps their names and ends them too."""
        from mlflow.entities import Param, RunTag  # mlflow: see deliver

        client = self.client()
        task_run = client.get_run(op["adopt"])
        state["kfp_experiment_id"] = self._adopted_experiment = task_run.info.experiment_id
        if op["run"] == PARENT:
            run_id = task_run.data.tags.get("mlflow.parentRunId", task_run.info.run_id)
            tags = {PIPELINE_RUN_TAG: self.pipeline_run_id, STEP_TAG: PARENT, **op["tags"]}
        else:
            run_id = task_run.info.run_id
            tags = {SPOOL_KEY_TAG: op["run"], PIPELINE_RUN_TAG: self.pipeline_run_id, STEP_TAG: op["step"]}
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        params = [Param(k, v) for k, v in op["params"].items()]
        for start in range(0, len(params), _PARAMS_PER_CALL):
            client.log_batch(run_id, params=params[start : start + _PARAMS_PER_CALL])
        return run_id

    def _create_or_find_run(self, op: dict[str, Any], state: dict[str, Any]) -> str:
        from mlflow.entities import Param, RunTag  # mlflow: 1.4 s to import, and the spool works without it

        client = self.client()
        if op["run"] == PARENT:
            identity = {PIPELINE_RUN_TAG: self.pipeline_run_id, STEP_TAG: PARENT}
            tags = {**identity, **op["tags"]}
            name = self.pipeline_run_id
        else:
            identity = {SPOOL_KEY_TAG: op["run"], PIPELINE_RUN_TAG: self.pipeline_run_id}
            parent = state["runs"][PARENT]
            tags = {**identity, "mlflow.parentRunId": parent, PIPELINE_RUN_TAG: self.pipeline_run_id,
                    STEP_TAG: op["step"]}
            name = op["step"]
        existing = self._find_run(identity)
        if existing is not None:
            run_id = existing.info.run_id
            if existing.info.status != "RUNNING":  # a retried step in the run it had, or a continued run
                client.update_run(run_id, status="RUNNING")
            if tags:
                client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        else:
            run_id = client.create_run(self._experiment_id(), run_name=name, tags=tags,
                                       start_time=int(op["time"] * 1000)).info.run_id
        params = [Param(k, v) for k, v in op["params"].items()]
        for start in range(0, len(params), _PARAMS_PER_CALL):
            client.log_batch(run_id, params=params[start : start + _PARAMS_PER_CALL])
        return run_id


def table_part_file(artifact_file: str, first_row: int) -> str:
    """Where a growing table's part lives: recovery_events.json, first row 12 -> recovery_events/part-000012.json."""
    path = Path(artifact_file)
    return str(path.with_suffix("") / f"part-{first_row:06d}{path.suffix}")


def is_outage(err: Exception) -> bool:
    """Connection failures and 5xx/429 answers are outages (retry later); other refusals are not."""
    import sqlalchemy.exc  # with mlflow (see client()): only once a delivery failed
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(err, (requests.RequestException, ConnectionError, TimeoutError, sqlalchemy.exc.OperationalError)):
        return True  # OperationalError: a local store that is locked or on a missing volume
    if isinstance(err, RestException):
        return err.get_http_status_code() >= 500 or err.get_http_status_code() == 429
    if isinstance(err, MlflowException):
        text = str(err)
        return any(marker in text for marker in ("Max retries exceeded", "Connection", "timed out", "API request to"))
    return False

