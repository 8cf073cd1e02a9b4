import json

import numpy as np
import pytest

from trainer.data.batches import TokenBatches
from trainer.data.shards import DataError, is_held_out, tokenize_files
from trainer.data.tokenizer import TokenizerError, load_tokenizer


def test_byte_tokenizer_ids_are_bytes_framed_by_bos_and_eos():
    tokenizer = load_tokenizer("byte")
    text = "héllo wörld ✓\n\n  x"
    [ids] = tokenizer.encode_documents([text])
    assert ids == [256, *text.encode("utf-8"), 257]
    assert tokenizer.vocab_size == 258
    assert tokenizer.decode(ids) == text


def test_saved_byte_tokenizer_loads_in_transformers_and_from_its_folder(tmp_path):
    from transformers import AutoTokenizer

    load_tokenizer("byte").save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert hf("abc", add_special_tokens=False)["input_ids"] == [97, 98, 99]
    again = load_tokenizer(str(tmp_path))
    assert again.encode_documents(["ab"]) == [[256, 97, 98, 257]]


def test_tokenizer_folder_without_tokenizer_json_is_named(tmp_path):
    with pytest.raises(TokenizerError, match="data.tokenizer: .*tokenizer.json not found"):
        load_tokenizer(str(tmp_path))


def test_split_is_deterministic_and_roughly_the_fraction():
    documents = [f"document number {i}" for i in range(4000)]
    held = [d for d in documents if is_held_out(d, 0.1)]
    assert held == [d for d in documents if is_held_out(d, 0.1)]
    assert 300 < len(held) < 500


def _write_corpus(folder, count=300):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": f"story {i} about a cat."}) + "\n"
                                            for i in range(count)))
    (folder / "b.txt").write_text("\n\n".join(f"plain text document {i}." for i in range(count)))
    return sorted(folder.iterdir())


def test_tokenize_writes_shards_and_reuses_them_when_unchanged(tmp_path):
    files = _write_corpus(tmp_path / "raw")
    out = tmp_path / "tokens"
    meta = tokenize_files(files, out, 0.1)
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert len(train) == meta["splits"]["train"]["tokens"] > 0
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 600
    mtime = (out / "train.bin").stat().st_mtime_ns

    assert tokenize_files(files, out, 0.1)["content_hash"] == meta["content_hash"]
    assert (out / "train.bin").stat().st_mtime_ns == mtime  # not rewritten

    (tmp_path / "raw" / "b.txt").write_text("a changed document.\n\nand another one.")
    assert tokenize_files(files, out, 0.1)["content_hash"] != meta["content_hash"]


def test_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no 'text' field \(data.text_field\), found \['body'\]"):
        tokenize_files([path], tmp_path / "out", 0.1)


def test_batches_depend_only_on_seed_and_the_sample_indices(tmp_path):
    tokenize_files(_write_corpus(tmp_path / "raw"), tmp_path / "tok", 0.1)
    batches = TokenBatches.open(tmp_path / "tok", "train", seq_len=16, batch_size=4, seed=7)
    x1, y1 = batches.batch(first_sample=40, micro_step=0, rank=1, ranks=2)
    x2, y2 = TokenBatches.open(tmp_path / "tok", "train", 16, 4, seed=7).batch(40, 0, 1, 2)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(x1[:, 1:], y1[:, :-1])  # labels are inputs shifted by one
    assert not np.array_equal(x1, batches.batch(40, 0, 0, 2)[0])  # ranks see different data
    np.testing.assert_array_equal(x1, batches.samples(np.arange(44, 48))[0])  # rank 1's slice of the step
    assert not np.array_equal(x1, TokenBatches.open(tmp_path / "tok", "train", 16, 4, seed=8).batch(40, 0, 1, 2)[0])
    assert x1.shape == (4, 16) and x1.dtype == np.int64


def test_missing_shards_say_to_stage_first(tmp_path):
    with pytest.raises(DataError, match="stage the dataset first"):
        TokenBatches.open(tmp_path, "train", 16, 4, 0)


def _previous_shards(files, val_fraction, tokenizer="byte"):
    """The shard bytes as trainer/data/shards.py wrote them before streaming (commit 697ccd4): every document read
    at once, split by content, encoded by the HF tokenizer; kept here as the reference the format must match."""
    documents = []
    for path in sorted(files):
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as handle:
                documents += [json.loads(line)["text"] for line in handle if line.strip()]
        elif path.suffix == ".txt":
            documents += [b.strip() for b in path.read_text(encoding="utf-8").split("\n\n") if b.strip()]
    loaded = load_tokenizer(tokenizer)
    out = {}
    for split, held in (("train", False), ("val", True)):
        docs = [d for d in documents if is_held_out(d, val_fraction) == held]
        out[split] = b"".join(np.asarray(ids, dtype=np.uint16).tobytes() for ids in loaded.encode_documents(docs))
    return out


def _awkward_corpus(folder):
    folder.mkdir(parents=True, exist_ok=True)
    texts = [f"story {i}: héllo wörld ✓ {'x' * (i % 37)}" for i in range(400)]
    texts[7] = "spells the tokens <|bos|> and <|eos|> inside"
    texts[8] = "  leading and trailing spaces  "
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" + ("\n" if i % 50 == 0 else "")
                                            for i, t in enumerate(texts)))
    blocks = [f"plain 文書 {i}\nsecond line" for i in range(300)]
    (folder / "b.txt").write_bytes("\r\n\r\n\n".join(blocks[:150]).encode() + b"\n\n\n\n"
                                   + "\n\n".join(blocks[150:]).encode())
    return sorted(folder.iterdir())


@pytest.mark.parametrize("workers", [1, 2])
def test_streamed_shards_are_byte_identical_to_the_previous_format(tmp_path, monkeypatch, workers):
    """Small chunks (cut inside runs of blank lines, CRLF files) and 1 or 2 worker processes: same bytes."""
    import trainer.data.shards  # the chunk size is a module constant

    files = _awkward_corpus(tmp_path / "raw")
    monkeypatch.setattr(trainer.data.shards, "CHUNK_CHARS", 97)
    meta = tokenize_files(files, tmp_path / "tokens", 0.2, workers=workers)
    expected = _previous_shards(files, 0.2)
    for split in ("train", "val"):
        assert (tmp_path / "tokens" / f"{split}.bin").read_bytes() == expected[split], split
        assert meta["splits"][split]["tokens"] * 2 == len(expected[split])
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 700


def test_byte_fast_path_matches_the_hf_tokenizer():
    tokenizer = load_tokenizer("byte")
    documents = ["", "a", "héllo ✓", "x<|eos|>y", "\x00\n\t", "😀" * 3]
    expected = np.concatenate([np.asarray(ids, dtype=np.uint16) for ids in tokenizer.encode_documents(documents)])
    np.testing.assert_array_equal(tokenizer.encode_to_array(documents, np.dtype(np.uint16)), expected)
    # Without a special token's spelling in the batch, the numpy path runs (the first batch took the HF one).
    plain = documents[:3] + documents[4:]
    expected = np.concatenate([np.asarray(ids, dtype=np.uint16) for ids in tokenizer.encode_documents(plain)])
    np.testing.assert_array_equal(tokenizer.encode_to_array(plain, np.dtype(np.uint16)), expected)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_tokenization_names_the_line_and_leaves_no_shards(tmp_path, monkeypatch, workers):
    import trainer.data.shards  # the chunk size is a module constant

    monkeypatch.setattr(trainer.data.shards, "CHUNK_CHARS", 40)  # the bad line sits in a later chunk than the first
    path = tmp_path / "raw" / "bad.jsonl"
    path.parent.mkdir()
    path.write_text('{"text": "ok"}\n' * 10 + "not json\n" + '{"text": "ok"}\n' * 10)
    with pytest.raises(DataError, match=r"bad.jsonl:11:"):
        tokenize_files([path], tmp_path / "out", 0.1, workers=workers)
    assert not any((tmp_path / "out").iterdir())


def test_byte_table_is_transformers_own():
    from transformers.convert_slow_tokenizer import bytes_to_unicode as theirs

    from trainer.data.tokenizer import bytes_to_unicode

    assert bytes_to_unicode() == theirs()


def test_a_split_in_several_shards_reads_as_their_concatenation(tmp_path):
    """tokens.json may list a split as several files (one per tokenizing task): the batches are those of the
    single file they concatenate to, windows across shard boundaries included."""
    import shutil

    # the same corpus name in both (a corpus's sample order is keyed by its name and content: trainer.data.samples)
    one, many = tmp_path / "one" / "corpus", tmp_path / "many" / "corpus"
    tokenize_files(_write_corpus(tmp_path / "raw"), one, 0.1)
    meta = json.loads((one / "tokens.json").read_text())
    train = np.fromfile(one / "train.bin", dtype=np.uint16)
    many.mkdir(parents=True)
    cuts = [0, 7, 7, 1000, 1003, len(train)]  # an empty shard and a 3-token one among them
    names = []
    for index, (start, stop) in enumerate(zip(cuts, cuts[1:])):
        names.append(f"train-{index:05d}.bin")
        (many / names[-1]).write_bytes(train[start:stop].tobytes())
    shutil.copy(one / "val.bin", many / "val.bin")
    meta["splits"]["train"] = {**meta["splits"]["train"], "files": names}
    del meta["splits"]["train"]["file"]
    (many / "tokens.json").write_text(json.dumps(meta))

    single = TokenBatches.open(one, "train", seq_len=16, batch_size=4, seed=7)
    sharded = TokenBatches.open(many, "train", seq_len=16, batch_size=4, seed=7)
    assert len(sharded.corpora[0].tokens) == len(train)
    for start in (0, 990, 995, 1000, 1001, 1002, len(train) - 17):  # across each boundary
        np.testing.assert_array_equal(sharded.corpora[0].tokens[start:start + 17], train[start:start + 17])
    for step in range(20):
        for a, b in zip(single.batch(8 * step, 0, 1, 2), sharded.batch(8 * step, 0, 1, 2)):
            np.testing.assert_array_equal(a, b)
    for (a, _), (b, _) in zip(single.sequential(8), sharded.sequential(8)):
        np.testing.assert_array_equal(a, b)

    (many / names[3]).unlink()
    with pytest.raises(DataError, match="train-00003.bin, which does not exist"):
        TokenBatches.open(many, "train", seq_len=16, batch_size=4, seed=7)


def test_document_mask_restarts_positions_at_each_documents_bos(tmp_path):
    """data.document_mask: a pre-training window's position_ids restart at every BOS (each document attends only
    to itself, trainer.data.conversations.positions_from_starts); without it a window is (inputs, labels) alone."""
    raw = tmp_path / "docs.jsonl"
    raw.write_text("".join(json.dumps({"text": f"document {i} " + "x" * (i % 7)}) + "\n" for i in range(300)))
    tokenize_files([raw], tmp_path / "tok", 0.1)
    plain = TokenBatches.open(tmp_path / "tok", "train", 32, 4, seed=3)
    masked = TokenBatches.open(tmp_path / "tok", "train", 32, 4, seed=3)
    masked.document_start = load_tokenizer("byte").bos_id
    assert len(plain.samples(np.arange(4))) == 2 and not masked.masks_targets
    inputs, labels, positions = masked.samples(np.arange(4))
    np.testing.assert_array_equal(inputs, plain.samples(np.arange(4))[0])
    for row, where in zip(inputs, positions):
        starts = [0, *np.flatnonzero(row == 256)]
        expected = np.arange(32) - np.maximum.accumulate(np.isin(np.arange(32), starts) * np.arange(32))
        np.testing.assert_array_equal(where, expected)
        assert (where[row == 256] == 0).all() and len(starts) > 1
