"""checkpoint.interval_steps=auto in a real 2-rank run: the FSx interval is chosen at the third probe save from
the costs the ranks measured, logged with its reasons, followed by every later save, and kept by a restarted
launch instead of being measured again."""

import pytest

from components.train.local import run_local_training
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir

pytestmark = pytest.mark.integration


def test_auto_interval_is_chosen_once_and_kept_across_a_restart(tmp_path, token_dir, training_config):
    # A node "fails" every 36 s: with saves of ~0.1 s the planner's FSx interval is a few seconds of work.
    cfg = training_config(tmp_path, "auto", "--training.num_steps=40", "--checkpoint.interval_steps=auto",
                          "--checkpoint.auto_probe_steps=3", "--checkpoint.auto_node_mtbf_hours=0.01",
                          "--checkpoint.memory_interval_steps=0", "--checkpoint.keep_last=1",
                          "--faults.schedule=sigkill@20:rank=1", "--resilience.job_restarts=0")
    run_local_training(cfg, token_dir)
    chosen = read_events(cfg.run_dir, "checkpoint_interval_chosen")
    assert len(chosen) == 1, chosen  # the restarted launch took the choice from the events
    choice = chosen[0]
    assert choice["step"] == 9 and choice["interval_steps"] >= 1
    assert choice["step_seconds"] > 0 and choice["stall_seconds"] > 0 and choice["background_seconds"] > 0
    assert choice["routes"]["process"] == "ft_launcher from fsx" and "a fault reloading from FSx every" in choice["reason"]
    n = choice["interval_steps"]
    saved = sorted({e["step"] for e in read_events(cfg.run_dir, "checkpoint_stall")})
    assert saved[:2] == [3, 6]
    assert [s for s in saved if s > 9] == sorted({s for s in range(10, 41) if s % n == 0} | {40}), (n, saved)
    assert "checkpoint.interval_steps=auto: every %d steps" % n in RunDir(cfg.run_dir).train_log.read_text()
    assert len(read_events(cfg.run_dir, "recovery")) == 1
