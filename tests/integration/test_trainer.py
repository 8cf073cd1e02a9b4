"""Real 2-rank FSDP2 training on CPU (torchrun, gloo, DCP)."""

import shutil

import pytest

from components.train.local import TrainingError, run_local_training
from components.train.report import read_metrics
from trainer.checkpoint.format import committed_checkpoints, verify_checkpoint
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir, read_jsonl
from tests.metrics import losses_by_step

pytestmark = pytest.mark.integration


def test_training_lowers_the_loss_and_commits_verified_checkpoints(trained_run):
    cfg, result = trained_run
    assert result["steps"] == 8 and result["world_size"] == 2
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert result["final_loss"] == records[-1]["loss"]
    steps = [s for s, _ in committed_checkpoints(cfg.checkpoint_dir)]
    assert steps == [4, 8]  # keep_last=2
    manifest = verify_checkpoint(cfg.checkpoint_dir / "step-000008").manifest
    assert manifest["world_size"] == 2 and manifest["run_id"] == "trained"
    assert sum(1 for name in manifest["files"] if name.endswith(".distcp")) == 2  # one shard file per rank


def test_each_save_is_one_record_of_the_worst_rank_not_one_per_rank(trained_run):
    """Issue 32: what a save cost the loop is reduced over every rank (an asynchronous all-reduce after the
    hand-off: trainer.checkpoint.commit) and recorded once, by rank 0 — the last save's too."""
    cfg, _ = trained_run
    stalls = read_events(cfg.run_dir, "checkpoint_stall")
    assert [(s["step"], s["rank"], s["ranks"]) for s in stalls] == [(4, 0, 2), (8, 0, 2)]
    assert all(s["loop_wait_seconds"] >= s["handoff_seconds"] >= 0 for s in stalls)
    assert {r["rank"] for r in read_jsonl(RunDir(cfg.run_dir).periodic_log)} == {0}
    assert not RunDir(cfg.run_dir).legacy_events()  # no file per rank


def test_resume_from_an_earlier_checkpoint_replays_bit_identical_losses(trained_run, tmp_path, token_dir,
                                                                       training_config):
    cfg, _ = trained_run
    reference = losses_by_step(cfg.run_dir / "metrics.jsonl")

    # A run that "lost" its newest checkpoint: only step 4 survives, so steps 5-8 are replayed.
    resumed = training_config(tmp_path, "resumed", "--training.num_steps=8", "--checkpoint.interval_steps=4")
    shutil.copytree(cfg.checkpoint_dir / "step-000004", resumed.checkpoint_dir / "step-000004")
    result = run_local_training(resumed, token_dir)

    assert result["steps"] == 8 and result["steps_this_launch"] == 4
    replayed = losses_by_step(resumed.run_dir / "metrics.jsonl")
    assert sorted(replayed) == [5, 6, 7, 8]
    assert all(replayed[s] == reference[s] for s in replayed), (replayed, reference)


def test_a_failing_launch_reports_the_log(tmp_path, training_config):
    cfg = training_config(tmp_path, "broken", "--training.num_steps=2", "--resilience.max_restarts=0",
                          "--resilience.job_restarts=0")  # restarts would only repeat the same failure
    with pytest.raises(TrainingError) as err:
        run_local_training(cfg, tmp_path / "no-data")
    assert "exited with code" in str(err.value) and "stage the dataset first" in str(err.value)
    assert (cfg.run_dir / "train.log").is_file()
