"""MLflow bookkeeping for one pipeline run, through a write-ahead spool that survives tracking outages.

Every write (create a run, log metrics/params/tags, an artifact, a table, end a run) is first appended to
``<run_dir>/mlflow-spool/journal.jsonl`` and then delivered in order. When the tracking server cannot be
reached the write stays in the journal, the step carries on, and the next write, the next step, the exit
handler or ``python -m pipelines mlflow-sync RUN_DIR`` delivers it later. Delivery is idempotent, so a record
delivered twice (a crash between the server's commit and our bookmark) leaves no duplicate:

- runs are found again by tags before one is created (the parent by ``pipeline_run_id``; a step's run by the
  spool key it was created with), so a retried step or a replayed journal never makes a second run;
- metrics carry their original timestamps, and MLflow drops a metric whose (key, value, step, timestamp) is
  already logged; params and tags are set to the same value again; an artifact is overwritten with the same
  bytes (artifacts are copied into the spool when logged); a table is written whole, replacing the last one,
  and a part of a growing table (``table_part``) is named by its first row.

A long-lived process may deliver for the steps (components.delivery): they then only journal, and an answer
that depends on delivery (a run id, the pending count) waits for it.

What the trainer writes into the run folder while it trains reaches the train run through ``forward`` (the
live forwarder, components.forwarder): the rows and the forwarder's new read positions go into the journal
under one lock, so a restarted forwarder (a retried step) starts where the journal says it stopped.

The parent run is found by its ``pipeline_run_id`` tag, so any step (and the exit handler) attaches to it
without passing MLflow ids around.

Refused is not delivered: a record the server answers with a 4xx (a changed param value, a deleted
experiment or run) goes to ``rejected.jsonl`` with the server's message, and so does every later record of a
run whose creation was refused. ``rejected()`` counts them (summary.json's ``mlflow_rejected_records``,
``mlflow-sync`` exits non-zero while any remain), and ``retry_rejected()`` delivers them in order once the
cause is fixed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

from components.mlflow_server import KFP_RUN_ENV, PARENT, MlflowServer, TrackingUnavailable, is_outage
from trainer.run.run_dir import RunDir, read_json, read_jsonl, write_atomic, write_json

log = logging.getLogger(__name__)

DELIVERER_LOCK = "deliverer.lock"  # held by a live SpoolDeliverer (components.delivery)
DELIVERER_UNREACHABLE = "deliverer.unreachable"  # present while that deliverer cannot reach the server

# Bounded client retries: an outage is the spool's business, not something to wait minutes for in a step.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


def flatten(config: dict[str, Any]) -> dict[str, str]:
    """{'training': {'lr': 0.1}} -> {'training.lr': '0.1'}."""
    return {f"{section}.{key}": str(value) for section, values in config.items() for key, value in values.items()}


def metric_rows(records: Iterable[dict[str, float]], step_key: str = "step") -> list[list]:
    """Per-step dicts ({'step': 3, 'loss': …, 'time': …}) -> [key, value, timestamp_ms, step] rows."""
    now = time.time()
    return [[key, float(value), int(record.get("time", now) * 1000), int(record[step_key])]
            for record in records for key, value in record.items()
            if key not in (step_key, "time") and not isinstance(value, (list, dict))]  # (a step's skipped ranges)


class Tracker:
    """The MLflow writes of one pipeline run (all steps share the spool in the run folder)."""

    def __init__(self, tracking_uri: str, experiment: str, pipeline_run_id: str, run_dir: Path,
                 artifact_location: str = ""):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.pipeline_run_id = pipeline_run_id
        self.artifact_location = artifact_location
        self.spool = RunDir(run_dir).spool
        self.journal = self.spool / "journal.jsonl"
        self.state_path = self.spool / "delivered.json"
        self.rejected_path = RunDir(run_dir).rejected
        self.server = MlflowServer(tracking_uri, experiment, pipeline_run_id, artifact_location,
                                   tables_dir=self.spool / "tables")
        self._warned = False

    # -- what the steps call -------------------------------------------------------------------------

    def start_parent(self, params: dict[str, str], tags: dict[str, str]) -> None:
        self._record({"op": "start_run", "run": PARENT, "tags": tags, "params": params, **self._kfp_run()})

    def start_step(self, step: str, *, one_per_pipeline_run: bool = False) -> str:
        """A nested run for one execution of a step; returns its spool key. A retry gets a new run, unless
        one_per_pipeline_run (the train step: a retried launcher re-attaches to the same training, so its
        metrics continue in the same MLflow run, which is marked running again)."""
        key = step if one_per_pipeline_run else f"{step}-{uuid.uuid4().hex[:12]}"
        self._record({"op": "start_run", "run": key, "step": step, "tags": {}, "params": {}, **self._kfp_run()})
        return key

    def _kfp_run(self) -> dict[str, str]:
        """The run KFP's MLflow integration made for this task (components.mlflow_server.KFP_RUN_ENV), when it tracks
        to our server: kept in the journal, so whichever process delivers adopts KFP's runs, not a second parent."""
        run_id, theirs = os.environ.get(KFP_RUN_ENV), os.environ.get("MLFLOW_TRACKING_URI", "").rstrip("/")
        if not run_id:
            return {}
        if theirs and theirs != self.tracking_uri.rstrip("/"):
            log.warning("KFP tracks this run in MLflow at %s, the config at %s: its runs are not adopted",
                        theirs, self.tracking_uri)
            return {}
        return {"adopt": run_id}

    def forward(self, run: str, rows: list[list], cursor: dict[str, Any],
                tables: list[tuple[str, dict[str, list], int]] = ()) -> None:
        """Journal rows and table parts (artifact file, columns, first row) forwarded from the run folder together
        with the read positions after them (one lock, one fsync): a restarted forwarder resumes from
        forwarded_cursor() and sends nothing twice. What is journaled again after a crash between the two
        writes changes nothing in MLflow: it drops a metric with the same key, value, step and time, and a
        table part has the name of its first row."""
        ops = ([{"op": "metrics", "run": run, "rows": rows}] if rows else []) + [
            {"op": "table_part", "run": run, "artifact_file": name, "data": data, "first_row": first}
            for name, data, first in tables]
        with self._locked():
            if ops:
                with self.journal.open("a") as handle:
                    handle.write("".join(json.dumps({**op, "time": time.time()}) + "\n" for op in ops))
                    handle.flush()
                    os.fsync(handle.fileno())
            write_json(self.spool / "forwarded.json", cursor, fsync=True)
        if ops and not self.deliverer_active():
            self.flush()

    def forwarded_cursor(self) -> dict[str, Any]:
        return read_json(self.spool / "forwarded.json") or {}

    def log_metrics(self, run: str, records: Iterable[dict[str, float]], step_key: str = "step") -> int:
        rows = metric_rows(records, step_key)
        if rows:
            self._record({"op": "metrics", "run": run, "rows": rows})
        return len(rows)

    def set_tags(self, run: str, tags: dict[str, str]) -> None:
        self._record({"op": "tags", "run": run, "tags": tags})

    def log_artifact(self, run: str, path: Path, artifact_path: str | None = None) -> None:
        """The file is copied into the spool now, so a later delivery sends what was there at this moment."""
        copy = self.spool / "artifacts" / uuid.uuid4().hex / Path(path).name
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, copy)
        self._record({"op": "artifact", "run": run, "path": str(copy), "artifact_path": artifact_path})

    def log_table(self, run: str, data: dict[str, list], artifact_file: str) -> None:
        self._record({"op": "table", "run": run, "data": data, "artifact_file": artifact_file})

    def end_run(self, run: str, status: str) -> None:
        self._record({"op": "end_run", "run": run, "status": status})

    def logged_model(self, run: str, name: str, step: int, *, model_type: str, params: dict[str, str] | None = None,
                     tags: dict[str, str] | None = None, metrics: dict[str, float] | None = None,
                     ready: bool = False) -> None:
        """An MLflow 3 LoggedModel of `run` named `name` (found again by name, so a replay makes no second one) of
        the model family `model_type` (config.json's: llama, qwen3, ...): its params and tags set, `metrics` logged
        at `step` linked to it, READY once `ready`."""
        self._record({"op": "logged_model", "run": run, "name": name, "step": step, "model_type": model_type,
                      "params": params or {},
                      "tags": tags or {}, "metrics": metrics or {}, "ready": ready, "time": time.time()})

    def log_dataset(self, run: str, name: str, digest: str, source_uri: str, context: str = "train") -> None:
        """The run's input dataset (mlflow.data): its name, content digest and source URI."""
        self._record({"op": "dataset", "run": run, "name": name, "digest": digest, "source": source_uri,
                      "context": context})

    def run_id(self, run: str = PARENT) -> str | None:
        """The MLflow run id of a spooled run, once it has been delivered."""
        if run not in self._state()["runs"]:
            self._settle()
        return self._state()["runs"].get(run)

    def model_id(self, run: str, name: str) -> str | None:
        """The MLflow id of a spooled LoggedModel (Tracker.logged_model), once it has been delivered."""
        self._settle()
        return self._state().get("models", {}).get(f"{run}/{name}")

    def pending(self) -> int:
        """Records not yet delivered because the server was unreachable."""
        self._settle()
        return len(self._undelivered(self._state()))  # (reads the journal from where delivery stopped)

    # -- a deliverer in another process (components.delivery) ----------------------------------------

    def deliverer_active(self) -> bool:
        """Whether a live SpoolDeliverer holds this spool: then records are journaled here and delivered there."""
        if not (self.spool / DELIVERER_LOCK).is_file():
            return False
        with (self.spool / DELIVERER_LOCK).open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False

    def _settle(self, timeout: float = 60.0) -> None:
        """What is journaled delivered before an answer that depends on it: with a live deliverer, wait for it
        (unless it reports the server unreachable), then deliver whatever is left here."""
        if not self.deliverer_active():
            return  # _record delivered already
        deadline = time.monotonic() + timeout
        while (self._undelivered_bytes() and self.deliverer_active() and time.monotonic() < deadline
               and not (self.spool / DELIVERER_UNREACHABLE).exists()):
            time.sleep(0.05)
        if self._undelivered_bytes():
            self.flush()

    def connect(self) -> None:
        """Import MLflow's client and open its store now (a deliverer warms up while the first steps start)."""
        self.server.connect()

    def _undelivered_bytes(self) -> int:
        offset, size = self._state().get("offset"), self.journal.stat().st_size if self.journal.is_file() else 0
        return 1 if offset is None else max(0, size - offset)

    def rejected(self) -> int:
        """Records the server refused (or that depend on one it refused): not in MLflow."""
        return len(read_jsonl(self.rejected_path))

    # -- spool ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer at a time across processes (steps, the exit handler, mlflow-sync)."""
        self.spool.mkdir(parents=True, exist_ok=True)
        with (self.spool / "lock").open("w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _record(self, op: dict[str, Any]) -> None:
        with self._locked():
            with self.journal.open("a") as handle:
                handle.write(json.dumps({**op, "time": time.time()}) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        if not self.deliverer_active():
            self.flush()

    def _undelivered(self, state: dict[str, Any]) -> list[str]:
        """The journal's lines after the delivered ones, read from the byte offset delivery reached (a month's
        journal is not read whole at every record)."""
        if not self.journal.is_file():
            return []
        if "offset" not in state:  # a spool from before offsets were kept: find it once
            with self.journal.open("rb") as handle:
                state["offset"] = sum(len(handle.readline()) for _ in range(state["delivered"]))
        with self.journal.open("rb") as handle:
            handle.seek(state["offset"])
            text = handle.read().decode()
        complete = text[: text.rfind("\n") + 1]  # a line still being appended is not a record yet
        return complete.splitlines()

    def _state(self) -> dict[str, Any]:
        return read_json(self.state_path) or {"delivered": 0, "runs": {}, "offset": 0}

    def _save_state(self, state: dict[str, Any]) -> None:
        write_json(self.state_path, state)

    def flush(self) -> bool:
        """Deliver what is pending, in order; True when nothing is left. Never raises for an outage."""
        with self._locked():
            state = self._state()
            lines = self._undelivered(state)
            if not lines:
                return True
            try:
                self.server.check_reachable()
                for line in lines:
                    op = json.loads(line)
                    refusal = self._try_deliver(op, state)
                    if refusal is not None:  # the server answered and refused: set aside, the rest goes on
                        log.error("MLflow refused a %s record for run %s: %s (kept in %s; fix the cause, then "
                                  "`python -m pipelines mlflow-sync %s --retry-rejected`)", op["op"], op["run"],
                                  refusal, self.rejected_path, self.spool.parent)
                        with self.rejected_path.open("a") as handle:
                            handle.write(json.dumps({**op, "error": refusal}) + "\n")
                    state["delivered"] += 1
                    state["offset"] = state.get("offset", 0) + len(line.encode()) + 1
                    self._save_state(state)
            except TrackingUnavailable as err:
                if not self._warned:
                    log.warning("MLflow at %s is unreachable (%s): record(s) spooled in %s; they are delivered "
                                "when it is back, by the next step or by `python -m pipelines mlflow-sync %s`",
                                self.tracking_uri, str(err).splitlines()[0][:200], self.journal, self.spool.parent)
                    self._warned = True
                return False
            if self._warned:
                log.info("MLflow at %s is back: spooled records delivered", self.tracking_uri)
                self._warned = False
            return True

    def retry_rejected(self) -> int:
        """Deliver the refused records again, in order; returns how many are still refused. Raises
        TrackingUnavailable when the server cannot be reached (nothing is lost)."""
        with self._locked():
            state = self._state()
            records = read_jsonl(self.rejected_path)
            self.server.check_reachable()
            still = []
            for index, op in enumerate(records):
                op = {k: v for k, v in op.items() if k != "error"}
                try:
                    refusal = self._try_deliver(op, state)
                except TrackingUnavailable:
                    still.extend(records[index:])
                    self._rewrite_rejected(still)
                    self._save_state(state)
                    raise
                if refusal is not None:
                    still.append({**op, "error": refusal})
            self._save_state(state)
            self._rewrite_rejected(still)
            return len(still)

    def _rewrite_rejected(self, records: list[dict[str, Any]]) -> None:
        write_atomic(self.rejected_path, "".join(json.dumps(r) + "\n" for r in records))

    # -- delivery (what the server does with a record: components.mlflow_server) ----------------------------------

    def _try_deliver(self, op: dict[str, Any], state: dict[str, Any]) -> str | None:
        """Deliver one record: None when delivered, the reason when refused; TrackingUnavailable when the
        server cannot be reached."""
        blocker = self._blocked_by(op, state)
        if blocker is not None:
            return f"not tried: {blocker}'s start_run was refused earlier (retried with it by --retry-rejected)"
        try:
            self.server.deliver(op, state)
        except Exception as err:  # noqa: BLE001 - sorted here: outage or refusal
            if is_outage(err):
                raise TrackingUnavailable(str(err)) from err
            return str(err)
        return None

    @staticmethod
    def _blocked_by(op: dict[str, Any], state: dict[str, Any]) -> str | None:
        """The run this record needs that does not exist in MLflow (its creation was refused), if any."""
        if op["op"] != "start_run":
            return None if op["run"] in state["runs"] else f"run {op['run']!r}"
        if op["run"] != PARENT and PARENT not in state["runs"]:
            return "the pipeline's parent run"
        return None


TRAIN_RUN = "train"  # the train step's spool key (one MLflow run per pipeline run: components.train.step)


def checkpoint_model_name(step: int) -> str:
    """The name of a checkpoint's LoggedModel (the validate step makes it, the evaluate step adds its metrics)."""
    return f"step-{step:06d}"


def checkpoint_model_run(run_dir: Path, own_run: str) -> str:
    """The run a checkpoint's LoggedModel belongs to: the train run of this pipeline run, when it trained here."""
    return TRAIN_RUN if RunDir(run_dir).step_result(TRAIN_RUN).is_file() else own_run
