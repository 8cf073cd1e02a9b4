"""trainer/checkpoint/fast_reader.py: the same state as DCP's own reader, one read pass, verified, bounded.

The decoder reads torch.save's zip format itself (torch/serialization.py: ``archive/data.pkl``, ``byteorder``,
``data/<key>`` stored uncompressed); these tests pin it to the torch this project installs (constraints.txt)
and check that anything unknown goes through DCP's own path instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import fast_reader, reads, tensor_decode
from trainer.checkpoint.fast_reader import FastReader, Window, plan_windows, verifier_of
from trainer.checkpoint.format import CheckpointError, write_manifest
from trainer.checkpoint.load import load_checkpoint
from trainer.checkpoint.tensor_decode import decode_tensor


def _state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {"weight": torch.randn(64, 33, generator=generator),
                  "bf16": torch.randn(17, 5, generator=generator).to(torch.bfloat16),
                  "ids": torch.arange(40, dtype=torch.int64), "mask": torch.rand(9, generator=generator) > 0.5,
                  "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
                  "view": torch.randn(8, 8, generator=generator)[2:6, 1::2]},
        "meta": {"step": 12, "name": "run-a"},
    }


def _zeros_like(state):
    if isinstance(state, dict):
        return {key: _zeros_like(value) for key, value in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state.contiguous())
    return None


def _committed(tmp_path, state=None):
    folder = tmp_path / "step-000012"
    dcp.save(state or _state(), checkpoint_id=str(folder), no_dist=True)
    write_manifest(folder, 12, {"world_size": 1})
    return folder


def _assert_same(loaded, expected):
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_same(loaded[key], value)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def test_loads_what_dcp_saved_without_falling_back(tmp_path):
    folder = _committed(tmp_path)
    target = _zeros_like(_state())
    target["meta"] = {"step": 0, "name": ""}
    reader = FastReader(folder)
    before = reads.bytes_read()
    dcp.load(target, storage_reader=reader, no_dist=True)
    _assert_same(target, _state())
    assert reader.stats["items_fallback"] == 0 and reader.stats["files_verified"] == 1
    data_bytes = sum(p.stat().st_size for p in folder.glob("*.distcp"))
    # One pass: each data byte once (verification and load share it), plus .metadata.
    assert reads.bytes_read() - before == data_bytes + (folder / ".metadata").stat().st_size


def test_same_result_as_dcps_reader_with_small_windows(tmp_path):
    folder = _committed(tmp_path)
    ours, theirs = _zeros_like(_state()), _zeros_like(_state())
    dcp.load(ours, storage_reader=FastReader(folder, window_bytes=300, prefetch_windows=1), no_dist=True)
    dcp.load(theirs, checkpoint_id=str(folder), no_dist=True)
    _assert_same(ours, theirs)


def test_corrupt_data_file_names_the_file(tmp_path):
    folder = _committed(tmp_path)
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: content hash .* \(rank 0\)"):
        load_checkpoint(_zeros_like(_state()), folder, no_dist=True)
    # Without verification (a folder with no manifest, a peer's own copy) the same bytes load.
    (folder / "manifest.json").unlink()
    dcp.load(_zeros_like(_state()), storage_reader=FastReader(folder), no_dist=True)


def test_corrupt_metadata_is_not_unpickled(tmp_path):
    folder = _committed(tmp_path)
    metadata = folder / ".metadata"
    metadata.write_bytes(b"\x80\x04garbage" + metadata.read_bytes()[12:])
    with pytest.raises(CheckpointError, match=r"\.metadata: content hash"):
        FastReader(folder).read_metadata()


def test_a_truncated_file_is_named(tmp_path):
    folder = _committed(tmp_path)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: ends at byte 100.*truncated"):
        load_checkpoint(_zeros_like(_state()), folder, no_dist=True, verify=False)


def test_undecodable_items_go_through_dcps_path(tmp_path, monkeypatch):
    """Whatever the decoder does not know (a transform, an unknown pickle) is read by torch.load, as DCP does."""
    folder = _committed(tmp_path)

    def refuse(blob):
        raise tensor_decode.Undecodable("test")

    monkeypatch.setattr(fast_reader, "decode_tensor", refuse)
    target = _zeros_like(_state())
    target["meta"] = {"step": 0, "name": ""}
    reader = FastReader(folder)
    dcp.load(target, storage_reader=reader, no_dist=True)
    _assert_same(target, _state())
    assert reader.stats["items_fallback"] == reader.stats["items"] - 2 >= 6  # every tensor; the 2 values are pickles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
                                   torch.int32, torch.int64, torch.bool, torch.float64, torch.complex64])
def test_decode_is_a_view_of_the_buffer(tmp_path, dtype):
    import io  # only this test builds a torch.save blob by hand

    value = (torch.arange(24) % 7).to(dtype).reshape(4, 6)
    handle = io.BytesIO()
    torch.save(value, handle)
    blob = bytearray(handle.getvalue())
    decoded = decode_tensor(memoryview(blob))
    assert decoded.dtype == dtype and torch.equal(decoded, value)
    assert decoded.untyped_storage().data_ptr() >= torch.frombuffer(blob, dtype=torch.uint8).data_ptr()


def test_decode_refuses_what_is_not_one_tensor():
    import io  # only this test builds torch.save blobs by hand

    for value in ({"a": torch.ones(2)}, [torch.ones(2)], torch.ones(2).to_sparse()):
        handle = io.BytesIO()
        torch.save(value, handle)
        with pytest.raises(tensor_decode.Undecodable):
            decode_tensor(memoryview(bytearray(handle.getvalue())))


def test_pinned_torch_is_the_one_tested():
    assert torch.__version__.startswith(tensor_decode.TESTED_TORCH), (
        "fast_reader decodes torch.save's format itself: rerun these tests and update TESTED_TORCH")


def _check_windows(windows: list[Window], items, size, whole, window_bytes):
    placed = [entry for window in windows for entry in window.items]
    assert sorted(placed) == sorted(items)
    for window in windows:
        assert window.start < window.end or (not window.items and window.start == window.end)
        assert all(window.start <= o and o + n <= window.end for o, n, _ in window.items)
        assert window.end - window.start <= max([window_bytes] + [n for _, n, _ in window.items])
    if whole:
        assert windows[0].start == 0 and windows[-1].end == size
        assert all(a.end == b.start for a, b in zip(windows, windows[1:]))


@pytest.mark.parametrize("whole", [True, False])
def test_windows_cover_items_and_tile_a_verified_file(whole):
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        count = int(torch.randint(0, 12, (1,), generator=generator))
        lengths = torch.randint(1, 400, (count,), generator=generator).tolist()
        gaps = torch.randint(0, 300, (count + 1,), generator=generator).tolist()
        items, cursor = [], gaps[0]
        for index, length in enumerate(lengths):
            items.append((cursor, length, index))
            cursor += length + gaps[index + 1]
        size = cursor
        items = [items[i] for i in torch.randperm(count, generator=generator).tolist()]
        if not whole and not items:
            continue
        windows = plan_windows(items, size, whole_file=whole, window_bytes=500, merge_gap=100)
        _check_windows(windows, items, size, whole, 500)


def test_each_file_has_one_verifier():
    names = [f"__{rank}_0.distcp" for rank in range(8)]
    assert [verifier_of(name, i, 8) for i, name in enumerate(names)] == list(range(8))
    assert [verifier_of(name, i, 2) for i, name in enumerate(names)] == [0, 1] * 4
    assert verifier_of("extra.bin", 5, 4) == 1


def test_prefetch_verifies_this_ranks_files_of_the_newest_checkpoint_and_the_load_skips_them(tmp_path):
    from trainer.checkpoint.prefetch import RestorePrefetch

    older = _committed(tmp_path)
    newest = tmp_path / "step-000020"
    dcp.save(_state(), checkpoint_id=str(newest), no_dist=True)
    write_manifest(newest, 20, {"world_size": 1})
    prefetch = RestorePrefetch.start(tmp_path, rank=0, world_size=1, node_memory_holds_a_copy=False)
    assert prefetch.folder == newest and prefetch.verified_files(newest) == {"__0_0.distcp"}
    assert prefetch.verified_files(older) == set()
    assert prefetch.figures()["prefetch_bytes"] == (newest / "__0_0.distcp").stat().st_size
    reader = FastReader(newest, prehashed=prefetch.verified_files(newest))
    target = _zeros_like(_state())
    target["meta"] = {"step": 0, "name": ""}
    dcp.load(target, storage_reader=reader, no_dist=True)
    _assert_same(target, _state())
    assert reader.stats["files_verified"] == 0  # hashed once, by the prefetch
    # Rank 1 of 2 verifies nothing of a one-file checkpoint; a node holding a memory copy prefetches nothing.
    assert RestorePrefetch.start(tmp_path, rank=1, world_size=2, node_memory_holds_a_copy=False) is None
    assert RestorePrefetch.start(tmp_path, rank=0, world_size=1, node_memory_holds_a_copy=True) is None


def test_a_file_the_prefetch_found_corrupt_is_hashed_again_by_the_load_and_fails(tmp_path):
    from trainer.checkpoint.prefetch import RestorePrefetch

    folder = _committed(tmp_path)
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    prefetch = RestorePrefetch.start(tmp_path, rank=0, world_size=1, node_memory_holds_a_copy=False)
    assert prefetch.verified_files(folder) == set()
    with pytest.raises(CheckpointError, match="__0_0.distcp: content hash"):
        load_checkpoint(_zeros_like(_state()), folder, no_dist=True, prehashed=prefetch.verified_files(folder))


def test_an_unverified_load_still_refuses_a_metadata_file_that_does_not_match(tmp_path):
    """verify=False skips hashing the data files (already verified in this process), never the pickle check."""
    folder = _committed(tmp_path)
    metadata = folder / ".metadata"
    metadata.write_bytes(b"\x80\x04garbage" + metadata.read_bytes()[12:])
    with pytest.raises(CheckpointError, match=r"\.metadata: content hash"):
        FastReader(folder, verify=False).read_metadata()
