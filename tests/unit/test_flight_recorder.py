"""A collective hang explains itself (trainer.resilience.flight_recorder): real gloo hangs between 2 processes, each
rank's flight recorder dumped into the attempt's folder, and the finding that names the collective and the ranks;
NCCL's pickled dump (completion tracked) read with the unpickler that builds plain data only."""

import datetime
import os
import pickle
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.resilience import flight_recorder
from trainer.resilience.failures import explain_restarts
from trainer.run.events import EventLog

ATTEMPT = "0/0/1/0"


def _hang(rank: int, port: int, run_dir: str, scenario: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    flight_recorder.enable(run_dir, ATTEMPT)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    values = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(values)
    stall = flight_recorder.StallDump(run_dir, ATTEMPT, rank, after_seconds=1.0)
    stall.beat()  # the loop's last heartbeat
    try:
        if rank == 0:
            dist.all_reduce(values)  # the collective that hangs
        elif scenario == "mismatched":
            dist.barrier()  # another collective at the same place in the order
        else:
            time.sleep(3)  # never reaches it: its stall dump is all it leaves (as when the launcher kills it)
            os._exit(0)
    except RuntimeError:
        pass
    flight_recorder.dump(run_dir, ATTEMPT, rank)  # the failure's own dump (trainer.job.cli)
    os._exit(0)  # a group whose collective failed cannot be torn down cleanly (gloo aborts in its destructor)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scenario", ["mismatched", "behind"])
def test_a_real_gloo_hang_names_the_collective_and_the_ranks(tmp_path, scenario):
    mp.spawn(_hang, args=(_free_port(), str(tmp_path), scenario), nprocs=2, join=True)
    assert sorted(p.name for p in flight_recorder.folder_of(tmp_path, ATTEMPT).iterdir()) == [
        "rank_0", "rank_0.summary", "rank_1", "rank_1.summary"]
    found = flight_recorder.hung_collective(tmp_path, ATTEMPT, world_size=2)
    # the summaries beside the dumps give what the whole dumps give
    whole = {r: flight_recorder.read_dump(flight_recorder.folder_of(tmp_path, ATTEMPT) / f"rank_{r}") for r in (0, 1)}
    assert flight_recorder.analyze(whole, 2) == found
    assert found["seq"] == 4 and not found["completion_tracked"] and found["absent"] == []
    if scenario == "mismatched":  # named after the rank that entered first: either order is the same finding
        named = {"0": "gloo:all_reduce", "1": "gloo:barrier"}
        [waiting] = found["waiting"]
        assert found["collective"] == named[str(waiting)] and found["behind"] == []
        assert found["mismatched"] == {rank: name for rank, name in named.items() if rank != str(waiting)}
        return
    assert found["collective"] == "gloo:all_reduce" and found["waiting"] == [0]
    assert found["behind"] == [1] and found["mismatched"] == {}

    # The recovery's cause says it (trainer.resilience.failures.explain_restarts, the attempt's own folder).
    EventLog(tmp_path, 0).write("rank_failed", how="exception", error_type="RuntimeError", message="timed out",
                                phase="train", step=5, secondary=True, attempt=ATTEMPT)
    [explained] = explain_restarts(tmp_path, before=1e12, world_size=2)
    assert explained["hung_collective"]["collective"] == "gloo:all_reduce"
    assert ("the collective left waiting: gloo:all_reduce #4 of process group default_pg, rank(s) [0] in it; "
            "rank(s) [1] never reached it") in explained["cause"]


def _nccl_entry(seq: int, name: str, state: str) -> dict:
    """An entry as ProcessGroupNCCL's flight recorder pickles it (torch/csrc/distributed/c10d/FlightRecorder.cpp:
    the fields fr_trace reads)."""
    return {"record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": name, "time_created_ns": 1000 + seq, "state": state,
            "input_sizes": [[1024]], "timeout_ms": 600000, "is_p2p": False, "frames": []}


def test_an_nccl_dump_names_the_oldest_collective_not_completed_and_the_silent_rank(tmp_path):
    folder = flight_recorder.folder_of(tmp_path, ATTEMPT)
    folder.mkdir(parents=True)
    entries = [_nccl_entry(s, "nccl:all_gather_into_tensor_coalesced", "completed") for s in range(1, 6)]
    entries += [_nccl_entry(6, "nccl:reduce_scatter_tensor_coalesced", "started"),
                _nccl_entry(7, "nccl:all_reduce", "scheduled")]
    (folder / "rank_0").write_bytes(pickle.dumps({"version": "2.10", "entries": entries}))
    found = flight_recorder.hung_collective(tmp_path, ATTEMPT, world_size=2)
    assert flight_recorder.analyze({0: flight_recorder.reduce_dump(flight_recorder.read_dump(folder / "rank_0"))},
                                   2) == found
    assert (found["collective"], found["seq"], found["waiting"], found["absent"]) == (
        "nccl:reduce_scatter_tensor_coalesced", 6, [0], [1])
    assert "rank(s) [1] left no dump" in flight_recorder.describe(found)


def test_a_dump_that_would_build_objects_is_refused(tmp_path):
    folder = flight_recorder.folder_of(tmp_path, ATTEMPT)
    folder.mkdir(parents=True)
    (folder / "rank_0").write_bytes(pickle.dumps({"entries": [datetime.date(2026, 1, 1)]}))
    assert flight_recorder.hung_collective(tmp_path, ATTEMPT, world_size=1) is None
