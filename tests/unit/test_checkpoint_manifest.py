import json

import pytest

from trainer.checkpoint import (MANIFEST, committed_checkpoints, latest_valid_checkpoint, step_dir_name,
                                verify_checkpoint, write_manifest)


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
