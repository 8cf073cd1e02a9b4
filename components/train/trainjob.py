"""The train step on EKS: create a Kubeflow Trainer v2 TrainJob, follow it, map its end to the step's result.

    job = build_trainjob(cfg, data_dir)                  # the object, validated offline against the CRD
    result = TrainJobLauncher(cfg, api).run(data_dir)    # create or re-attach, stream logs, wait

Idempotent: the job's name is derived from the pipeline run and the attempt recorded in
``<run_dir>/steps/trainjob.json`` *before* the job is created, so a retried launcher pod finds the record,
re-attaches to the job it already submitted and never submits a second one. A job that already exists
under that name (the record was written, the pod died before the create returned) is adopted as well.
KFP's retries cannot tell exit codes apart, so a job recorded as Failed (JobSet and ft_launcher already
spent their restarts on it) is reported again, never resubmitted: a new pipeline run trains anew.

The launcher holds the run folder's lease while it follows the job, and each new job runs under a new
lease generation (RESILIENT_TRAIN_LEASE_GENERATION), so pods of an older job can never write again. A
cancelled step (SIGTERM: a KFP cancel, a deleted pod) deletes its TrainJob before it exits, and the exit
handler deletes one that is still running when the pipeline did not succeed: nothing keeps holding GPUs.

Exit codes of the launcher component: 0 when training succeeded, 1 when the TrainJob failed (a training
error: the logs say why), 3 for infrastructure errors (API unreachable, forbidden, the job vanished, the
wait timed out) — distinct so a pipeline retry policy or an operator can tell them apart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Callable

from kubernetes.client.exceptions import ApiException

from components.train.local import JobCancelled, cancel_on_sigterm
from trainer.config import Config
from trainer.env import BUDGET_SINCE_ENV, GENERATION_ENV, LAUNCHER_ENV, LIGHTHOUSE_ENV, RENDEZVOUS_NODES_ENV
from trainer.launch.command import (RENDEZVOUS_JOB, initial_heartbeat_timeout, node_memory_gib, sizing_summary,
                                    trainer_command)
from trainer.launch.lighthouse import (LIGHTHOUSE_ARGS_ENV, LIGHTHOUSE_JOB, LIGHTHOUSE_PORT, lighthouse_address_of,
                                       lighthouse_command)
from trainer.resilience.budget import read_gave_up
from trainer.run.history import record_train_launch, record_train_launch_ended
from trainer.run.lease import RunLease
from trainer.run.run_dir import RunDir, read_json, write_json

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
PATCH_MANAGER = "resilient-train.io/launcher"
CONTAINER = "node"  # the replicated job and container name of the torch runtime
EXIT_TRAINING_FAILED = 1
EXIT_INFRASTRUCTURE = 3


class InfrastructureError(RuntimeError):
    """The cluster, not the training, failed: API errors, missing job, timeouts. Exit code 3."""

    exit_code = EXIT_INFRASTRUCTURE


class TrainJobFailed(RuntimeError):
    """The TrainJob reached Failed. Exit code 1."""

    exit_code = EXIT_TRAINING_FAILED


def trainjob_name(run_id: str, attempt: int) -> str:
    """An RFC 1035 label (<= 63 chars) unique per pipeline run and launcher attempt."""
    base = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-") or "run"
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
    name = f"rt-{base[:40]}-{digest}-a{attempt}"
    return re.sub(r"^-+|-+$", "", name)


def node_command(cfg: Config, data_dir: str, job_name: str) -> list[str]:
    """What each node runs: the launcher (trainer.launch.command, as on one machine) over the shared config."""
    return [*trainer_command(cfg, RunDir(cfg.run_dir).config, data_dir, job_name=job_name, python="python"),
            f"--training.prometheus_port={cfg.kubernetes.prometheus_port}"]


def build_trainjob(cfg: Config, data_dir: str, attempt: int = 0, generation: int = 1,
                   budget_since: float = 0.0) -> dict[str, Any]:
    k = cfg.kubernetes
    resources: dict[str, Any] = {}
    if k.gpus_per_node:
        resources["nvidia.com/gpu"] = k.gpus_per_node
    if k.efa_per_node:
        resources["vpc.amazonaws.com/efa"] = k.efa_per_node
    memory_tier = cfg.checkpoint.enabled and cfg.checkpoint.memory_tier
    node_memory = node_memory_gib(cfg, Path(data_dir)) if memory_tier else 0
    # Memory-backed volumes count against the pod's memory limit: it covers them and the processes.
    resources["memory"] = f"{k.process_memory_gib + int(k.shm_size.removesuffix('Gi')) + node_memory}Gi"
    labels = {"app.kubernetes.io/part-of": "resilient-train", "resilient-train.io/run-id": _label(cfg.run.run_id)}
    if k.queue_name:
        labels["kueue.x-k8s.io/queue-name"] = k.queue_name
    volumes = [{"name": "fsx", "persistentVolumeClaim": {"claimName": k.fsx_pvc}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}}]
    mounts = [{"name": "fsx", "mountPath": str(cfg.fsx_root)}, {"name": "dshm", "mountPath": "/dev/shm"}]
    if memory_tier:  # the node-memory tier: outlives the workers ft_launcher restarts, dies with the pod
        volumes.append({"name": "node-memory", "emptyDir": {"medium": "Memory", "sizeLimit": f"{node_memory}Gi"}})
        mounts.append({"name": "node-memory", "mountPath": cfg.checkpoint.memory_dir})
    pod_spec: dict[str, Any] = {"serviceAccountName": k.service_account, "volumes": volumes,
                                "containers": [{"name": CONTAINER, "volumeMounts": mounts}]}
    if k.node_selector_map:
        pod_spec["nodeSelector"] = k.node_selector_map
    if k.toleration_list:
        pod_spec["tolerations"] = k.toleration_list
    name = trainjob_name(cfg.run.run_id, attempt)
    env = [{"name": LAUNCHER_ENV, "value": cfg.resilience.launcher},
           {"name": GENERATION_ENV, "value": str(generation)},
           # The restart budget counts this job's attempts (its gang restarts included), not an
           # earlier job's of the same run folder.
           {"name": BUDGET_SINCE_ENV, "value": repr(budget_since)},
           {"name": "NCCL_SOCKET_IFNAME", "value": "^lo"},
           {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"}]
    lighthouse: dict[str, Any] = {}  # the runtime's lighthouse pod: its arguments, or none (one group: it exits)
    if cfg.training.replica_groups > 1:
        env.append({"name": LIGHTHOUSE_ENV, "value": lighthouse_address_of(name)})
        args = lighthouse_command(cfg, f"[::]:{LIGHTHOUSE_PORT}", binary="torchft_lighthouse")[1:]
        lighthouse = {"name": LIGHTHOUSE_JOB, "template": {"spec": {"template": {"spec": {"containers": [
            {"name": LIGHTHOUSE_JOB, "env": [{"name": LIGHTHOUSE_ARGS_ENV, "value": json.dumps(args)}]}]}}}}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": k.namespace, "labels": labels,
                     "annotations": {"resilient-train.io/config-hash": cfg.config_hash()}},
        "spec": {
            "runtimeRef": {"name": k.runtime_name},
            "activeDeadlineSeconds": cfg.training.timeout_seconds,
            "trainer": {
                "image": k.image,
                "command": node_command(cfg, data_dir, name),
                "numNodes": cfg.training.num_nodes,
                "numProcPerNode": cfg.training.nproc_per_node,
                "resourcesPerNode": {"limits": dict(resources), "requests": dict(resources)} if resources else {},
                "env": env,
            },
            "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": CONTAINER, "template": {"spec": {"template": {"spec": pod_spec}}}},
                                   # the rendezvous store exits once every node reported that it finished
                                   {"name": RENDEZVOUS_JOB, "template": {"spec": {"template": {"spec": {"containers": [
                                       {"name": RENDEZVOUS_JOB, "env": [{"name": RENDEZVOUS_NODES_ENV,
                                                                         "value": str(cfg.training.num_nodes)}]}]}}}}},
                                   *([lighthouse] if lighthouse else [])]}}}}],
        },
    }


def _label(value: str) -> str:
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", value)[:63].strip("-._")
    return value or "none"


def job_state(job: dict[str, Any]) -> str:
    """Succeeded, Failed, Suspended (e.g. waiting for Kueue) or Running, from the TrainJob's conditions."""
    conditions = {c["type"]: c for c in job.get("status", {}).get("conditions", []) if c.get("status") == "True"}
    if "Complete" in conditions:
        return "Succeeded"
    if "Failed" in conditions:
        return "Failed"
    if "Suspended" in conditions or job.get("spec", {}).get("suspend"):
        return "Suspended"
    return "Running"


class TrainJobLauncher:
    """Create (or re-attach to) the run's TrainJob and wait for it. `api` is a kubernetes CustomObjectsApi;
    `core` a CoreV1Api for the logs (optional)."""

    def __init__(self, cfg: Config, api, core=None, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg, self.api, self.core = cfg, api, core
        self.sleep, self.clock = sleep, clock
        self.run_dir = RunDir(cfg.run_dir)
        self.record_path = self.run_dir.trainjob
        self._log_since: int | None = None  # first read: the whole log; then the last poll interval

    def _record(self) -> dict[str, Any] | None:
        return read_json(self.record_path)

    def _write_record(self, record: dict[str, Any]) -> None:
        write_json(self.record_path, record)

    def submit(self, data_dir: str, lease: RunLease | None = None) -> str:
        """The job's name: the recorded one (re-attach), or a new job created after recording its name.
        A recorded failure is reported again (TrainJobFailed), never resubmitted."""
        namespace = self.cfg.kubernetes.namespace
        record = self._record()
        if record and record.get("state") == "Failed":
            raise TrainJobFailed(f"TrainJob {namespace}/{record['name']} already failed in this run "
                                 f"({record.get('message') or 'see its logs'}); not resubmitted: fix the cause and start "
                                 "a new pipeline run")
        if record:
            try:
                self.api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, record["name"])
                log.info("re-attaching to TrainJob %s/%s", namespace, record["name"])
                return record["name"]
            except ApiException as err:
                if err.status != 404:
                    raise InfrastructureError(f"reading TrainJob {namespace}/{record['name']}: {err.reason}") from err
        attempt = (record or {}).get("attempt", 0)
        generation = lease.new_generation() if lease is not None else 1
        submitted_at = time.time()
        job = build_trainjob(self.cfg, data_dir, attempt, generation, budget_since=submitted_at)
        name = job["metadata"]["name"]
        timeout, why = initial_heartbeat_timeout(self.cfg, Path(data_dir))
        log.info("initial heartbeat timeout %.0f s: %s", timeout, why)
        log.info("%s", sizing_summary(self.cfg, Path(data_dir)))
        self._write_record({"name": name, "namespace": namespace, "attempt": attempt, "state": "Submitting",
                            "generation": generation, "submitted_at": submitted_at})
        try:
            self.api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job, field_validation="Strict")
            log.info("created TrainJob %s/%s (%d nodes x %d processes)", namespace, name, self.cfg.training.num_nodes,
                     self.cfg.training.nproc_per_node)
        except ApiException as err:
            if err.status == 409:  # created by an earlier attempt of this pod: adopt it
                log.info("TrainJob %s/%s already exists: re-attaching", namespace, name)
            elif err.status in (401, 403):
                raise InfrastructureError(f"not allowed to create TrainJobs in {namespace} ({err.reason}): check the "
                                          "pipeline ServiceAccount's Role (manifests/base/rbac)") from err
            elif err.status == 422 or err.status == 400:
                raise InfrastructureError(f"the cluster rejected TrainJob {name}: {err.body}") from err
            else:
                raise InfrastructureError(f"creating TrainJob {namespace}/{name}: {err.status} {err.reason}") from err
        return name

    def wait(self, name: str) -> dict[str, Any]:
        namespace = self.cfg.kubernetes.namespace
        deadline = self.clock() + self.cfg.training.timeout_seconds
        state = None
        while True:
            try:
                job = self.api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            except ApiException as err:
                if err.status == 404:
                    raise InfrastructureError(f"TrainJob {namespace}/{name} disappeared while running") from err
                raise InfrastructureError(f"reading TrainJob {namespace}/{name}: {err.status} {err.reason}") from err
            new_state = job_state(job)
            if new_state != state:
                log.info("TrainJob %s/%s: %s", namespace, name, new_state)
                state = new_state
                self._write_record({**(self._record() or {}), "name": name, "state": state,
                                    "message": _failure_message(job)})
            self._stream_logs(name)
            if state in ("Succeeded", "Failed"):
                return job
            if self.clock() >= deadline:
                raise InfrastructureError(f"TrainJob {namespace}/{name} still {state} after "
                                          f"{self.cfg.training.timeout_seconds} s (training.timeout_seconds); it "
                                          "keeps running: delete it or re-run the step to wait again")
            self.sleep(self.cfg.kubernetes.launcher_poll_seconds)

    def _stream_logs(self, name: str) -> None:
        """Print new log lines of the job's first pod (node 0, which logs progress)."""
        if self.core is None:
            return
        namespace = self.cfg.kubernetes.namespace
        try:
            pods = self.core.list_namespaced_pod(namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}")
            items = sorted(pods.items, key=lambda p: p.metadata.name)
            if not items:
                return
            text = self.core.read_namespaced_pod_log(items[0].metadata.name, namespace, container=CONTAINER,
                                                     since_seconds=self._log_since, timestamps=False)
            self._log_since = max(1, int(self.cfg.kubernetes.launcher_poll_seconds))
            for line in (text or "").splitlines():
                log.info("[%s] %s", items[0].metadata.name, line)
        except ApiException as err:  # logs are a convenience; the job's state decides
            log.debug("logs of %s unavailable: %s", name, err.reason)

    def delete(self, name: str, why: str) -> None:
        """Delete the TrainJob (its JobSet and pods go with it: foreground propagation) so it frees its GPUs."""
        namespace = self.cfg.kubernetes.namespace
        try:
            self.api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                     propagation_policy="Foreground")
            log.warning("deleted TrainJob %s/%s: %s", namespace, name, why)
        except ApiException as err:
            if err.status != 404:
                raise InfrastructureError(f"deleting TrainJob {namespace}/{name}: {err.status} {err.reason}") from err
        self._write_record({**(self._record() or {}), "name": name, "state": "Deleted", "message": why})

    def run(self, data_dir: str) -> dict[str, Any]:
        """Submit or re-attach, wait, and return the trainer's result.json from the shared file system, with
        `launched_at` (the submission: the launch's start, recorded with the run, and its end: trainer.run.history)."""
        with RunLease(self.cfg.run_dir) as lease, cancel_on_sigterm():
            name = self.submit(data_dir, lease)
            launched_at = (self._record() or {}).get("submitted_at")
            record_train_launch(self.cfg.run_dir, launched_at)
            outcome = "failed"
            try:
                job = self.wait(name)
                outcome = job_state(job).lower()
            except (JobCancelled, KeyboardInterrupt):
                outcome = "cancelled"
                self.delete(name, "the pipeline step was cancelled")
                raise
            finally:
                record_train_launch_ended(self.cfg.run_dir, launched_at, outcome)
        if job_state(job) == "Failed":
            gave_up = read_gave_up(self.cfg.run_dir)
            why = gave_up["message"] if gave_up and gave_up.get("time", 0) >= (self._record() or {}).get(
                "submitted_at", 0) else _failure_message(job)
            raise TrainJobFailed(f"TrainJob {self.cfg.kubernetes.namespace}/{name} failed: {why} "
                                 f"(logs: kubectl logs -n {self.cfg.kubernetes.namespace} "
                                 f"-l jobset.sigs.k8s.io/jobset-name={name})")
        result = read_json(self.run_dir.result)
        if result is None:
            raise InfrastructureError(f"TrainJob {name} succeeded but {self.run_dir.result} is missing: is "
                                      f"{self.cfg.kubernetes.fsx_pvc} mounted at {self.cfg.fsx_root} in both the "
                                      "pipeline and the training pods?")
        return {**result, "launched_at": launched_at, "trainjob": name}


def _failure_message(job: dict[str, Any]) -> str:
    return next((c.get("message", "") for c in job.get("status", {}).get("conditions", [])
                 if c.get("type") == "Failed" and c.get("status") == "True"), "")


def delete_unfinished_trainjob(cfg: Config, api) -> str | None:
    """The exit handler's clean-up after a failed or cancelled run: delete the run's TrainJob if it is still
    running (or queued). Returns the deleted job's name."""
    launcher = TrainJobLauncher(cfg, api)
    record = launcher._record()
    if not record or record.get("state") in ("Succeeded", "Failed", "Deleted"):
        return None
    launcher.delete(record["name"], "the pipeline run ended without succeeding")
    return record["name"]
