import json

import pytest
import torch

from trainer.checkpoint.format import (MANIFEST, committed_checkpoints, latest_valid_checkpoint, step_dir_name,
                                       verify_checkpoint, write_manifest)
from trainer.checkpoint.retention import Retention


def _fake_checkpoint(root, step, payload=b"x" * 1000):
    folder = root / step_dir_name(step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(payload)
    (folder / "__1_0.distcp").write_bytes(payload[::-1] + b"y")
    (folder / ".metadata").write_bytes(b"meta")
    write_manifest(folder, step, {"world_size": 2})
    return folder


def test_intact_checkpoint_verifies(tmp_path):
    result = verify_checkpoint(_fake_checkpoint(tmp_path, 10))
    assert result.ok and result.manifest["step"] == 10 and result.manifest["world_size"] == 2


def test_flipped_byte_is_caught(tmp_path):
    folder = _fake_checkpoint(tmp_path, 10)
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    data[500] ^= 0x01
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    result = verify_checkpoint(folder)
    assert not result.ok and "__0_0.distcp: content hash (xxh3_128) differs" in result.problems[0]


def test_truncated_shard_is_caught(tmp_path):
    folder = _fake_checkpoint(tmp_path, 10)
    (folder / "__1_0.distcp").write_bytes(b"short")
    assert "truncated" in verify_checkpoint(folder).problems[0]


def test_missing_shard_and_missing_manifest_are_caught(tmp_path):
    folder = _fake_checkpoint(tmp_path, 10)
    (folder / "__1_0.distcp").unlink()
    assert "missing" in verify_checkpoint(folder).problems[0]
    (folder / MANIFEST).unlink()
    assert "manifest missing" in verify_checkpoint(folder).problems[0]


def test_latest_skips_a_broken_newest_with_a_log_line(tmp_path, caplog):
    _fake_checkpoint(tmp_path, 10)
    broken = _fake_checkpoint(tmp_path, 20)
    (broken / ".metadata").write_bytes(b"xxxx")
    (tmp_path / "step-000030.tmp").mkdir()  # an uncommitted save is never a candidate
    assert [s for s, _ in committed_checkpoints(tmp_path)] == [10, 20]
    with caplog.at_level("WARNING"):
        latest = latest_valid_checkpoint(tmp_path)
    assert latest.manifest["step"] == 10
    assert "skipping checkpoint" in caplog.text and "step-000020" in caplog.text


def test_no_checkpoint_means_none(tmp_path):
    assert latest_valid_checkpoint(tmp_path / "absent") is None


def test_manifest_is_json_with_sizes(tmp_path):
    folder = _fake_checkpoint(tmp_path, 3)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["files"]["__0_0.distcp"]["bytes"] == 1000
    assert "torch" in manifest["libraries"]


def _manager(directory, keep_last):
    import torch

    from trainer.checkpoint.manager import CheckpointManager
    from trainer.config import CheckpointConfig
    from trainer.run.events import EventLog

    return CheckpointManager(directory, CheckpointConfig(mode="sync", keep_last=keep_last), rank=0,
                             device=torch.device("cpu"), metadata={}, events=EventLog(directory.parent, 0))


def _corrupt(folder):
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_retention_never_deletes_the_newest_valid_checkpoint_and_counts_only_valid_ones(tmp_path):
    """{4 valid, 6 just committed, 8 corrupt}, keep_last=1: by name 8 would be kept and 6 deleted."""
    directory = tmp_path / "checkpoints"
    for step in (4, 6, 8):
        _fake_checkpoint(directory, step)
    _corrupt(directory / step_dir_name(8))
    Retention(directory, keep_last=1).apply(6)
    left = [step for step, _ in committed_checkpoints(directory)]
    assert left == [6, 8]  # 6 kept (the newest valid); 4 beyond keep_last; 8 broken, waits to be replaced
    assert latest_valid_checkpoint(directory).manifest["step"] == 6


def test_retention_deletes_broken_checkpoints_older_than_the_newest_valid_one(tmp_path):
    directory = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        _fake_checkpoint(directory, step)
    _corrupt(directory / step_dir_name(4))
    (directory / step_dir_name(6) / MANIFEST).unlink()  # never committed properly
    Retention(directory, keep_last=2).apply(8)
    assert [step for step, _ in committed_checkpoints(directory)] == [2, 8]  # the two valid ones
    assert not list(directory.glob("*.deleting"))


def test_what_a_crash_left_behind_is_removed_at_start_up(tmp_path):
    directory = tmp_path / "checkpoints"
    _fake_checkpoint(directory, 2)
    for name in ("step-000004.tmp", "step-000002.deleting", "step-000006.replaced-1764460800"):
        (directory / name).mkdir(parents=True)
        (directory / name / "__0_0.distcp").write_bytes(b"partial")
    _manager(directory, keep_last=2)
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002"]


def test_save_drills_parse_and_fire_once_at_their_point(tmp_path):
    import os

    from trainer.config.drills import parse_schedule
    from trainer.resilience.faults import FaultInjector
    from trainer.run.events import EventLog

    faults = parse_schedule("kill_before_rename@6, kill_during_shard_write@8:rank=1")
    with pytest.raises(ValueError, match="takes TYPE@STEP"):
        parse_schedule("kill_before_rename@t=5s")
    # Only rank 0 commits: a drill at a commit sub-step on another rank could never fire, so it is refused.
    for drill in ("kill_before_rename@141:rank=1", "kill_before_manifest@4:rank=1", "kill_during_retention@8:rank=1",
                  "kill_before_parent_fsync@2:rank=3"):
        with pytest.raises(ValueError, match="could never fire: only rank 0 commits"):
            parse_schedule(drill)
    killed = []
    injector = FaultInjector(faults, 0, EventLog(tmp_path, 0), set(), run_started_at=0.0, slow_seconds=0)
    import trainer.resilience.faults as module

    real_kill = os.kill
    module.os.kill = lambda pid, sig: killed.append((pid, sig))
    try:
        injector.maybe_inject(10)  # loop faults only: the drill waits for its save point
        injector.at_save_point("before_manifest", 6)
        injector.at_save_point("before_rename", 4)
        assert killed == []
        injector.at_save_point("before_rename", 6)
        injector.at_save_point("before_rename", 8)  # fired once
    finally:
        module.os.kill = real_kill
    assert len(killed) == 1 and killed[0][0] == os.getpid()


def test_a_state_holding_a_nan_is_never_committed_and_a_finite_one_records_the_check(tmp_path):
    import torch
    import torch.distributed as dist

    from trainer.checkpoint.manager import NonFiniteState
    from trainer.run.events import read_events

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        directory = tmp_path / "run" / "checkpoints"
        manager = _manager(directory, keep_last=3)
        state = {"model": {"w": torch.ones(4), "b": torch.zeros(2)}, "trainer": {"step": torch.tensor(1)}}
        assert manager.save(1, lambda: state, last=True)
        manager.wait()
        [(_, folder)] = committed_checkpoints(directory)
        assert verify_checkpoint(folder).manifest["finite_check"] == {"ranks": 1, "tensors": 2, "finite": True}

        state["model"]["w"][2] = float("nan")
        assert not manager.save(2, lambda: state, last=True)
        assert [step for step, _ in committed_checkpoints(directory)] == [1] and not list(directory.glob("*.tmp"))
        [refused] = read_events(tmp_path / "run", "checkpoint_refused")
        assert refused["step"] == 2 and refused["ranks"] == {"0": 1}
        with pytest.raises(NonFiniteState, match="step 3.*NaN or infinity"):
            manager.save_final(3, lambda: state)
        manager.close()
    finally:
        dist.destroy_process_group()


def test_the_finite_check_flags_every_nan_and_infinity_and_no_large_finite_value():
    """min and max instead of an elementwise mask: NaN anywhere, +inf or -inf anywhere, in every float dtype,
    is flagged; values near the dtype's limit (whose sum would overflow) are not; integers are not checked."""
    from trainer.checkpoint.commit import nonfinite_flags

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        big = torch.finfo(dtype).max
        state = {"finite": torch.full((1000,), big, dtype=dtype), "low": torch.full((5,), -big, dtype=dtype)}
        for bad in (float("nan"), float("inf"), -float("inf")):
            for where in (0, 499, 999):
                value = torch.randn(1000).to(dtype)
                value[where] = bad
                state[f"{bad}@{where}"] = value
        state["nan_and_inf"] = torch.tensor([float("inf"), 1.0, float("nan")], dtype=dtype)
        state["ints"] = torch.arange(4)
        paths, flags = nonfinite_flags(state, torch.device("cpu"))
        assert dict(zip(paths, flags.tolist())) == {path: path not in ("finite", "low") for path in paths}, dtype
        assert "ints" not in paths and len(paths) == 12


def test_the_finite_check_stacks_flags_of_tensors_on_different_devices():
    """On a GPU the state mixes devices: the shards on the GPU, AdamW's step counts and the last loss on the host
    (the first H200 run failed its first save on it). The meta device stands in for the GPU here."""
    from trainer.checkpoint.commit import nonfinite_flags

    device = torch.device("meta")
    state = {"model": {"w": torch.empty(4, device=device)}, "optim": {"w": {"step": torch.tensor(3.0)}},
             "trainer": {"last_loss": torch.tensor(float("nan"))}, "rng": {"cpu": torch.zeros(8, dtype=torch.uint8)}}
    paths, bad = nonfinite_flags(state, device)
    assert paths == ["model.w", "optim.w.step", "trainer.last_loss"] and bad.shape == (3,) and bad.device == device
    paths, bad = nonfinite_flags({k: v for k, v in state.items() if k != "model"}, torch.device("cpu"))
    assert bad.tolist() == [False, True]


def _dcp_save(folder, writer, state):
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(folder), storage_writer=writer, no_dist=True)


@pytest.mark.parametrize("thread_count", [1, 2])
def test_a_commit_takes_the_writers_digests_and_reads_no_shard_again(tmp_path, thread_count):
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import reads
    from trainer.checkpoint.format import hash_file
    from trainer.checkpoint.hashing_writer import WRITTEN_DIGESTS, HashingFileSystemWriter

    folder = tmp_path / "step-000007.tmp"
    state = {"model": {f"w{i}": torch.randn(64, 32) for i in range(6)}, "step": 7, "note": "bytes item"}
    _dcp_save(folder, HashingFileSystemWriter(str(folder), thread_count=thread_count), state)
    assert (folder / WRITTEN_DIGESTS).is_file()

    before = reads.bytes_read()
    manifest = write_manifest(folder, 7, {"world_size": 1})
    assert reads.bytes_read() == before  # nothing read to commit
    assert not (folder / WRITTEN_DIGESTS).exists()
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert sorted(manifest["files"]) == on_disk and len(on_disk) == 1 + thread_count  # .metadata + the shards
    for name, entry in manifest["files"].items():  # the writers' digests are the files' own
        assert entry == {"bytes": (folder / name).stat().st_size, "hash": hash_file(folder / name)}, name
    assert verify_checkpoint(folder).ok
    loaded = {"model": {f"w{i}": torch.zeros(64, 32) for i in range(6)}, "step": 0, "note": ""}
    dcp.load(loaded, checkpoint_id=str(folder), no_dist=True)
    assert torch.equal(loaded["model"]["w3"], state["model"]["w3"]) and loaded["note"] == "bytes item"


def test_a_file_changed_after_its_writer_hashed_it_is_not_committed(tmp_path):
    from trainer.checkpoint.format import CheckpointError
    from trainer.checkpoint.hashing_writer import HashingFileSystemWriter

    folder = tmp_path / "step-000007.tmp"
    _dcp_save(folder, HashingFileSystemWriter(str(folder)), {"w": torch.randn(128)})
    with (folder / "__0_0.distcp").open("ab") as handle:
        handle.write(b"appended after the write")
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: \d+ bytes on disk, its writer wrote \d+"):
        write_manifest(folder, 7, {"world_size": 1})
    assert not (folder / MANIFEST).exists()


def test_files_no_writer_hashed_are_hashed_at_the_commit(tmp_path):
    """A folder written by plain DCP (or by hand) leaves no digests: the commit reads those files."""
    from torch.distributed.checkpoint import FileSystemWriter

    from trainer.checkpoint import reads

    folder = tmp_path / "step-000007.tmp"
    _dcp_save(folder, FileSystemWriter(str(folder)), {"w": torch.randn(128)})
    before = reads.bytes_read()
    manifest = write_manifest(folder, 7, {"world_size": 1})
    assert reads.bytes_read() - before == sum(f["bytes"] for f in manifest["files"].values())
    assert verify_checkpoint(folder).ok


def test_nvrx_async_writer_hashes_its_shards_in_its_worker_and_the_commit_reads_none(tmp_path):
    """The GPU default (NVRx's FileSystemWriterAsync, through the backend's own calls): its forked writer processes
    hash each shard as they write it, and the commit takes those digests. Run on CPU tensors here, the save
    function called as NVRx's checkpoint worker calls it (its preload step is CUDA's device-to-host copy)."""
    pytest.importorskip("nvidia_resiliency_ext")
    import torch.distributed.checkpoint as dcp
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_finalize

    from trainer.checkpoint import reads
    from trainer.checkpoint.format import hash_file
    from trainer.checkpoint.hashing_writer import WRITTEN_DIGESTS, hashing_async_writer
    from trainer.resilience import nvrx_compat

    import pickle  # NVRx's worker queue pickles the save function

    import torch.distributed as dist

    folder = tmp_path / "step-000007.tmp"
    state = {"model": {f"w{i}": torch.randn(64, 32) for i in range(6)}, "step": 7, "note": "bytes item"}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        writer = hashing_async_writer(nvrx_compat.filesystem_writer_async_class())(str(folder), thread_count=2)
        plan = nvrx_compat.plan_async_save(state, writer)
        save_fn, _preload, args = writer.get_save_function_and_args()
        assert pickle.dumps(save_fn)  # NVRx's persistent worker receives it through a queue
        save_fn(*args)  # forks a writer process per bucket
        save_state_dict_async_finalize(*plan)
    finally:
        dist.destroy_process_group()
    written = json.loads((folder / WRITTEN_DIGESTS).read_text())["files"]
    shards = sorted(p.name for p in folder.glob("*.distcp"))
    assert sorted(written) == shards and len(shards) == 2 and not list(folder.glob("*.json"))[1:], written

    before = reads.bytes_read()
    manifest = write_manifest(folder, 7, {"world_size": 1})
    assert reads.bytes_read() - before == (folder / ".metadata").stat().st_size  # only .metadata: no shard read
    for name, entry in manifest["files"].items():  # the digests are the files' own
        assert entry == {"bytes": (folder / name).stat().st_size, "hash": hash_file(folder / name)}, name
    assert sorted(manifest["files"]) == sorted([".metadata", *shards])
    loaded = {"model": {f"w{i}": torch.zeros(64, 32) for i in range(6)}, "step": 0, "note": ""}
    dcp.load(loaded, checkpoint_id=str(folder), no_dist=True)
    assert torch.equal(loaded["model"]["w3"], state["model"]["w3"]) and loaded["note"] == "bytes item"
