"""The node-memory tier under real faults: 2 CPU ranks under ft_launcher, each rank a node of its own
(checkpoint.memory_node_per_rank), its state copied to node memory after every step and replicated to the
other rank. FSx checkpoints every 3 steps (the newest before a fault at step 5 is step 3, before one at step 8
step 6), so a resume from FSx would lose 2 steps.
"""

from pathlib import Path

import pytest

from components.train.local import run_local_training
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir
from tests.metrics import STEADY, first_steps, losses_by_step

pytestmark = pytest.mark.integration

STEPS = [*STEADY, "--training.num_steps=10", "--checkpoint.interval_steps=3", "--resilience.heartbeat_timeout=30",
         "--resilience.job_restarts=0"]


def _losses(cfg):
    return losses_by_step(RunDir(cfg.run_dir).metrics)


@pytest.fixture(scope="module")
def clean_losses(clean_reference):
    return first_steps(clean_reference, 10)


@pytest.mark.parametrize("faults, extra", [
    # Default copies: a process fault, the node's memory holds step 5, copied before; then rank 1's node memory
    # gone (its node lost): rank 0 keeps its replica. Replication runs beside the next step, so the replica of
    # the step that had just completed may still have been in flight: step 8, or step 7. (A resume from FSx would
    # read step 3 and step 6.)
    ({"sigkill@5:rank=1": ("memory", {5}), "node_loss@8:rank=1": ("peer", {7, 8})}, []),
    # The copy off the step's critical path (trainer.checkpoint.node_copy): step 5's copy may have been in flight
    # when the process died, and then the node holds step 4.
    ({"sigkill@5:rank=1": ("memory", {4, 5})}, ["--checkpoint.memory_copy=async"]),
    # Waiting for each replica: the peer always holds the step that had completed.
    ({"node_loss@5:rank=1": ("peer", {5})}, ["--checkpoint.peer_replica_wait=true"]),
    # No replica, and the newest copy corrupt: the other slot (step 4) is the newest intact copy.
    ({"corrupt_memory@5:rank=1": ("memory", {4})}, ["--checkpoint.peer_replica=false"]),
], ids=["default", "async-copy", "replica-wait", "corrupt-without-replica"])
def test_a_fault_resumes_from_the_nearest_copy_with_bit_identical_losses(tmp_path, token_dir, training_config,
                                                                         clean_losses, faults, extra):
    cfg = training_config(tmp_path, "faulty", *STEPS, f"--faults.schedule={', '.join(faults)}", *extra)
    result = run_local_training(cfg, token_dir)

    assert result["steps"] == 10
    assert _losses(cfg) == clean_losses  # every step, replays included, bit-identical
    recoveries = {r["fault_key"]: r for r in read_events(cfg.run_dir, "recovery")}
    assert sorted(recoveries) == sorted(faults)
    for fault, (source, reloaded) in faults.items():
        recovery = recoveries[fault]
        assert recovery["mechanism"] == "ft_launcher"
        assert recovery["reload_source"] == source and recovery["reloaded_step"] in reloaded, recovery
        assert recovery["lost_steps"] == int(fault.split("@")[1].split(":")[0]) - recovery["reloaded_step"]
    if any(fault.startswith("corrupt") for fault in faults):
        assert "does not match its checksum" in RunDir(cfg.run_dir).train_log.read_text()


def test_a_launch_removes_its_node_memory_when_it_ends(trained_run):
    cfg, _ = trained_run  # a clean launch that copied its state to node memory every step
    root = Path(cfg.checkpoint.memory_dir) / cfg.run.run_id
    assert root.is_dir() and list(root.iterdir()) == []
