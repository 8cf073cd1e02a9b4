"""kill -9 at random points while asynchronous checkpoints are being written, then resume."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from components.train import read_metrics, run_local_training, launch_command
from trainer.checkpoint import committed_checkpoints, latest_valid_checkpoint, verify_checkpoint

pytestmark = pytest.mark.integration

STEPS = ["--training.num_steps=16", "--checkpoint.interval_steps=2", "--checkpoint.keep_last=3"]


def _start(cfg, token_dir):
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    config_path = cfg.run_dir / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    log = (cfg.run_dir / "train.log").open("a")
    # A new session: killpg reaches torchrun, both ranks and their checkpoint daemon processes at once.
    return subprocess.Popen(launch_command(cfg, config_path, token_dir), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill_during_a_save(proc, checkpoint_dir, rng, timeout=120.0):
    """Wait until a save is in flight (a step-N.tmp folder exists), let it run a random while, SIGKILL all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if checkpoint_dir.is_dir() and any(p.name.endswith(".tmp") for p in checkpoint_dir.iterdir()):
            time.sleep(rng.uniform(0.0, 0.4))
            break
        time.sleep(0.01)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_sigkill_during_async_saves_always_resumes_from_the_newest_valid_checkpoint(
        tmp_path, token_dir, training_config):
    reference_cfg = training_config(tmp_path / "reference", "reference", *STEPS)
    run_local_training(reference_cfg, token_dir)
    reference = {r["step"]: r["loss"] for r in read_metrics(reference_cfg.run_dir / "metrics.jsonl")}

    cfg = training_config(tmp_path / "crashy", "crashy", *STEPS, "--checkpoint.mode=async")
    rng = random.Random(20261129)
    resumed_from = []
    for _ in range(3):
        _kill_during_a_save(_start(cfg, token_dir), cfg.checkpoint_dir, rng)
        # The commit protocol's promise: every folder named step-N verifies; only *.tmp may be partial.
        for step, folder in committed_checkpoints(cfg.checkpoint_dir):
            assert verify_checkpoint(folder).ok, f"committed checkpoint {folder} does not verify"
        latest = latest_valid_checkpoint(cfg.checkpoint_dir)
        resumed_from.append(latest.manifest["step"] if latest else 0)
    assert resumed_from == sorted(resumed_from), "a restart went back past a committed checkpoint"

    result = run_local_training(cfg, token_dir)
    assert result["steps"] == 16
    replayed = {r["step"]: r["loss"] for r in read_metrics(cfg.run_dir / "metrics.jsonl")}
    assert replayed == reference  # every step, including those replayed after each kill, bit-identical


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_log_line(trained_run, tmp_path, token_dir, training_config):
    import shutil

    cfg, _ = trained_run
    resumed = training_config(tmp_path, "skip-corrupt", "--training.num_steps=8", "--checkpoint.interval_steps=4")
    for name in ("step-000004", "step-000008"):
        shutil.copytree(cfg.checkpoint_dir / name, resumed.checkpoint_dir / name)
    shard = sorted((resumed.checkpoint_dir / "step-000008").glob("*.distcp"))[0]
    with shard.open("r+b") as handle:  # truncate the newest checkpoint's shard
        handle.truncate(100)

    result = run_local_training(resumed, token_dir)
    log = (resumed.run_dir / "train.log").read_text()
    assert "skipping checkpoint" in log and "step-000008" in log and "truncated" in log
    assert "resumed from" in log and "step-000004" in log
    assert result["steps_this_launch"] == 4
    assert verify_checkpoint(resumed.checkpoint_dir / "step-000008").ok  # replayed and committed anew
