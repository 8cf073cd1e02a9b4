"""The TrainJob the launcher creates, validated against the Trainer v2.3.0 CRD schema, and the launcher's
idempotent create / re-attach / state mapping against a stand-in for the Kubernetes API (the cluster
cannot exist here; every object sent is schema-checked)."""

import json
import shutil
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from components.train.trainjob import (EXIT_INFRASTRUCTURE, InfrastructureError, TrainJobFailed, TrainJobLauncher,
                                       build_trainjob, job_state, trainjob_name)
from tests.crd_schema import crd_errors
from trainer.config import load_config

EKS = "pipelines/configs/eks-prod.yaml"
PUBLISHED_8B = Path(__file__).resolve().parents[1] / "data" / "llama-3.1-8b" / "config.json"


def _staged(cfg):
    """The config with what its stage step leaves on FSx before a TrainJob is built: the base model's config.json,
    which sizes the job."""
    cfg.base_model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(PUBLISHED_8B, cfg.base_model_dir / "config.json")
    return cfg


@pytest.fixture
def cfg(tmp_path):
    return _staged(load_config(EKS, ["--run.run_id=nightly-2026-11-29", f"--data.fsx_root={tmp_path}"]))


def test_the_trainjob_validates_strictly_against_the_crd(cfg):
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    assert crd_errors(job) == []
    spec = job["spec"]
    assert spec["runtimeRef"] == {"name": "resilient-train-fsdp-nvrx"}
    assert spec["trainer"]["numNodes"] == 8 and spec["trainer"]["numProcPerNode"] == 8
    assert spec["trainer"]["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32,
                                                             "memory": "562Gi"}  # 8.03 B (its config.json): node memory
    command = spec["trainer"]["command"]
    assert command[:9] == ["python", "-m", "trainer.launcher", "--node-store=/node-memory/nightly-2026-11-29",
                           "--fork-server", f"--run-dir={cfg.run_dir}",
                           f"--store-timeout={cfg.resilience.store_timeout_seconds:g}",
                           f"--check-node={cfg.kubernetes.gpus_per_node},{cfg.kubernetes.efa_per_node}", "ft_launcher"]
    # ft_launcher's own count is out of the way of the progress rule, and NVRx >= 0.6's tracker off.
    assert "--nproc-per-node=8" in command and "--max-restarts=1000000" in command
    assert "--ft-max-no-progress-cycles=0" in command
    name = job["metadata"]["name"]  # the rendezvous pod's store, not node 0's (docs/node-loss.md)
    assert f"--rdzv-endpoint={name}-rendezvous-0-0.{name}:29400" in command and "--nnodes=8" in command
    assert command[command.index("--config") + 1] == str(cfg.run_dir / "config.yaml")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "resilient-train"
    pod = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "256Gi"}} in pod["volumes"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_the_schema_check_catches_unknown_and_mistyped_fields(cfg):
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    job["spec"]["trainer"]["numProcPerNode"] = "auto"  # a string since v2.2 is refused
    job["spec"]["trainer"]["podSpecOverrides"] = []     # removed in v2.2
    errors = crd_errors(job)
    assert any("numProcPerNode" in e for e in errors) and any("podSpecOverrides" in e for e in errors)


def test_names_are_rfc1035_labels_unique_per_run_and_attempt():
    name = trainjob_name("Run_" + "x" * 80, 2)
    assert len(name) <= 63 and name.endswith("-a2") and name[0].isalpha()
    assert trainjob_name("a", 0) != trainjob_name("b", 0) and trainjob_name("a", 0) != trainjob_name("a", 1)


class FakeCustomObjects:
    """Stands in for CustomObjectsApi: stores objects, checks each against the CRD, plays a state script."""

    def __init__(self, states=("Running", "Complete")):
        self.objects, self.creates, self.states = {}, [], list(states)

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, field_validation=None):
        assert (group, version, plural, field_validation) == ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "Strict")
        assert crd_errors(body) == [], crd_errors(body)
        name = body["metadata"]["name"]
        if name in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        self.creates.append(name)
        self.objects[name] = json.loads(json.dumps(body))

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if name not in self.objects:
            raise ApiException(status=404, reason="NotFound")
        job = self.objects[name]
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if state in ("Complete", "Failed", "Suspended"):
            job["status"] = {"conditions": [{"type": state, "status": "True", "message": f"job {state.lower()}"}]}
        return job


def finish(cfg):
    (cfg.run_dir / "result.json").parent.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "result.json").write_text(json.dumps({"steps": 10, "final_loss": 1.5}))


def test_launcher_creates_waits_and_reads_the_result(cfg):
    api = FakeCustomObjects(states=("Suspended", "Running", "Complete"))
    finish(cfg)
    sleeps = []
    result = TrainJobLauncher(cfg, api, sleep=sleeps.append).run("/fsx/datasets/v1")
    assert result["steps"] == 10 and len(api.creates) == 1
    assert sleeps == [30.0, 30.0]
    assert json.loads((cfg.run_dir / "steps" / "trainjob.json").read_text())["state"] == "Succeeded"


def test_a_retried_launcher_reattaches_instead_of_submitting_again(cfg):
    api = FakeCustomObjects(states=("Running",))
    launcher = TrainJobLauncher(cfg, api, sleep=lambda s: None)
    first = launcher.submit("/fsx/datasets/v1")
    again = TrainJobLauncher(cfg, api).submit("/fsx/datasets/v1")  # a new launcher pod, same run
    assert first == again and api.creates == [first]


def test_a_job_created_before_the_pod_died_is_adopted(cfg):
    api = FakeCustomObjects()
    name = build_trainjob(cfg, "/d")["metadata"]["name"]
    api.objects[name] = build_trainjob(cfg, "/d")  # created, but the record says only "Submitting"
    (cfg.run_dir / "steps").mkdir(parents=True)
    (cfg.run_dir / "steps" / "trainjob.json").write_text(json.dumps({"name": "lost", "attempt": 0, "state": "Submitting"}))
    assert TrainJobLauncher(cfg, api).submit("/d") == name and api.creates == []


def test_a_failed_job_is_reported_again_by_a_retried_launcher_never_resubmitted(cfg):
    """KFP's retries cannot filter by exit code: the launcher itself refuses to spend GPUs on a job that
    JobSet and ft_launcher already gave up on."""
    api = FakeCustomObjects(states=("Failed",))
    launcher = TrainJobLauncher(cfg, api, sleep=lambda s: None)
    with pytest.raises(TrainJobFailed, match="failed: job failed") as failure:
        launcher.run("/d")
    assert failure.value.exit_code == 1
    api.states = ["Complete"]
    finish(cfg)
    with pytest.raises(TrainJobFailed, match="already failed in this run .*not resubmitted"):
        TrainJobLauncher(cfg, api, sleep=lambda s: None).run("/d")  # KFP's retry of the step
    assert len(api.creates) == 1


def test_a_cancelled_step_deletes_its_trainjob_and_so_does_the_exit_handler(cfg):
    from components.train.local import JobCancelled
    from components.train.trainjob import delete_unfinished_trainjob

    class Cancelling(FakeCustomObjects):
        deleted = []

        def get_namespaced_custom_object(self, *args):
            super().get_namespaced_custom_object(*args)
            raise JobCancelled("SIGTERM")  # KFP cancelled the run while the launcher was waiting

        def delete_namespaced_custom_object(self, group, version, namespace, plural, name, propagation_policy=None):
            assert propagation_policy == "Foreground"  # the JobSet and its pods go with it
            self.deleted.append(name)

    api = Cancelling(states=("Running",))
    with pytest.raises(JobCancelled):
        TrainJobLauncher(cfg, api, sleep=lambda s: None).run("/d")
    assert api.deleted == api.creates and json.loads((cfg.run_dir / "steps" / "trainjob.json").read_text())[
        "state"] == "Deleted"

    # The launcher pod died hard instead (no SIGTERM handler ran): the exit handler finds the job running.
    api = Cancelling(states=("Running",))
    launcher = TrainJobLauncher(cfg, api)
    (cfg.run_dir / "steps" / "trainjob.json").unlink()
    name = launcher.submit("/d")
    assert delete_unfinished_trainjob(cfg, api) == name and api.deleted[-1] == name
    assert delete_unfinished_trainjob(cfg, api) is None  # already deleted: nothing to do


def test_each_new_job_runs_under_a_new_lease_generation_and_a_reattach_keeps_it(cfg):
    from trainer.env import GENERATION_ENV
    from trainer.run.lease import RunLease, read_lease

    api = FakeCustomObjects(states=("Running",))
    with RunLease(cfg.run_dir) as lease:
        name = TrainJobLauncher(cfg, api).submit("/d", lease)
        again = TrainJobLauncher(cfg, api).submit("/d", lease)
    assert name == again and read_lease(cfg.run_dir)["generation"] == 1
    env = {e["name"]: e["value"] for e in api.objects[name]["spec"]["trainer"]["env"]}
    assert env[GENERATION_ENV] == "1"


def test_goodput_on_the_cluster_comes_from_the_run_folder(cfg):
    """The same computation as on one machine (components.train.report, from the launch the launcher
    returns), not 0.0."""
    from components.train.report import training_report
    from trainer.run.events import EventLog

    api = FakeCustomObjects(states=("Complete",))
    launcher = TrainJobLauncher(cfg, api, sleep=lambda s: None)
    submitted = launcher.submit("/d") and json.loads((cfg.run_dir / "steps" / "trainjob.json").read_text())["submitted_at"]
    EventLog(cfg.run_dir, 0).write("recovery", mechanism="ft_launcher", lost_steps=3, recovery_seconds=20.0)
    with (cfg.run_dir / "metrics.jsonl").open("w") as metrics:
        for step in range(1, 11):
            metrics.write(json.dumps({"step": step, "loss": 1.0, "step_seconds": 6.0,
                                      "time": submitted + 30.0 + 6.0 * step}) + "\n")
    (cfg.run_dir / "result.json").write_text(json.dumps({"steps": 10, "final_loss": 1.5,
                                                         "finished_at": submitted + 100.0}))
    outcome = launcher.run("/d")
    assert outcome["launched_at"] == submitted
    result = training_report(cfg.run_dir, outcome["launched_at"])
    assert result["goodput"] == pytest.approx(60.0 / 100.0)
    assert result["recovery_totals"] == {"recoveries": 1, "lost_steps": 3, "recovery_seconds_total": 20.0,
                                         "recoveries_ft_launcher": 1}


def test_infrastructure_errors_are_distinct(cfg):
    class Forbidden(FakeCustomObjects):
        def create_namespaced_custom_object(self, *args, **kwargs):
            raise ApiException(status=403, reason="Forbidden")

    with pytest.raises(InfrastructureError, match="not allowed to create TrainJobs in resilient-train") as error:
        TrainJobLauncher(cfg, Forbidden()).submit("/d")
    assert error.value.exit_code == EXIT_INFRASTRUCTURE

    clock = iter(range(0, 10**9, 10**6))
    api = FakeCustomObjects(states=("Running",))
    with pytest.raises(InfrastructureError, match=r"still Running after 259200 s \(training.timeout_seconds\)"):
        TrainJobLauncher(cfg, api, sleep=lambda s: None, clock=lambda: next(clock)).run("/d")


def test_job_state_mapping():
    assert job_state({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}) == "Succeeded"
    assert job_state({"status": {"conditions": [{"type": "Failed", "status": "True"}]}}) == "Failed"
    assert job_state({"spec": {"suspend": True}}) == "Suspended"
    assert job_state({"status": {"conditions": [{"type": "Complete", "status": "False"}]}}) == "Running"


def test_a_job_in_replica_groups_gets_its_lighthouse_and_each_node_its_group(tmp_path):
    """R >= 2: every node knows the lighthouse (the runtime's `lighthouse` pod, through the JobSet's headless
    Service) and splits its index into a group (--replica-groups); the lighthouse pod gets its arguments from the
    config through a runtime patch (a container's env may be patched on any replicated job but the trainer's)."""
    cfg = _staged(load_config(EKS, ["--run.run_id=groups", f"--data.fsx_root={tmp_path}",
                                    "--training.replica_groups=2", "--resilience.lighthouse_join_timeout_seconds=10"]))
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    assert crd_errors(job) == []
    name = job["metadata"]["name"]
    env = {e["name"]: e["value"] for e in job["spec"]["trainer"]["env"]}
    assert env["TORCHFT_LIGHTHOUSE"] == f"http://{name}-lighthouse-0-0.{name}:29510"
    assert "--replica-groups=2" in job["spec"]["trainer"]["command"]
    jobs = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    [lighthouse] = [j for j in jobs if j["name"] == "lighthouse"]
    [container] = lighthouse["template"]["spec"]["template"]["spec"]["containers"]
    args = json.loads({e["name"]: e["value"] for e in container["env"]}["RESILIENT_TRAIN_LIGHTHOUSE_ARGS"])
    assert args[args.index("--join_timeout_ms") + 1] == "10000" and args[args.index("--bind") + 1] == "[::]:29510"
    assert args[args.index("--min_replicas") + 1] == "1"
    # one group: no lighthouse arguments (its pod exits at once) and no group option
    single = build_trainjob(_staged(load_config(EKS, ["--run.run_id=one", f"--data.fsx_root={tmp_path}"])),
                            "/fsx/datasets/v1")
    assert not any(j["name"] == "lighthouse" for j in
                   single["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"])
    assert not any(a.startswith("--replica-groups") for a in single["spec"]["trainer"]["command"])
