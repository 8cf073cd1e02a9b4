"""One writer per run folder, and no trainer outlives its launcher (2 real CPU ranks under ft_launcher).

torchrun and ft_launcher start each worker with ``start_new_session=True``
(torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py), so a signal to the
launcher's process group never reaches the ranks, and DCP's writer is a ``spawn`` child of a rank
(torch/distributed/checkpoint/_async_process_executor.py) that only notices a dead parent at its next
``recv()`` — after finishing the write in flight.
"""

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from components.train.local import job_processes, run_local_training
from tests.launch import start_launcher
from trainer.checkpoint.format import committed_checkpoints, verify_checkpoint
from trainer.env import GENERATION_ENV, WARM_START_ENV
from trainer.run.events import read_events
from trainer.run.lease import RunFolderBusy, RunLease

pytestmark = pytest.mark.integration


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def metric_lines(cfg):
    path = cfg.run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def test_sigkill_of_the_launcher_leaves_no_training_process(tmp_path, token_dir, training_config):
    cfg = training_config(tmp_path, "orphans", "--training.num_steps=400", "--checkpoint.interval_steps=2",
                          "--faults.schedule=")
    proc, token = start_launcher(cfg, token_dir)
    try:
        # Training and at least one async save under way: both ranks and their DCP writers exist.
        wait_for(lambda: read_events(cfg.run_dir, "checkpoint_committed"), 120, "a committed checkpoint")
        assert len(job_processes(token)) >= 4  # 2 ranks + 2 DCP writers (+ ft_launcher's rank monitors)
        [fork_server_socket] = {p.environ()[WARM_START_ENV] for p in job_processes(token)
                                if WARM_START_ENV in p.environ()}
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer or a node agent would
        proc.wait()
        wait_for(lambda: not job_processes(token), 10, "every process of the launch to exit")
        # what the launcher would have removed: the fork server's socket and its temporary folder
        assert not Path(fork_server_socket).parent.exists()
        lines = len(metric_lines(cfg))
        time.sleep(3)
        assert len(metric_lines(cfg)) == lines  # nobody is still training into the run folder
    finally:
        for survivor in job_processes(token):
            survivor.kill()


def test_a_second_launch_on_a_live_run_folder_is_refused_and_the_first_finishes_consistent(
        tmp_path, token_dir, training_config):
    cfg = training_config(tmp_path, "twice", "--training.num_steps=120", "--checkpoint.interval_steps=10", "--faults.schedule=")
    outcome = {}
    first = threading.Thread(target=lambda: outcome.update(result=run_local_training(cfg, token_dir)))
    first.start()
    try:
        wait_for(lambda: len(metric_lines(cfg)) >= 2, 120, "the first launch to train")
        started = time.monotonic()
        with pytest.raises(RunFolderBusy, match=rf"run folder {cfg.run_dir} is in use by another training "
                                                rf"launcher \(pid {os.getpid()} on .*, generation 1\)"):
            run_local_training(cfg, token_dir)
        assert time.monotonic() - started < 30  # it waits briefly for a dying holder, then says so
    finally:
        first.join(timeout=300)
    assert outcome["result"]["steps"] == 120
    steps = [json.loads(line)["step"] for line in metric_lines(cfg)]
    assert steps == list(range(1, 121))  # one writer: every step once, in order
    assert all(verify_checkpoint(folder).ok for _, folder in committed_checkpoints(cfg.checkpoint_dir))


def test_a_superseded_trainer_stops_without_appending_or_committing(tmp_path, token_dir, training_config):
    cfg = training_config(tmp_path, "fenced", "--training.num_steps=400", "--checkpoint.interval_steps=2",
                          "--resilience.max_restarts=1", "--faults.schedule=")
    lease = RunLease(cfg.run_dir).acquire()
    try:
        proc, token = start_launcher(cfg, token_dir, **{GENERATION_ENV: str(lease.new_generation())})
        wait_for(lambda: read_events(cfg.run_dir, "checkpoint_committed"), 120, "a committed checkpoint")
        lines_before = len(metric_lines(cfg))
        lease.new_generation()  # a newer launch took the folder over (its lock holder died, say)
        taken_over = time.time()
        assert proc.wait(timeout=120) != 0
        log = (cfg.run_dir / "train.log").read_text()
        assert "LeaseLost" in log and "this trainer (generation 1) stops without writing anything more" in log
        # At most the step that was between its check and its append when the lease moved.
        assert len(metric_lines(cfg)) <= lines_before + 1
        late = [e for e in read_events(cfg.run_dir, "checkpoint_committed") if e["time"] > taken_over + 1.0]
        assert late == []
        wait_for(lambda: not job_processes(token), 10, "the fenced launch to exit")
    finally:
        lease.release()


def test_the_timeout_stops_every_process_of_the_job(tmp_path, token_dir, training_config):
    from components.train.local import RUN_DIR_ENV, TrainingError

    cfg = training_config(tmp_path, "slow", "--training.num_steps=400", "--checkpoint.interval_steps=2",
                          "--faults.schedule=", "--training.timeout_seconds=20")
    with pytest.raises(TrainingError, match="exceeded training.timeout_seconds=20; every training process was stopped"):
        run_local_training(cfg, token_dir)
    assert job_processes(str(cfg.run_dir), RUN_DIR_ENV) == []


def test_cancelling_the_train_step_stops_every_process_of_the_job(tmp_path, token_dir, training_config):
    """SIGTERM is what a KFP cancel or a deleted pod delivers to the step."""
    import sys

    from components.train.local import RUN_DIR_ENV

    cfg = training_config(tmp_path, "cancelled", "--training.num_steps=400", "--checkpoint.interval_steps=2",
                          "--faults.schedule=")
    config_path = tmp_path / "step-config.yaml"
    config_path.write_text(cfg.to_yaml())
    script = ("from pathlib import Path; from trainer.config import load_config; "
              "from components.train.local import run_local_training; "
              f"run_local_training(load_config({str(config_path)!r}), Path({str(token_dir)!r}))")
    step = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: read_events(cfg.run_dir, "checkpoint_committed"), 120, "a committed checkpoint")
        assert job_processes(str(cfg.run_dir), RUN_DIR_ENV)
        step.send_signal(signal.SIGTERM)
        output, _ = step.communicate(timeout=60)
    finally:
        step.kill()
    assert step.returncode != 0 and "JobCancelled: training cancelled by signal 15" in output
    assert job_processes(str(cfg.run_dir), RUN_DIR_ENV) == []
