"""The run's progress where its users look: the TrainJob's status on EKS, the train step's log everywhere.

Kubeflow Trainer >= 2.2 (feature gate TrainJobStatus) takes ``status.trainerStatus`` from the training itself
through a server its controller names in the pod's environment (``KUBEFLOW_TRAINER_SERVER_URL``, its CA in
``KUBEFLOW_TRAINER_SERVER_CA_CERT``, a projected service-account token at ``KUBEFLOW_TRAINER_SERVER_TOKEN``
that rotates, so it is read again before every update). Rank 0 builds the status every
``kubernetes.progress_interval_seconds``:

- ``progressPercentage``: steps done of training.num_steps (99 at most until the last step is done);
- ``estimatedRemainingSeconds``: the remaining steps at the measured time per step (saves included), divided
  by the goodput the planner expects of this job's recovery layers (trainer.planning: faults at
  checkpoint.auto_node_mtbf_hours per node, each costing this run's measured restart time when it has one);
- ``metrics`` (name/value strings of at most 64 characters): step, total_steps, loss, tokens_per_second,
  goodput (steps kept x time per step / the run's wall time: its launches', trainer.run.history), restarts,
  last_checkpoint_step, last_checkpoint_age_seconds, straggler;
- ``lastUpdatedTime``, which the CRD requires whenever trainerStatus is present (a CEL rule).

The status is written to ``<run_dir>/trainer_status.json`` (the train step logs it, on either launcher) and,
where the server's variables are set, POSTed from a background thread: a slow or failing server never holds
up or stops training (failures are logged, the first and every tenth). Without the variables (an older
Trainer, a local run) nothing is sent.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import ssl
import statistics
import threading
import time
import urllib.request
from typing import Any, Callable

from trainer.run.lease import check_fence_of_this_process
from trainer.env import TRAINER_SERVER_CA_CERT_ENV, TRAINER_SERVER_TOKEN_ENV, TRAINER_SERVER_URL_ENV
from trainer.planning.goodput import Costs, evaluate
from trainer.run.history import ControlState
from trainer.run.run_dir import RunDir, write_json

log = logging.getLogger(__name__)

# The TrainJob CRD's limits on status.trainerStatus (Kubeflow Trainer v2.3.0, trainer.kubeflow.org_trainjobs.yaml).
MAX_METRICS, MAX_CHARS, INT32_MAX = 256, 64, 2**31 - 1
POST_TIMEOUT_SECONDS = 10.0


def rfc3339(now: float) -> str:
    """A metav1.Time as the API server writes it: UTC, whole seconds, 'Z'."""
    return datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _text(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def trainer_status(*, step: int, num_steps: int, eta_seconds: float | None, metrics: dict[str, Any], now: float,
                   finished: bool = False) -> dict[str, Any]:
    """status.trainerStatus within the CRD's limits: percentage 0-100, int32 seconds, at most 256 metrics of
    1-64 character names and values (longer values are cut, empty ones left out)."""
    status: dict[str, Any] = {"progressPercentage": 100 if finished else max(0, min(99, step * 100 // num_steps)),
                              "lastUpdatedTime": rfc3339(now)}
    if finished:
        status["estimatedRemainingSeconds"] = 0
    elif eta_seconds is not None:
        status["estimatedRemainingSeconds"] = max(0, min(INT32_MAX, int(eta_seconds)))
    items = [{"name": name[:MAX_CHARS], "value": _text(value)[:MAX_CHARS]} for name, value in metrics.items()
             if value is not None and _text(value)]
    if items:
        status["metrics"] = items[:MAX_METRICS]
    return status


def expected_remaining_seconds(cfg, *, remaining_steps: int, step_seconds: float, nodes: int,
                               restart_seconds: float | None) -> float:
    """Remaining steps at step_seconds each, stretched by the planner's expected goodput of this job."""
    # imports torch: here, so the train step reads progress_line without it
    from trainer.planning.auto import job_configuration

    kwargs = {"restart_seconds": restart_seconds} if restart_seconds else {}
    costs = Costs(nodes=nodes, node_mtbf_hours=cfg.checkpoint.auto_node_mtbf_hours, step_seconds=step_seconds,
                  checkpoint_stall_seconds=0.0, **kwargs)  # step_seconds already holds the saves' waits
    goodput = evaluate(costs, job_configuration(cfg))["goodput"]
    return remaining_steps * step_seconds / max(goodput, 0.01)


class StatusSender:
    """POSTs the newest status on a thread of its own (an older one not yet sent is replaced)."""

    def __init__(self, url: str, token_path: str | None, ca_file: str | None,
                 opener: Callable[..., Any] = urllib.request.urlopen):
        self.url, self.token_path, self._open = url, token_path, opener
        self.context = ssl.create_default_context(cafile=ca_file) if ca_file and url.startswith("https") else None
        self.sent = self.failures = 0
        self._pending: dict | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="trainjob-status", daemon=True)
        self._thread.start()

    def send(self, status: dict[str, Any]) -> None:
        with self._wake:
            self._pending = status
            self._wake.notify()

    def close(self, timeout: float = POST_TIMEOUT_SECONDS) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                status, self._pending = self._pending, None
            if status is not None:
                self._post(status)
            elif self._closed:
                return

    def _post(self, status: dict[str, Any]) -> None:
        try:
            headers = {"Content-Type": "application/json"}
            if self.token_path:  # read every time: the projected token is rotated by the kubelet
                with open(self.token_path, encoding="utf-8") as handle:
                    headers["Authorization"] = f"Bearer {handle.read().strip()}"
            request = urllib.request.Request(self.url, data=json.dumps({"trainerStatus": status}).encode(),
                                             headers=headers, method="POST")
            with self._open(request, timeout=POST_TIMEOUT_SECONDS, context=self.context) as response:
                if not 200 <= response.status < 300:
                    raise OSError(f"HTTP {response.status}")
            self.sent += 1
        except Exception as err:  # noqa: BLE001 - progress is informative: never let it stop training
            self.failures += 1
            if self.failures == 1 or self.failures % 10 == 0:
                log.warning("TrainJob status update to %s failed (%d so far; training goes on): %s", self.url,
                            self.failures, err)


class ProgressReporter:
    """Rank 0's progress; observe(step, metrics, straggler) once per step, finish(step) at the end. A no-op on
    other ranks."""

    def __init__(self, cfg, *, rank: int, nodes: int, launched_at: float | None = None, restarted: bool = False,
                 history: ControlState | None = None,
                 last_checkpoint: Callable[[], tuple[int, float] | None] = lambda: None,
                 environ: dict[str, str] | None = None, clock: Callable[[], float] = time.time):
        """launched_at: this launch's start (default: now); history: the control records as this start folded
        them — the recoveries so far, and the earlier launches whose wall time the goodput counts
        (ControlState.run_wall_seconds, the report's too); restarted: this launch recovers from a fault (its
        recovery record comes after its first step); last_checkpoint(): the newest committed checkpoint's
        (step, commit time), or None."""
        environ = os.environ if environ is None else environ
        self.history = history if history is not None else ControlState()
        self.cfg, self.nodes, self._clock = cfg, nodes, clock
        self.launched_at = launched_at if launched_at is not None else clock()
        self._last_checkpoint = last_checkpoint
        self.enabled = rank == 0
        self.interval = cfg.kubernetes.progress_interval_seconds
        self.path = RunDir(cfg.run_dir).trainer_status
        url = environ.get(TRAINER_SERVER_URL_ENV)
        self.sender = (StatusSender(url, environ.get(TRAINER_SERVER_TOKEN_ENV), environ.get(TRAINER_SERVER_CA_CERT_ENV))
                       if self.enabled and url else None)
        recoveries = self.history.recoveries
        self._restarts = recoveries["count"] + int(restarted)
        self._restart_seconds = recoveries["seconds"] / recoveries["timed"] if recoveries["timed"] else None
        self._step_walls: list[float] = []
        self._last_step_at: float | None = None
        self._last_sent = float("-inf")
        self.status: dict[str, Any] | None = None

    def wall_seconds(self, now: float | None = None) -> float | None:
        """The run's wall time so far: its launches' (ControlState.run_wall_seconds, as the report counts it)."""
        return self.history.run_wall_seconds(self.launched_at, self._clock() if now is None else now)

    def observe(self, step: int, metrics: dict[str, float], straggler: str = "none") -> None:
        if not self.enabled:
            return
        now = self._clock()
        if self._last_step_at is not None:
            self._step_walls = (self._step_walls + [now - self._last_step_at])[-200:]
        self._last_step_at = now
        if now - self._last_sent >= self.interval:
            self._publish(step, metrics, straggler, now, finished=False)

    def finish(self, step: int, metrics: dict[str, float] | None = None, straggler: str = "none") -> None:
        if self.enabled:
            self._publish(step, metrics or {}, straggler, self._clock(), finished=step >= self.cfg.training.num_steps)
            if self.sender is not None:
                self.sender.close()

    def _publish(self, step: int, metrics: dict[str, float], straggler: str, now: float, finished: bool) -> None:
        self._last_sent = now
        num_steps = self.cfg.training.num_steps
        step_seconds = statistics.median(self._step_walls) if self._step_walls else None
        eta = (expected_remaining_seconds(self.cfg, remaining_steps=num_steps - step, step_seconds=step_seconds,
                                          nodes=self.nodes, restart_seconds=self._restart_seconds)
               if step_seconds else None)
        last_checkpoint = self._last_checkpoint()
        wall = self.wall_seconds(now)
        self.status = trainer_status(step=step, num_steps=num_steps, eta_seconds=eta, now=now, finished=finished,
                                     metrics={
            "step": step, "total_steps": num_steps, "loss": metrics.get("loss"),
            "tokens_per_second": metrics.get("tokens_per_second"),
            "goodput": min(1.0, step * step_seconds / wall) if step_seconds and wall else None,
            "restarts": self._restarts,
            "last_checkpoint_step": last_checkpoint[0] if last_checkpoint else None,
            "last_checkpoint_age_seconds": int(now - last_checkpoint[1]) if last_checkpoint else None,
            "straggler": straggler})
        try:
            check_fence_of_this_process(self.path.parent)  # <run_dir>/trainer_status.json
            write_json(self.path, self.status)
        except OSError as err:
            log.warning("could not write %s: %s", self.path, err)
        if self.sender is not None:
            self.sender.send(self.status)


def progress_line(status: dict[str, Any]) -> str:
    """The status as one log line (the train step's log)."""
    metrics = {m["name"]: m["value"] for m in status.get("metrics", [])}
    eta = status.get("estimatedRemainingSeconds")
    checkpoint = (f"last checkpoint step {metrics['last_checkpoint_step']} "
                  f"({metrics.get('last_checkpoint_age_seconds', '?')} s ago)" if "last_checkpoint_step" in metrics
                  else "no checkpoint yet")
    return (f"progress {status['progressPercentage']}% (step {metrics.get('step', '?')}/{metrics.get('total_steps', '?')}), "
            f"ETA {'n/a' if eta is None else f'{eta} s'}, loss {metrics.get('loss', 'n/a')}, goodput "
            f"{metrics.get('goodput', 'n/a')}, restarts {metrics.get('restarts', 0)}, {checkpoint}, straggler "
            f"{metrics.get('straggler', 'none')}")
