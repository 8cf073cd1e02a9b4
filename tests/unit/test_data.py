import json

import numpy as np
import pytest

from trainer.data import DataError, TokenBatches, is_held_out, tokenize_files
from trainer.tokenizer import TokenizerError, load_tokenizer


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
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a JSON object with a 'text' field"):
        tokenize_files([path], tmp_path / "out", 0.1)


def test_batches_depend_only_on_seed_step_micro_and_rank(tmp_path):
    tokenize_files(_write_corpus(tmp_path / "raw"), tmp_path / "tok", 0.1)
    batches = TokenBatches.open(tmp_path / "tok", "train", seq_len=16, batch_size=4, seed=7)
    x1, y1 = batches.batch(step=5, micro_step=0, rank=1)
    x2, y2 = TokenBatches.open(tmp_path / "tok", "train", 16, 4, seed=7).batch(5, 0, 1)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(x1[:, 1:], y1[:, :-1])  # labels are inputs shifted by one
    assert not np.array_equal(x1, batches.batch(5, 0, 0)[0])  # ranks see different data
    assert x1.shape == (4, 16) and x1.dtype == np.int64


def test_missing_shards_say_to_stage_first(tmp_path):
    with pytest.raises(DataError, match="stage the dataset first"):
        TokenBatches.open(tmp_path, "train", 16, 4, 0)
