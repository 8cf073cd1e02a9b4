"""Tokenization fanned out over file groups (components/stage/shards.py): any number of tasks writes the
tokens, counts and content hash one task writes, and the trainer reads the set as that one split."""

import json
import shutil

import numpy as np
import pytest

from components.stage.shards import SHARDS_DIR, collect_shards, plan_groups, tokenize_group
from trainer.data.batches import TokenBatches
from trainer.data.shards import META_FILE, DataError, tokenize_files


def _corpus(folder, files=7):
    """Files of very different sizes and kinds (the groups' byte balance has something to do)."""
    folder.mkdir(parents=True)
    for index in range(files):
        count = 20 + 90 * (index % 3)
        if index % 2:
            (folder / f"part-{index:02d}.jsonl").write_text(
                "".join(json.dumps({"text": f"file {index} story {i} about a cat."}) + "\n" for i in range(count)))
        else:
            (folder / f"part-{index:02d}.txt").write_text("\n\n".join(f"file {index} document {i}." for i in range(count)))
    return sorted(folder.iterdir())


def _fan_out(files, dataset, tasks, val_fraction=0.1):
    groups = plan_groups(files, dataset, tasks)
    shards = [tokenize_group(json.loads(json.dumps(g)), dataset, val_fraction, "byte") for g in reversed(groups)]
    return groups, collect_shards(shards, dataset, val_fraction, "byte")  # (collected in any order)


def _split_bytes(dataset, meta, split):
    return b"".join((dataset / name).read_bytes() for name in meta["splits"][split]["files"])


@pytest.mark.parametrize("tasks", [1, 2, 3, 7, 50])
def test_any_number_of_tasks_writes_what_one_task_writes(tmp_path, tasks):
    files = _corpus(tmp_path / "ds" / "raw")
    single = tokenize_files(files, tmp_path / "single" / "ds", 0.1)  # the same corpus name: the same sample order
    groups, meta = _fan_out(files, tmp_path / "ds", tasks)

    assert len(groups) == len(meta["shards"]) == min(tasks, len(files))
    assert [name for g in groups for name in g["files"]] == [f"raw/{f.name}" for f in files]  # whole files, in order
    assert meta["content_hash"] == single["content_hash"]
    for split in ("train", "val"):
        assert _split_bytes(tmp_path / "ds", meta, split) == (tmp_path / "single" / "ds" / f"{split}.bin").read_bytes()
        assert {k: meta["splits"][split][k] for k in ("tokens", "documents")} == \
            {k: single["splits"][split][k] for k in ("tokens", "documents")}
    on_disk = json.loads((tmp_path / "ds" / META_FILE).read_text())
    assert on_disk["splits"] == meta["splits"] and on_disk["shards"] == meta["shards"]
    sharded = TokenBatches.open(tmp_path / "ds", "train", seq_len=16, batch_size=4, seed=3)
    whole = TokenBatches.open(tmp_path / "single" / "ds", "train", seq_len=16, batch_size=4, seed=3)
    for step in range(10):
        np.testing.assert_array_equal(sharded.batch(8 * step, 0, 0, 2)[0], whole.batch(8 * step, 0, 0, 2)[0])


def test_groups_balance_bytes_and_never_split_a_file(tmp_path):
    raw = tmp_path / "ds" / "raw"
    raw.mkdir(parents=True)
    for name, size in [("a.txt", 1000), ("b.txt", 10), ("c.txt", 10), ("d.txt", 990), ("e.txt", 5), ("f.txt", 5)]:
        (raw / name).write_text("x" * size)
    groups = plan_groups(sorted(raw.iterdir()), tmp_path / "ds", 2)
    assert [g["files"] for g in groups] == [["raw/a.txt", "raw/b.txt"], ["raw/c.txt", "raw/d.txt", "raw/e.txt",
                                                                        "raw/f.txt"]]  # 1,010 bytes each
    one_huge = plan_groups(sorted(raw.iterdir()), tmp_path / "ds", 6)
    assert [len(g["files"]) for g in one_huge] == [1] * 6 and {g["count"] for g in one_huge} == {6}


def test_changing_the_task_count_replaces_the_shards_and_the_old_layout(tmp_path):
    """A dataset tokenized by an older version (train.bin beside raw/) or with another tokenize_tasks keeps no
    stale shards: the disk holds one copy of the tokens."""
    dataset = tmp_path / "ds"
    files = _corpus(dataset / "raw")
    tokenize_files(files, dataset, 0.1)  # the single-file layout of versions before the fan-out
    _, three = _fan_out(files, dataset, 3)
    assert not (dataset / "train.bin").exists() and len(list((dataset / SHARDS_DIR).iterdir())) == 3
    _, two = _fan_out(files, dataset, 2)
    assert sorted(p.name for p in (dataset / SHARDS_DIR).iterdir()) == ["00000-of-00002", "00001-of-00002"]
    assert two["content_hash"] == three["content_hash"]
    assert _split_bytes(dataset, two, "train") == _split_bytes(tmp_path / "ds", two, "train")


def test_a_missing_or_rewritten_shard_is_named(tmp_path):
    dataset = tmp_path / "ds"
    files = _corpus(dataset / "raw")
    groups = plan_groups(files, dataset, 3)
    shards = [tokenize_group(g, dataset, 0.1, "byte") for g in groups]
    with pytest.raises(DataError, match=r"one token shard per tokenize group, got groups \[\(0, 3\), \(2, 3\)\]"):
        collect_shards([shards[0], shards[2]], dataset, 0.1, "byte")
    shutil.rmtree(dataset / shards[1]["dir"])
    with pytest.raises(DataError, match="00001-of-00003/tokens.json not found"):
        collect_shards(shards, dataset, 0.1, "byte")
    tokenize_group(groups[1], dataset, 0.2, "byte")  # the same folder, other settings
    with pytest.raises(DataError, match="00001-of-00003/tokens.json changed after its tokenize task wrote it"):
        collect_shards(shards, dataset, 0.1, "byte")
    (dataset / groups[2]["files"][0]).unlink()
    with pytest.raises(DataError, match=r"part-06.txt \(tokenize group 2 of 3\) does not exist"):
        tokenize_group(groups[2], dataset, 0.1, "byte")


def test_a_shard_may_miss_a_split_but_the_corpus_may_not(tmp_path):
    dataset = tmp_path / "ds"
    raw = dataset / "raw"
    raw.mkdir(parents=True)
    (raw / "a.txt").write_text("\n\n".join(f"document {i}" for i in range(200)))
    (raw / "b.txt").write_text("only one document")  # its group holds no held-out document
    groups, meta = _fan_out(sorted(raw.iterdir()), dataset, 2)
    assert json.loads((dataset / meta["shards"][1] / META_FILE).read_text())["splits"]["val"]["documents"] == 0
    assert meta["splits"]["val"]["documents"] > 0
    (raw / "a.txt").write_text("tiny")
    with pytest.raises(DataError, match="the val split is empty"):
        _fan_out(sorted(raw.iterdir()), dataset, 2)
