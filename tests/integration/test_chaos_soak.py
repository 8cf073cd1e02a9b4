"""The chaos soak: the whole pipeline through the CLI, 30 faults of every loop and save type on a seeded schedule
spread over 250 steps on 2 ranks (one every ~8 steps: a checkpoint interval and more apart), a hang in each start-up
phase, and the MLflow tracking server killed and restarted while it trains.

What a month-long job needs, in one run: every fault that training recovers from leaves the budget untouched
(trainer.resilience.budget); every loss is bit-identical to a clean run's; every fault has a record; MLflow shows
the training while it runs, and after the outage holds exactly one point per metrics.jsonl line with nothing pending
or refused; no process outlives the run."""

import contextlib
import json
import os
import random
import subprocess
import sys
import time

import psutil
import pytest

from components.train.local import RUN_DIR_ENV, job_processes, run_local_training
from trainer.config import load_config
from trainer.config.drills import (FAULT_TYPES, NETWORK_FAULTS, NUMERIC_FAULTS, RANK_0_SAVE_POINTS, SAVE_FAULTS,
                                   STARTUP_HANGS, STARTUP_PHASES)
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir, read_jsonl

pytestmark = pytest.mark.integration

NUM_STEPS = 250
# The micro model: what is checked here is the recoveries and the records, and 500 steps of tiny's (the soak's and its
# clean run's) cost ~50 s more.
TRAINING = [f"--training.num_steps={NUM_STEPS}", "--model.preset=micro", "--training.batch_size=4",
            "--training.seq_len=32", "--training.warmup_steps=5", "--training.log_every=50",
            "--checkpoint.interval_steps=5",
            "--local.demo_documents=200", "--eval.max_batches=4", "--eval.max_new_tokens=4",
            "--resilience.heartbeat_timeout=8",
            "--resilience.initial_heartbeat_timeout=90", "--faults.slow_seconds=1",
            # A start-up hang ends at its phase's timeout: short ones (test_fail_slow ends them at 6 s), still
            # far above a normal phase here.
            "--resilience.startup_timeouts=" + ",".join(f"{phase}=8" for phase in STARTUP_PHASES)]
# group_loss needs replica groups: the soak with R = 2 below; the network drills, nodes in namespaces
# (test_network_faults); the numeric drills change what is trained (a skipped window): test_numeric_faults; a
# bug stops the run by design (test_restart_budget)
NOT_SOAKED = {"group_loss", "bug", *NETWORK_FAULTS, *NUMERIC_FAULTS}
LOOP_AND_SAVE = tuple(kind for kind in FAULT_TYPES if kind not in STARTUP_HANGS and kind not in NOT_SOAKED)


def seeded_schedule(seed: int = 2026, count: int = 30) -> str:
    """count faults of the loop and save types, every one at least twice, one every ~8 steps (a little
    jitter), ranks drawn; the drills only rank 0 can fire (commit sub-steps) on rank 0. Then a hang in each
    start-up phase, spread over the run (the last with restarting faults after it): each fires in the first
    start after its step (a restart that one of the faults before it causes)."""
    rng = random.Random(seed)
    kinds = [*LOOP_AND_SAVE, *LOOP_AND_SAVE][:count]
    kinds += rng.sample(LOOP_AND_SAVE, count - len(kinds))
    rng.shuffle(kinds)
    items = []
    for index, kind in enumerate(kinds):
        step = 8 + index * (NUM_STEPS - 20) // count + rng.randrange(4)
        rank = 0 if SAVE_FAULTS.get(kind) in RANK_0_SAVE_POINTS else rng.randrange(2)
        items.append(f"{kind}@{step}:rank={rank}")
    for index, kind in enumerate(STARTUP_HANGS):
        items.append(f"{kind}@{NUM_STEPS // 10 + index * (NUM_STEPS * 7 // 40)}:rank={rng.randrange(2)}")
    return ", ".join(items)


def _train_run(client, experiment: str, run_id: str):
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                               filter_string=f"tags.pipeline_run_id = '{run_id}' and tags.pipeline_step = 'train'")
    return found[0] if found else None


def test_thirty_faults_of_every_type_and_an_mlflow_outage(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipelines.local_stack import MlflowServer

    schedule = seeded_schedule()
    assert {item.split("@")[0] for item in schedule.split(", ")} == set(FAULT_TYPES) - NOT_SOAKED
    work = tmp_path / "work"
    work.mkdir()
    server = MlflowServer(tmp_path / "mlflow").start()
    pipeline = None
    try:
        command = [sys.executable, "-m", "pipelines", "run", "--config", "local", f"--run.work_dir={work}",
                   "--run.run_id=soak", *TRAINING, f"--faults.schedule={schedule}",
                   f"--checkpoint.memory_dir={tmp_path}/node-memory",
                   f"--mlflow.tracking_uri={server.tracking_uri}", "--mlflow.forward_interval_seconds=3",
                   "--eval.export_uri=s3://resilient-train-data/exports"]  # the run's loopback S3
        log_path = tmp_path / "pipeline.out"
        with log_path.open("w") as out:
            pipeline = subprocess.Popen(command, cwd=work, stdout=out, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        # While it trains: the train run already has loss points and a recovery.
        client = MlflowClient(server.tracking_uri)
        deadline, live = time.monotonic() + 400, None
        while time.monotonic() < deadline and pipeline.poll() is None:
            run = client.get_experiment_by_name("resilient-train-local") and _train_run(
                client, "resilient-train-local", "soak")
            if run is not None and run.data.metrics.get("recoveries", 0) >= 1 and "loss" in run.data.metrics:
                live = {"loss_points": len(client.get_metric_history(run.info.run_id, "loss")),
                        "recoveries": run.data.metrics["recoveries"], "status": run.info.status}
                break
            time.sleep(2)
        assert live is not None, "MLflow never showed the training while it ran: " + log_path.read_text()[-3000:]
        assert live["status"] == "RUNNING" and live["loss_points"] > 0

        server.stop()  # an outage in mid-training: the spool keeps everything
        time.sleep(25)
        assert pipeline.poll() is None, "training should outlive the tracking server"
        server.start()
        returncode = pipeline.wait(timeout=1500)
        output = log_path.read_text()
        assert returncode == 0, output[-5000:]

        run_dir = work / "fsx" / "runs" / "soak"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "succeeded" and summary["steps_trained"] == NUM_STEPS
        assert summary["mlflow_pending_records"] == 0 and summary["mlflow_rejected_records"] == 0
        assert job_processes(str(run_dir), RUN_DIR_ENV) == []  # nothing of the job outlives it

        # Every fault fired once and left a record: a recovery naming it, or why none was needed.
        faults = read_events(run_dir, "fault")
        assert sorted(f["key"] for f in faults) == sorted(schedule.split(", "))
        recorded = {k for r in read_events(run_dir, "recovery") for k in r["fault_keys"]}
        recorded |= {e["fault_key"] for e in read_events(run_dir) if e["event"] in ("fault_absorbed", "checkpoint_failed")}
        assert [f["key"] for f in faults if f["key"] not in recorded] == []
        assert read_events(run_dir, "gave_up") == []

        # MLflow after the outage: one loss point per step, its first record's (a step replayed after a fault adds
        # no second point), each with its value and time.
        lines = read_jsonl(run_dir / "metrics.jsonl")
        first = {}
        for record in lines:
            first.setdefault(record["step"], record)
        assert len(first) == NUM_STEPS < len(lines)  # steps were replayed
        train = _train_run(client, "resilient-train-local", "soak")
        assert train.info.status == "FINISHED"
        history = client.get_metric_history(train.info.run_id, "loss")
        assert sorted((m.step, m.timestamp, m.value) for m in history) == \
            sorted((r["step"], int(r["time"] * 1000), r["loss"]) for r in first.values())
        assert train.data.metrics["recoveries"] == len(read_events(run_dir, "recovery"))

        # A clean run of the same training on the same staged data: every loss bit-identical, replays included.
        data_dir = work / "fsx" / "datasets" / "demo"
        clean = load_config("local", [f"--run.work_dir={tmp_path / 'clean'}", "--run.run_id=clean", *TRAINING,
                                      "--faults.schedule=", f"--checkpoint.memory_dir={tmp_path}/clean-memory"])
        run_local_training(clean, data_dir)
        clean_losses = {r["step"]: r["loss"] for r in read_jsonl(clean.run_dir / "metrics.jsonl")}
        assert all(r["loss"] == clean_losses[r["step"]] for r in lines)
        assert summary["final_train_loss"] == clean_losses[NUM_STEPS]
        # The clean run's ranks evaluated its final checkpoint on the same windows: the same number, bit for bit.
        heldout = json.loads(RunDir(clean.run_dir).evaluation(NUM_STEPS).read_text())["candidate"]["heldout_loss"]
        assert summary["heldout_loss"] == heldout
    finally:
        if pipeline is not None and pipeline.poll() is None:  # a failed assertion must not leave it training
            # Its descendants first (the KFP task, the train step that would relaunch a killed job), then it.
            descendants = psutil.Process(pipeline.pid).children(recursive=True)
            for proc in [*descendants, psutil.Process(pipeline.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            pipeline.wait()
            for proc in job_processes(str(work / "fsx" / "runs" / "soak"), RUN_DIR_ENV):
                proc.kill()
        server.stop()


GROUP_STEPS = 100
# What a group survives by restarting itself (the writer group's commit drill on its rank 0, global rank 0), and
# each group lost whole; one every ~7 steps over both groups' ranks (2 groups x 2 ranks), the last early enough for
# its group to come back before the others finish. (A hang waits for the heartbeat timeout, 30 s here: by then
# the other group, alone on 2 cores, has finished; the hang is the one-group soak's.)
GROUP_FAULTS = ["sigkill@8:rank=3", "exception@14:rank=0", "group_loss@20:group=0", "exit@30:rank=2",
                "node_loss@38:rank=1", "corrupt_memory@46:rank=2", "group_loss@52:group=1",
                "kill_before_rename@58:rank=0", "exit@66:rank=1", "sigkill@74:rank=0"]


def test_the_soak_in_two_replica_groups(tmp_path, token_dir, training_config):
    """R = 2: ten faults of the kinds a group recovers from by itself, in both groups, the writer group's commit
    drill and each group lost whole in turn, plus the lighthouse killed once. Every fault leaves a record (a recovery
    naming it); the groups agree on every step both trained; every step is trained; nothing outlives the run."""
    schedule = ",".join(GROUP_FAULTS)
    cfg = training_config(tmp_path, "groups-soak", f"--training.num_steps={GROUP_STEPS}", "--training.num_nodes=2",
                          "--training.replica_groups=2", "--checkpoint.interval_steps=5",
                          "--resilience.heartbeat_timeout=30", "--resilience.quorum_timeout_seconds=15",
                          "--resilience.initial_heartbeat_timeout=90", "--resilience.replica_check_interval=1",
                          "--resilience.lighthouse_heartbeat_timeout_seconds=1",
                          "--local.node_replacement_delay_seconds=1", f"--faults.schedule={schedule}",
                          # 4 processes on 2 cores: per-rank CPU times are not comparable (test_replica_groups)
                          "--resilience.straggler_interval=0")
    killed = []

    def kill_the_lighthouse_once():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            steps = [r["step"] for r in read_jsonl(cfg.run_dir / "metrics.jsonl")] if \
                (cfg.run_dir / "metrics.jsonl").is_file() else []
            if steps and max(steps) >= 28:
                for proc in psutil.process_iter(["cmdline"]):
                    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                        if "torchft_lighthouse" in " ".join(proc.info["cmdline"] or []) and \
                                proc.environ().get(RUN_DIR_ENV) == str(cfg.run_dir):
                            proc.kill()
                            killed.append(proc.pid)
            time.sleep(0.1)

    import threading

    killer = threading.Thread(target=kill_the_lighthouse_once, daemon=True)
    killer.start()
    result = run_local_training(cfg, token_dir)
    killer.join(timeout=5)

    assert result["steps"] == GROUP_STEPS and killed
    lines = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert {r["step"] for r in lines} == set(range(1, GROUP_STEPS + 1))
    both = [r for r in lines if r["participants"] == 2]
    assert both and all(r.get("replicas_equal") is True for r in both)
    assert read_events(cfg.run_dir, "replica_divergence") == []
    faults = read_events(cfg.run_dir, "fault")
    assert sorted(f["key"] for f in faults) == sorted(GROUP_FAULTS)
    recorded = {k for r in read_events(cfg.run_dir, "recovery") for k in r["fault_keys"]}
    assert [f["key"] for f in faults if f["key"] not in recorded] == []
    assert read_events(cfg.run_dir, "gave_up") == []
    assert {r["mechanism"] for r in read_events(cfg.run_dir, "recovery")} >= {"replica_group_heal"}
    assert "the lighthouse exited" in (cfg.run_dir / "train.log").read_text()
    assert job_processes(str(cfg.run_dir), RUN_DIR_ENV) == []
