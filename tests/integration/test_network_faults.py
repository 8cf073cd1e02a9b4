"""Faults the network makes, with real processes: each node's launcher and workers in a network namespace of its own
(local.node_network=netns), the rendezvous store in another, the run folder shared, and the runner cutting links
from outside (localcluster/network_drills.py). Root only: namespaces, veth pairs and a bridge are made with
`ip`; elsewhere (the GitHub workflow runs as a user) every test here skips and says why.

What a cut-off node must do (docs/network-faults.md): be declared lost within the timeouts and replaced; write
nothing to the run folder once its replacement claimed its node index (the fence); not come back as a second copy
when its link does; and cost nothing when the cut is shorter than the timeouts. Losses are bit-identical to a clean
run of the same shape in every case here. Assertions are on records and step counts, never on durations."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from components.train.local import RUN_DIR_ENV, job_processes, run_local_training
from localcluster.network import leftovers, netns_problem
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir, read_json, read_jsonl
from tests.metrics import losses_by_step

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(netns_problem() is not None, reason=f"needs root: {netns_problem()}")]

NUM_STEPS = 30
# heartbeat 10 s: a survivor blocked in a collective with a cut-off peer is restarted after it; the cut-off node
# declares itself lost after 4 s without the store. The FSx interval (3) is longer than the memory tier's (1).
# Sequences of 256 tokens: steps of ~0.5 s here, so that a drill's link changes (seconds) happen while it trains.
SHAPE = [f"--training.num_steps={NUM_STEPS}", "--training.seq_len=256", "--checkpoint.interval_steps=3", "--training.nproc_per_node=1",
         "--training.num_nodes=2", "--checkpoint.peer_replica_wait=true", "--local.node_replacement_delay_seconds=0",
         "--local.node_network=netns", "--resilience.heartbeat_timeout=10", "--resilience.store_timeout_seconds=4"]


def _losses(cfg):
    return losses_by_step(RunDir(cfg.run_dir).metrics)


def _run(tmp_path, training_config, token_dir, run_id, schedule):
    cfg = training_config(tmp_path, run_id, *SHAPE, f"--faults.schedule={schedule}")
    result = run_local_training(cfg, token_dir)
    assert result["steps"] == NUM_STEPS
    assert job_processes(str(cfg.run_dir), RUN_DIR_ENV) == []
    assert read_events(cfg.run_dir, "gave_up") == []
    return cfg


@pytest.fixture(scope="module")
def clean_losses(tmp_path_factory, token_dir, training_config):
    return _losses(_run(tmp_path_factory.mktemp("clean"), training_config, token_dir, "clean", ""))


def _writes_after(cfg, node: int, generation: int, since: float) -> list[dict]:
    """Every record in the run folder's event streams from a process of node `node`'s launcher number `generation`
    (one rank per node here: rank == node) written after `since`."""
    return [e for e in read_events(cfg.run_dir) if e.get("rank") == node and e.get("node_generation") == generation
            and e["time"] > since]


# A node's link down 2 s (TCP retransmits, the collective completes late), then the store away 2 s (below
# store_timeout_seconds, nobody declares anything): each absorbed on its own, in one run.
SHORT_CUTS = ("partition@4:node=1:seconds=2", "partition_store@14:seconds=2")


def test_a_cut_shorter_than_the_timeouts_costs_no_restart(tmp_path, token_dir, training_config, clean_losses):
    cfg = _run(tmp_path, training_config, token_dir, "short", ", ".join(SHORT_CUTS))

    assert _losses(cfg) == clean_losses
    assert read_events(cfg.run_dir, "recovery") == [] and read_events(cfg.run_dir, "node_lost") == []
    assert {a["layer"] for a in read_events(cfg.run_dir, "attempt")} == {"first_start"}
    assert [f["key"] for f in read_events(cfg.run_dir, "fault")] == list(SHORT_CUTS)
    assert [a["fault_key"] for a in read_events(cfg.run_dir, "fault_absorbed")] == list(SHORT_CUTS)


def test_nothing_is_left_after_the_runner_is_killed(tmp_path):
    """SIGKILL the runner mid-training: its nodes die with it (each watches its parent), and the keeper it started
    removes every namespace, link and hosts file of the launch."""
    script = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests/integration']\n"
        "from conftest import _training_config\n"
        "from components.train.local import run_local_training\n"
        "from pathlib import Path\n"
        "cfg = _training_config(Path(sys.argv[2]), 'killed', '--training.num_steps=100000', '--training.nproc_per_node=1',"
        " '--training.num_nodes=2', '--local.node_network=netns', '--checkpoint.enabled=false')\n"
        "run_local_training(cfg, Path(sys.argv[3]))\n")
    token_dir = tmp_path / "tokens"
    _tokens(token_dir)
    runner = subprocess.Popen([sys.executable, "-c", script, os.getcwd(), str(tmp_path / "work"), str(token_dir)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "work" / "fsx" / "runs" / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.is_file() and metrics.stat().st_size):
        time.sleep(0.2)
    assert metrics.is_file(), "training never started"
    tokens = {name.split("-")[1] for name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
              .stdout.split() if name.startswith("rt-")}
    mine = [t for t in tokens if any(str(tmp_path) in " ".join(p.cmdline()) for p in _in_namespaces_of(t))]
    assert len(mine) == 1, tokens
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (leftovers(mine[0]) or job_processes(str(metrics.parent), RUN_DIR_ENV)):
        time.sleep(0.2)
    assert leftovers(mine[0]) == []
    assert job_processes(str(metrics.parent), RUN_DIR_ENV) == []


def _in_namespaces_of(token: str) -> list[psutil.Process]:
    """Processes running in a namespace of the launch `token` (`ip netns pids`)."""
    pids = []
    for name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split():
        if name.startswith(f"rt-{token}-"):
            pids += subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(int(pid)))
        except psutil.NoSuchProcess:
            continue
    return procs


def _tokens(out):
    from pipelines.demo_data import demo_files
    from trainer.data.shards import tokenize_files

    raw = out.parent / "raw"
    raw.mkdir()
    for name, body in demo_files(100).items():
        (raw / name).write_bytes(body)
    tokenize_files(sorted(raw.iterdir()), out, 0.1)


def test_a_cut_off_replica_group_is_replaced_and_heals_from_the_live_one(tmp_path, token_dir, training_config):
    """R = 2, a node per group: node 1 — group 1 — is cut off for good. Group 0 commits without it once the
    all-reduce and the quorum give up on it; node 1 declares itself lost; its replacement heals from group 0."""
    # 60 steps: group 0 alone must still be training when group 1's replacement comes back (~10 s after the cut).
    cfg = training_config(tmp_path, "group-cut", *SHAPE, "--training.num_steps=60", "--training.replica_groups=2",
                          "--resilience.heartbeat_timeout=30",
                          "--resilience.replica_timeout_seconds=5", "--resilience.quorum_timeout_seconds=10",
                          "--resilience.lighthouse_heartbeat_timeout_seconds=1", "--resilience.replica_check_interval=1",
                          "--resilience.straggler_interval=0", "--faults.schedule=partition@4:node=1")
    result = run_local_training(cfg, token_dir)

    assert result["steps"] == 60
    lines = read_jsonl(RunDir(cfg.run_dir).metrics)
    assert {r["step"] for r in lines} == set(range(1, 61))
    assert any(r["participants"] == 1 for r in lines) and lines[-1]["participants"] == 2
    both = [r for r in lines if r["participants"] == 2]
    assert all(r.get("replicas_equal") is True for r in both)
    [lost] = read_events(cfg.run_dir, "node_lost")
    assert lost["node"] == 1 and lost["detector"] == "store_timeout"
    recoveries = read_events(cfg.run_dir, "recovery")
    assert [r["mechanism"] for r in recoveries] == ["replica_group_heal"]
    assert recoveries[0]["fault_keys"] == ["partition@4:node=1"]
    assert job_processes(str(cfg.run_dir), RUN_DIR_ENV) == []


CUT = "partition@9:node=1:seconds=15"


def test_the_soak_in_network_namespaces(tmp_path, token_dir, training_config, clean_losses):
    """Process faults and network faults in one run of the same shape: a SIGKILL, node 1 cut off for 15 s, its
    replacement's link flapping 3 times, the store away for 2 s, node 0 lost whole. Every fault has its record, no
    give-up, losses bit-identical to the clean run, nothing left behind; a flapping link costs at most one recovery
    per flap.

    The cut: its link comes back 15 s after it, after node 1 declared itself lost (4 s without the store, its
    launcher stopped 2 s later at most) and its replacement took over, so the old namespace returns to a job that
    already has a node 1: replaced, fenced, and not back as a second node 1."""
    schedule = f"sigkill@5:rank=1,{CUT},flap@14:node=1:times=3,partition_store@19:seconds=2,node_loss@22:rank=0"
    cfg = _run(tmp_path, training_config, token_dir, "soak", schedule)

    assert _losses(cfg) == clean_losses
    faults = read_events(cfg.run_dir, "fault")
    keys = [f["key"] for f in faults]
    assert {k.split("#")[0] for k in keys} == set(schedule.split(","))
    recoveries = read_events(cfg.run_dir, "recovery")
    answered = {k for r in recoveries for k in r["fault_keys"]}
    answered |= {a["fault_key"] for a in read_events(cfg.run_dir, "fault_absorbed")}
    assert set(keys) <= answered
    flaps = [k for k in keys if k.startswith("flap")]
    assert flaps == [f"flap@14:node=1:times=3#{n}" for n in (1, 2, 3)]
    assert len([r for r in recoveries if set(r["fault_keys"]) & set(flaps)]) <= len(flaps)

    # The cut. Its detector: node 1's own launcher, cut off from the store, exited 46 (the only node that did).
    [cut] = [f for f in faults if f["key"] == CUT]
    assert cut["rank"] is None and cut["node"] == 1
    [lost] = [e for e in read_events(cfg.run_dir, "node_lost") if e["detector"] == "store_timeout"]
    assert lost["node"] == 1 and lost["exit_code"] == 46
    [recovery] = [r for r in recoveries if CUT in r["fault_keys"]]
    assert "node 1 was cut off from the job's network" in recovery["cause"]
    # Node 1's state from its replica on node 0 — or, when the cut fell while that step's replica was in flight,
    # every rank from the FSx checkpoint before it (the memory tier restores a step every rank holds).
    assert recovery["reload_source"] in ("peer", "disk") and recovery["reloaded_step"] >= 6
    assert recovery["mechanism"] in ("ft_launcher", "node_replacement")
    # The fence: the replacement claimed node 1 (generation 2; its flaps restart workers, not the node); nothing of
    # the first node 1 was written after that.
    claim = read_json(RunDir(cfg.run_dir).node_fence(1))
    assert claim["generation"] == 2
    assert _writes_after(cfg, node=1, generation=1, since=claim["since"]) == []
    samples = read_jsonl(RunDir(cfg.run_dir).system_samples)  # the launcher's own writes
    assert [s for s in samples if s["node"] == "node-1" and s.get("node_generation") == 1
            and s["time"] > claim["since"]] == []
    assert any(s["node"] == "node-1" and s.get("node_generation") == 2 for s in samples)
    # The link came back after the replacement: the old node did not come back as a second node 1.
    [restored] = [e for e in read_events(cfg.run_dir, "link_restored") if e["key"] == CUT]
    assert restored["replaced"] is True and restored["time"] > claim["since"] > lost["time"] - 1
    log = RunDir(cfg.run_dir).train_log.read_text()
    # node 1 replaced once (the cut), node 0 once (its loss at 22)
    assert log.count("[nodes] node 1 started") == 2 and log.count("[nodes] node 0 started") == 2
    assert "exits 46 to be replaced" in log
