"""The node-memory tier's store: copies in shared memory, double buffered, checksummed, restored in place."""

import atexit
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.node_store import RankStore, node_store_folder
from trainer.checkpoint.state_bytes import StateMismatch, restore
from trainer.config import CheckpointConfig
from trainer.env import NODE_STORE_ENV
from trainer.launch.launcher import launch_node_store


def _state(scale: float) -> dict:
    return {"model": {"w": torch.full((3, 2), scale), "b": torch.arange(4, dtype=torch.bfloat16) * scale},
            "optim": {"state": {"w": {"step": torch.tensor(scale), "exp_avg": torch.full((3, 2), -scale)}},
                      "param_groups": [{"lr": 0.1 * scale, "betas": (0.9, 0.95), "params": ["w"]}]},
            "trainer": {"step": torch.tensor(int(scale))}}


@pytest.fixture
def store(tmp_path):
    return RankStore(tmp_path, node=0, rank=0, world_size=1, replica_of=None)


def test_a_copy_restores_a_fresh_state_in_place_and_later_training_does_not_leak_in(store):
    live = _state(2.0)
    store.save(10, live)
    live["model"]["w"].add_(100)  # training goes on after the copy

    fresh = _state(0.0)
    weight = fresh["model"]["w"]
    copy = store.own_copies()[10]
    restore(fresh, copy.meta["layout"], copy.data)
    assert fresh["model"]["w"] is weight  # in place: the model's own tensors get the values
    assert torch.equal(weight, torch.full((3, 2), 2.0))
    assert torch.equal(fresh["model"]["b"], torch.arange(4, dtype=torch.bfloat16) * 2)
    assert torch.equal(fresh["optim"]["state"]["w"]["exp_avg"], torch.full((3, 2), -2.0))
    assert fresh["optim"]["param_groups"] == [{"lr": pytest.approx(0.2), "betas": (0.9, 0.95), "params": ["w"]}]
    assert int(fresh["trainer"]["step"]) == 2


def test_two_slots_hold_the_two_newest_steps(store):
    for step in (1, 2, 3):
        store.save(step, _state(float(step)))
    assert sorted(store.own_copies()) == [2, 3]


def test_a_copy_interrupted_half_way_is_never_read_and_the_previous_step_stays(store):
    store.save(1, _state(1.0))
    store.save(2, _state(2.0))
    slot = store.own.next_slot()  # where step 3 would go: the slot of step 1
    slot.begin_write()  # the process dies mid-copy: meta.json is gone, the data half new
    slot.buffer(slot.data_path.stat().st_size).fill_(7)
    assert sorted(store.own_copies()) == [2]


def test_a_copy_that_does_not_match_its_checksum_is_skipped(tmp_path, store, caplog):
    store.save(1, _state(1.0))
    store.save(2, _state(2.0))
    store.own.corrupt_newest()
    fresh = RankStore(tmp_path, node=0, rank=0, world_size=1, replica_of=None)  # a restarted worker
    assert sorted(fresh.own_copies()) == [1]
    assert "does not match its checksum" in caplog.text


def test_a_state_of_another_shape_is_refused_before_anything_changes(store):
    store.save(3, _state(1.0))
    other = _state(0.0)
    other["model"]["w"] = torch.zeros(4, 2)
    copy = store.own_copies()[3]
    with pytest.raises(StateMismatch, match="model.w"):
        restore(other, copy.meta["layout"], copy.data)
    assert torch.equal(other["model"]["b"], torch.zeros(4, dtype=torch.bfloat16))  # untouched


def test_copies_of_another_rank_or_world_size_are_not_used(tmp_path, store):
    store.save(5, _state(1.0))
    assert RankStore(tmp_path, node=0, rank=0, world_size=2, replica_of=None).own_copies() == {}


def test_a_launch_gets_its_own_folder_and_dead_launches_folders_are_removed(tmp_path):
    stale = tmp_path / "launch-999999999-1"
    stale.mkdir()
    mine = launch_node_store(tmp_path)
    assert mine.is_dir() and mine.name.startswith(f"launch-{os.getpid()}-") and not stale.exists()


def test_without_a_launcher_the_process_keeps_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(NODE_STORE_ENV, raising=False)
    monkeypatch.setattr(atexit, "register", lambda *args: None)  # the folder is tmp_path's; pytest removes it
    folder = node_store_folder(str(tmp_path), "run-1")
    assert folder.parent == tmp_path / "run-1" and folder.name.startswith(f"process-{os.getpid()}-")
    assert os.environ[NODE_STORE_ENV] == str(folder)  # an in-process restart finds the same folder
    monkeypatch.setenv(NODE_STORE_ENV, "/somewhere/launch-1")
    assert node_store_folder(str(tmp_path), "run-1") == Path("/somewhere/launch-1")  # the launcher's, as given


def test_agreement_on_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv(NODE_STORE_ENV, str(tmp_path / "store"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        tier = MemoryTier(CheckpointConfig(memory_node_per_rank=True), "run-1", rank=0, world_size=1,
                          local_world_size=1)
        assert tier.restore_newest(_state(0.0)) is None
        tier.save(7, _state(1.0))
        assert tier.restore_newest(_state(0.0), newer_than=7) is None
        fresh = _state(0.0)
        assert tier.restore_newest(fresh) == (7, "memory")
        assert torch.equal(fresh["model"]["w"], torch.full((3, 2), 1.0))
        tier.close()
    finally:
        dist.destroy_process_group()


def test_the_copies_of_a_killed_process_are_freed_by_the_next_one(tmp_path, monkeypatch):
    """`torchrun -m trainer` without the pipeline's launcher: each rank keeps its own folder in node memory
    (RAM) and removes it at exit — which a SIGKILL skips. The next process on the node frees it."""
    import signal
    import subprocess
    import sys

    code = ("import sys, time; from trainer.checkpoint.node_store import node_store_folder; "
            "f = node_store_folder(sys.argv[1], 'run-1'); f.mkdir(parents=True); "
            "(f / 'state.bin').write_bytes(bytes(1 << 20)); print(f, flush=True); time.sleep(60)")
    env = {k: v for k, v in os.environ.items() if k != NODE_STORE_ENV}
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    dead = Path(child.stdout.readline().strip())
    assert dead.is_dir()
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert dead.is_dir()  # no atexit ran

    monkeypatch.delenv(NODE_STORE_ENV, raising=False)
    monkeypatch.setattr(atexit, "register", lambda *args: None)
    mine = node_store_folder(str(tmp_path), "run-1")
    assert not dead.exists() and mine != dead


def test_the_background_copy_commits_what_the_step_held_and_skips_while_the_last_is_being_written(store):
    """checkpoint.memory_copy=async (trainer.checkpoint.node_copy) on the CPU: the optimizer step waits until the
    copy has read the state; a copy handed over while the last one is still being written is skipped, not waited
    for, except when asked to wait (the training's last step)."""
    import threading

    from trainer.checkpoint.node_copy import BackgroundCopy

    gate, committed = threading.Event(), []
    copier = BackgroundCopy(store, torch.device("cpu"), nice=0,
                            after_commit=lambda copy: (committed.append(copy.step), gate.wait(10)))
    live = _state(3.0)
    assert copier.start(4, live)
    copier.before_state_changes()  # returns once the copy has read the state
    live["model"]["w"].add_(100)  # the optimizer step
    assert not copier.start(5, _state(5.0))  # the copy of step 4 is not done (its peer round holds it)
    assert copier.skipped == 1
    gate.set()
    assert copier.wait().step == 4 and committed == [4]
    fresh = _state(0.0)
    copy = store.own_copies()[4]
    restore(fresh, copy.meta["layout"], copy.data)
    assert torch.equal(fresh["model"]["w"], torch.full((3, 2), 3.0))  # what the step held, not what came after

    gate.clear()
    assert copier.start(6, _state(6.0))
    threading.Timer(0.3, gate.set).start()  # step 6's copy finishes a little later
    assert copier.start(7, _state(7.0), wait_if_busy=True)  # waits for it instead of skipping
    copier.close()
    assert sorted(store.own_copies()) == [6, 7] and copier.skipped == 1
