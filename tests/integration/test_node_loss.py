"""A node lost without a job restart, with real processes: training.num_nodes launchers on this machine (one rank
each), a rendezvous store outside every node, and the node_loss drill killing a whole node — its launcher, its
workers — and wiping its node memory. The local runner replaces the node after local.node_replacement_delay_seconds;
the survivors keep running (the same launcher, the same node memory).

Every case must train exactly what a clean run of the same world size trains (bit-identical losses at every step,
replays included): 2 nodes x 1 rank compute what 1 node x 2 ranks do (the same mesh, ranks and samples), so the
session's clean reference serves 2 nodes; 3 nodes have a clean run of their own. The FSx interval (3 steps) is
longer than the memory interval (every step), so where a recovery reads from is visible in the reloaded step.
"""

import pytest

from components.train.local import run_local_training
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir
from tests.metrics import STEADY, first_steps, losses_by_step

pytestmark = pytest.mark.integration

STEPS = [*STEADY, "--training.num_steps=12", "--checkpoint.interval_steps=3", "--resilience.heartbeat_timeout=30",
         "--training.nproc_per_node=1", "--checkpoint.peer_replica_wait=true",
         "--local.node_replacement_delay_seconds=2"]


def _losses(cfg):
    return losses_by_step(RunDir(cfg.run_dir).metrics)


def _launchers_started(cfg) -> dict[int, int]:
    """Launchers started per node index, from the runner's lines in train.log."""
    text = RunDir(cfg.run_dir).train_log.read_text()
    return {node: text.count(f"[nodes] node {node} started") for node in range(3)}


@pytest.fixture(scope="module")
def clean_losses(tmp_path_factory, token_dir, training_config, clean_reference):
    cfg = training_config(tmp_path_factory.mktemp("clean3"), "clean", *STEPS, "--training.num_nodes=3",
                          "--faults.schedule=")
    result = run_local_training(cfg, token_dir)
    assert result["steps"] == 12
    return {2: first_steps(clean_reference, 12), 3: _losses(cfg)}


@pytest.mark.parametrize("nodes, recoveries", [
    # One run, three nodes lost one after another. The survivor restores from its own node memory, the newcomer
    # from the replica its neighbour holds; node 0 too (the rendezvous lives outside every node, and ranks stay with
    # their nodes); at step 6 the FSx save of step 6 is still being written when the node goes, and memory and the
    # replica still hold step 6.
    (2, {"node_loss@4:rank=1": ("peer", 4), "node_loss@6:rank=1": ("peer", 6), "node_loss@10:rank=0": ("peer", 10)}),
    # Two neighbours at once: rank 1's replica lived on node 2 — both copies are gone, so every rank goes to FSx
    # (step 3), still without restarting node 0.
    (3, {"node_loss@5:rank=1,node_loss@5:rank=2": ("disk", 3)}),
], ids=["one-at-a-time", "two-neighbours-at-once"])
def test_a_lost_node_is_replaced_while_the_others_keep_running(tmp_path, token_dir, training_config, clean_losses,
                                                              nodes, recoveries, monkeypatch):
    schedule = ",".join(recoveries)
    cfg = training_config(tmp_path, "lost", *STEPS, f"--training.num_nodes={nodes}", f"--faults.schedule={schedule}")
    node_tmp = tmp_path / "tmp"  # the launchers' temporary folders (each node's fork-server socket), this run's only
    node_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(node_tmp))
    result = run_local_training(cfg, token_dir)
    # A lost node's /tmp goes with it: no fork-server folder of a lost (or ended) node is left behind.
    assert list(node_tmp.glob("rt-fork-*")) == []

    assert result["steps"] == 12
    assert _losses(cfg) == clean_losses[nodes]
    found = read_events(cfg.run_dir, "recovery")
    assert len(found) == len(recoveries)
    for recovery, (faults, (source, reloaded)) in zip(found, recoveries.items()):
        assert recovery["mechanism"] == "ft_launcher"  # in-job: no whole-job restart
        assert sorted(recovery["fault_keys"]) == sorted(faults.split(","))
        assert recovery["reload_source"] == source and recovery["reloaded_step"] == reloaded, recovery
        assert recovery["lost_steps"] == int(faults.split("@")[1].split(":")[0]) - reloaded
        # From memory and the replica, the shared file system serves nothing; from FSx, the checkpoint (hashed, loaded).
        assert (recovery["fsx_bytes_read"] == 0) == (source == "peer") and recovery["fsx_bytes_read"] >= 0
    assert all(launch["job_attempt"] == 0 for launch in read_events(cfg.run_dir, "launch"))
    lost = [int(item.split("rank=")[1]) for item in schedule.split(",")]
    started = _launchers_started(cfg)
    for node in range(nodes):  # each lost node was replaced once per loss; every other launcher ran start to end
        assert started[node] == 1 + lost.count(node), started
    log = RunDir(cfg.run_dir).train_log.read_text()
    assert "its replacement starts (same node index, empty node memory)" in log


def test_a_replacement_that_never_comes_restarts_the_whole_job_from_fsx(tmp_path, token_dir, training_config,
                                                                         clean_losses):
    cfg = training_config(tmp_path, "never", *STEPS, "--training.num_nodes=2", "--faults.schedule=node_loss@5:rank=1",
                          "--local.node_replacement_delay_seconds=100000", "--resilience.replacement_timeout_seconds=8",
                          "--resilience.store_timeout_seconds=4")
    result = run_local_training(cfg, token_dir)

    assert result["steps"] == 12
    assert _losses(cfg) == clean_losses[2]
    [recovery] = read_events(cfg.run_dir, "recovery")
    assert recovery["mechanism"] == "job_restart"
    assert recovery["reload_source"] == "disk" and recovery["reloaded_step"] == 3 and recovery["lost_steps"] == 2
    checkpoint = next(cfg.checkpoint_dir.glob("step-000003*"), None) or next(cfg.checkpoint_dir.glob("step-*"))
    assert recovery["fsx_bytes_read"] > 0, checkpoint  # hashed by rank 0, then each rank's shards
    log = RunDir(cfg.run_dir).train_log.read_text()
    assert "a lost node's replacement did not come in time: the whole job restarts (exit code 43)" in log
    assert _launchers_started(cfg) == {0: 2, 1: 2, 2: 0}  # both nodes started again by the job's relaunch
