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


def test_the_planner_chooses_the_copy_interval_from_what_a_copy_costs(tmp_path, token_dir, training_config,
                                                                       clean_reference):
    """checkpoint.memory_interval_steps=auto (the default; the suite's runs pin 1): 6 steps with a copy each, 6
    without, then the planner's interval for the difference (the copy and what its peer replica takes from the next
    step) and the faults it serves (two "nodes" failing every 12 minutes each: a copy of a few % of a step is then
    worth it every few steps; with a drill scheduled every few steps, every step: tests/unit/test_planning.py)."""
    steps = 18
    cfg = training_config(tmp_path, "auto", *STEPS, f"--training.num_steps={steps}", "--faults.schedule=",
                          "--checkpoint.memory_interval_steps=auto", "--checkpoint.auto_node_mtbf_hours=0.2")
    result = run_local_training(cfg, token_dir)

    assert result["steps"] == steps and _losses(cfg) == first_steps(clean_reference, steps)
    [chosen] = read_events(cfg.run_dir, "memory_interval_chosen")
    assert chosen["step"] == 13 and chosen["copy_seconds"] >= chosen["copy_wait_seconds"] > 0, chosen
    assert chosen["nodes"] == 2 and chosen["step_with_copy_seconds"] > chosen["step_seconds"] > 0, chosen
    assert chosen["reason"].startswith("a copy costs the loop") and "2 nodes x MTBF 0.2 h" in chosen["reason"]
    interval = chosen["interval_steps"]
    assert interval > 1, chosen  # a copy's few ms beside a fault every 6 minutes
    copied = [step for step in range(1, steps + 1) if step <= 6 or (step >= 13 and step % interval == 0)]
    # every FSx save records the node-memory copies made since the one before (worst rank)
    stalls = read_events(cfg.run_dir, "checkpoint_stall")
    assert [s["step"] for s in stalls] == list(range(3, steps + 1, 3))
    assert sum(s["memory_copies"] for s in stalls) == len(copied), (stalls, chosen)
