"""A node replaced while cut off is fenced: from its successor's claim on, none of its processes writes to the run
folder (trainer.run.lease). The cut-off node still reaches FSx — EKS serves it over another network than EFA —
so nothing but this check keeps its workers from appending to the run's events and metrics."""

import pytest

from trainer.env import GENERATION_ENV, NODE_CUT_OFF_EXIT_CODE, NODE_FENCED_EXIT_CODE, NODE_GENERATION_ENV, NODE_RANK_ENV
from trainer.launch.node_lifecycle import Verdict, verdict
from trainer.launch.node_watch import NodeWatch
from trainer.run.events import EventLog
from trainer.run.lease import LeaseLost, RunLease, claim_node, read_node_generation
from trainer.run.run_dir import RunDir


def _launch(run_dir):
    lease = RunLease(run_dir).acquire()
    return lease, lease.new_generation()


def test_a_replaced_nodes_workers_append_nothing_after_the_claim(tmp_path, monkeypatch):
    lease, generation = _launch(tmp_path)
    first = claim_node(tmp_path, 1)
    # A worker of node 1's first launcher: what its launcher put in its environment.
    monkeypatch.setenv(GENERATION_ENV, str(generation))
    monkeypatch.setenv(NODE_RANK_ENV, "1")
    monkeypatch.setenv(NODE_GENERATION_ENV, str(first))
    events = EventLog(tmp_path, rank=1)
    events.write("attempt", layer="first_start")

    assert claim_node(tmp_path, 1) == first + 1  # the replacement's launcher starts as node 1
    before = RunDir(tmp_path).control_log.read_bytes()
    with pytest.raises(LeaseLost, match="node 1 was replaced"):
        events.write("rank_failed", how="exception")
    with pytest.raises(LeaseLost):  # a record written without a fence handed over (a rank's failure) too
        EventLog(tmp_path, rank=1).write("rank_failed", how="signal")
    assert RunDir(tmp_path).control_log.read_bytes() == before
    # Node 0 keeps writing: its claim is its own.
    monkeypatch.setenv(NODE_RANK_ENV, "0")
    monkeypatch.setenv(NODE_GENERATION_ENV, str(claim_node(tmp_path, 0)))
    EventLog(tmp_path, rank=0).write("attempt", layer="ft_launcher")
    lease.release()


def test_the_launcher_of_a_replaced_node_stops_and_says_why(tmp_path):
    generation = claim_node(tmp_path, 3)
    watch = NodeWatch(run_dir=tmp_path, node_index=3, node_generation=generation, store_endpoint=None,
                      store_timeout_seconds=0)
    assert watch.check(0.0) is None
    claim_node(tmp_path, 3)
    code, message = watch.check(1.0)
    assert code == NODE_FENCED_EXIT_CODE and "node 3 was replaced" in message
    assert read_node_generation(tmp_path, 3) == generation + 1
    assert verdict(NODE_FENCED_EXIT_CODE) is Verdict.SUPERSEDED  # the runner replaces nothing for it


def test_a_launcher_that_loses_the_store_declares_itself_cut_off_only_after_reaching_it_once(tmp_path):
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    endpoint = f"127.0.0.1:{server.getsockname()[1]}"
    watch = NodeWatch(run_dir=None, node_index=1, node_generation=None, store_endpoint=endpoint, store_timeout_seconds=4)
    assert watch.check(0.0) is None and watch.last_reached == 0.0
    server.close()  # the store is gone from this node's view
    assert watch.check(3.0) is None  # within resilience.store_timeout_seconds: a store outage it rides out
    code, message = watch.check(4.5)
    assert code == NODE_CUT_OFF_EXIT_CODE and "resilience.store_timeout_seconds=4" in message
    assert verdict(NODE_CUT_OFF_EXIT_CODE) is Verdict.REPLACE_NODE
    never = NodeWatch(run_dir=None, node_index=1, node_generation=None, store_endpoint=endpoint, store_timeout_seconds=4)
    assert never.check(100.0) is None  # never reached (a gang whose store is still starting): nothing to declare
