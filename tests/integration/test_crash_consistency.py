"""A crash anywhere in a save costs no more than that save: kill -9 during async saves, and a SIGKILL at each
sub-step of the commit protocol, each followed by a resume with bit-identical losses."""

import random
import time

import pytest

from components.train.local import job_processes, run_local_training
from tests.launch import start_launcher
from trainer.checkpoint.format import (committed_checkpoints, latest_valid_checkpoint, stale_folders, step_dir_name,
                                       verify_checkpoint)
from trainer.run.events import read_events
from tests.metrics import STEADY, first_steps, losses_by_step

pytestmark = pytest.mark.integration

def kill_everything(proc, token):
    """kill -9 of the launcher and of every process of the launch, wherever it sits; returns once all are gone."""
    import psutil

    survivors = job_processes(token)
    for survivor in survivors:
        survivor.kill()
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(survivors, timeout=30)
    assert not alive, f"processes survived kill -9: {alive}"


def tmp_folders(checkpoint_dir):
    if not checkpoint_dir.is_dir():
        return set()
    return {(p.name, p.stat().st_ino) for p in checkpoint_dir.iterdir() if p.name.endswith(".tmp")}


def kill_during_a_save(cfg, token_dir, rng, timeout=120.0, delay=0.4):
    """Start, wait for the second save this launch begins (a new step-N.tmp after a first one: so every launch
    commits progress before it dies), kill -9 a random while later.

    Returns (N, landed): landed is False when step N committed before the kill arrived (not a mid-save kill).
    """
    leftovers = tmp_folders(cfg.checkpoint_dir)
    proc, token = start_launcher(cfg, token_dir)
    deadline = time.monotonic() + timeout
    seen: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None and len(seen) < 2:
        for name, _ in tmp_folders(cfg.checkpoint_dir) - leftovers:
            step = int(name[len("step-"):-len(".tmp")])
            if step not in seen:
                seen.append(step)
        time.sleep(0.01)
    assert len(seen) >= 2, f"no second save started within {timeout} s; see {cfg.run_dir / 'train.log'}"
    step = max(seen)
    time.sleep(rng.uniform(0.0, delay))
    kill_everything(proc, token)
    return step, not (cfg.checkpoint_dir / step_dir_name(step)).exists()


def losses(cfg):
    return losses_by_step(cfg.run_dir / "metrics.jsonl")


def test_kill_9_during_async_saves_resumes_from_the_newest_committed_checkpoint(tmp_path, token_dir, training_config,
                                                                               clean_reference):
    # Long enough that the kills that land after a save committed (the writer thread finishes a save of this
    # model in a few tenths of a second) leave steps for the next attempts.
    steps = [*STEADY, "--training.num_steps=40", "--checkpoint.interval_steps=2", "--checkpoint.keep_last=3"]

    cfg = training_config(tmp_path / "crashy", "crashy", *steps, "--checkpoint.mode=async")
    rng = random.Random(20261130)
    killed_steps = []
    for _ in range(12):
        step, landed = kill_during_a_save(cfg, token_dir, rng, delay=0.2)
        if landed:
            killed_steps.append(step)
        # The commit protocol's promise: every folder named step-N verifies; only *.tmp may be partial.
        for _, folder in committed_checkpoints(cfg.checkpoint_dir):
            assert verify_checkpoint(folder).ok, f"committed checkpoint {folder} does not verify"
        if len(killed_steps) == 3:
            break
    assert len(killed_steps) == 3, "fewer than 3 kills landed while a save was in flight"

    result = run_local_training(cfg, token_dir)
    assert result["steps"] == 40
    assert losses(cfg) == first_steps(clean_reference, 40)  # every step, replays included, bit-identical

    resumes = [event["step"] for event in read_events(cfg.run_dir, "resume")]
    assert resumes == sorted(resumes), "a restart went back past a committed checkpoint"
    assert any(step > 0 for step in resumes), "no launch resumed from a checkpoint"
    # The launch after each mid-save kill never took the killed save: its step was not committed, and its
    # step-N.tmp was removed before anything was read.
    launches_after_kills = resumes[1:]
    assert all(resume < killed for resume, killed in zip(launches_after_kills, killed_steps)), (resumes, killed_steps)
    assert stale_folders(cfg.checkpoint_dir) == []


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_corrupt_newest_checkpoint_is_skipped_with_a_log_line(trained_run, tmp_path, token_dir, training_config,
                                                                 damage):
    """Truncated: the size check before any read skips it. Flipped byte: found by the load's own hashing
    (FastReader) after it may already have written into the state; the older checkpoint's load must then
    overwrite all of it, so the replayed steps are bit-identical to the original run's."""
    import shutil

    cfg, _ = trained_run
    resumed = training_config(tmp_path, "skip-corrupt", "--training.num_steps=8", "--checkpoint.interval_steps=4")
    for name in ("step-000004", "step-000008"):
        shutil.copytree(cfg.checkpoint_dir / name, resumed.checkpoint_dir / name)
    shard = sorted((resumed.checkpoint_dir / "step-000008").glob("*.distcp"))[0]
    with shard.open("r+b") as handle:
        if damage == "truncated":
            handle.truncate(100)
        else:
            handle.seek(shard.stat().st_size // 2)
            byte = handle.read(1)
            handle.seek(-1, 1)
            handle.write(bytes([byte[0] ^ 0x01]))

    result = run_local_training(resumed, token_dir)
    log = (resumed.run_dir / "train.log").read_text()
    assert "skipping checkpoint" in log and "step-000008" in log
    assert ("truncated" if damage == "truncated" else "content hash (xxh3_128) differs") in log
    assert "resumed from" in log and "step-000004" in log
    assert result["steps_this_launch"] == 4
    assert verify_checkpoint(resumed.checkpoint_dir / "step-000008").ok  # replayed and committed anew
    replayed = losses(resumed)
    assert replayed == {step: loss for step, loss in losses(cfg).items() if step in replayed}


# A SIGKILL at each sub-step of a save (trainer.resilience.faults.SAVE_KILLS), one drill per save, in one run.
DRILLS = {"kill_during_shard_write@4:rank=0": "shard_write", "kill_before_manifest@8:rank=0": "before_manifest",
          "kill_before_rename@12:rank=0": "before_rename", "kill_before_parent_fsync@14:rank=0": "before_parent_fsync",
          "kill_during_retention@18:rank=0": "retention"}
COMMITTED_BEFORE_THE_KILL = {"before_parent_fsync", "retention"}  # the rename had happened: step N is committed


@pytest.fixture(scope="module")
def drilled(tmp_path_factory, token_dir, training_config, clean_reference):
    # The FSx tier alone: with node memory on, these restarts would resume from memory (its own tests).
    steps = [*STEADY, "--training.num_steps=20", "--checkpoint.interval_steps=2", "--checkpoint.keep_last=1",
             "--checkpoint.memory_interval_steps=0"]
    faulty = training_config(tmp_path_factory.mktemp("drills"), "faulty", *steps,
                             f"--faults.schedule={', '.join(DRILLS)}", "--resilience.max_restarts=6",
                             "--resilience.job_restarts=0")
    result = run_local_training(faulty, token_dir)
    return first_steps(clean_reference, 20), faulty, result


@pytest.mark.parametrize("key", list(DRILLS))
def test_a_kill_at_each_sub_step_of_a_save_resumes_from_the_newest_committed_checkpoint(drilled, key):
    _, cfg, _ = drilled
    [fault] = [f for f in read_events(cfg.run_dir, "fault") if f["key"] == key]
    assert fault["save_point"] == DRILLS[key]
    [recovery] = [r for r in read_events(cfg.run_dir, "recovery") if r["fault_key"] == key]
    assert recovery["mechanism"] == "ft_launcher" and recovery["reload_source"] == "disk"
    # The restore read the checkpoint once (the prefetch behind start-up, then the load from memory), and says so.
    # (Every checkpoint of this run has the same size; the reloaded one's commit may not have been recorded.)
    sizes = [e["bytes"] for e in read_events(cfg.run_dir, "checkpoint_committed")]
    assert 0.9 * min(sizes) <= recovery["fsx_bytes_read"] <= 1.5 * max(sizes)
    assert recovery["restore_overlapped_seconds"] > 0 and recovery["restore_gb_per_second"] > 0
    if DRILLS[key] in COMMITTED_BEFORE_THE_KILL:
        assert recovery["reloaded_step"] == fault["step"]
    else:  # the killed save never counts: the newest checkpoint committed before it does
        committed = [e["step"] for e in read_events(cfg.run_dir, "checkpoint_committed") if e["time"] < fault["time"]]
        assert recovery["reloaded_step"] == max(committed) < fault["step"]


def test_after_every_drill_the_losses_are_bit_identical_and_nothing_stale_is_left(drilled):
    clean, faulty, result = drilled
    assert result["steps"] == 20
    assert losses(faulty) == clean
    assert [step for step, _ in committed_checkpoints(faulty.checkpoint_dir)] == [20]  # keep_last=1
    assert latest_valid_checkpoint(faulty.checkpoint_dir).manifest["step"] == 20
    assert stale_folders(faulty.checkpoint_dir) == []
    log = (faulty.run_dir / "train.log").read_text()
    # What the drills left was cleared at the next start: a manifest-complete but unrenamed folder, and a
    # half-deleted one — neither ever read.
    assert "step-000012.tmp (left by an interrupted save or deletion)" in log
    assert "step-000016.deleting (left by an interrupted save or deletion)" in log
