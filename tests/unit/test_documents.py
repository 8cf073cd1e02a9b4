"""Documents as users have them: JSON lines (plain, gzip, zstd) with their own text field, parquet, text; bad
files named with the line or the compressed byte where they go wrong."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from trainer.data import documents as documents_module
from trainer.data.documents import DataError, document_format, read_documents
from trainer.data.shards import tokenize_files

TEXTS = [f"document {i}: " + "words " * (i % 7) for i in range(500)]


def _jsonl(texts, field="content") -> bytes:
    return "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def _write_every_format(folder, field="content"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_bytes(_jsonl(TEXTS[:100], field))
    # Two gzip members and two zstd frames: what concatenated or appended files are.
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(TEXTS[100:150], field))
                                        + gzip.compress(_jsonl(TEXTS[150:200], field)))
    zstd = zstandard.ZstdCompressor()
    (folder / "c.jsonl.zst").write_bytes(zstd.compress(_jsonl(TEXTS[200:250], field))
                                         + zstd.compress(_jsonl(TEXTS[250:300], field)))
    pq.write_table(pa.table({field: TEXTS[300:400], "id": list(range(100))}), folder / "d.parquet")
    (folder / "e.txt").write_text("\n\n".join(TEXTS[400:]))
    return sorted(folder.iterdir())


def test_every_format_gives_its_documents_in_file_order(tmp_path):
    files = _write_every_format(tmp_path)
    assert list(read_documents(files, "content")) == [t.strip() if i >= 400 else t for i, t in enumerate(TEXTS)]


def test_formats_are_told_by_the_whole_suffix():
    assert [document_format(name) for name in ("x.jsonl", "x.JSONL.GZ", "x.jsonl.zst", "x.parquet", "x.txt")] == \
        [".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt"]
    assert [document_format(name) for name in ("_SUCCESS", "x.csv", "x.json.gz", "x.gz", "README.md")] == [None] * 5


def test_compressed_corpora_are_cut_into_chunks_of_whole_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(documents_module, "CHUNK_CHARS", 200)  # many chunks from one file
    monkeypatch.setattr(documents_module, "_COMPRESSED_BLOCK", 64)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(TEXTS)))
    chunks = list(documents_module.text_chunks([tmp_path / "a.jsonl.gz"], "content"))
    assert len(chunks) > 10
    assert [t for c in chunks for t in documents_module.documents(c, "content")] == TEXTS


def test_the_same_documents_tokenize_to_the_same_tokens_whatever_the_format(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.jsonl").write_bytes(_jsonl(TEXTS))
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(TEXTS)))
    first = tokenize_files([plain / "a.jsonl"], tmp_path / "t1", 0.1, text_field="content")
    tokenize_files([packed / "a.jsonl.zst"], tmp_path / "t2", 0.1, text_field="content")
    for split in ("train", "val"):
        assert np.array_equal(np.fromfile(tmp_path / "t1" / f"{split}.bin", dtype=np.uint16),
                              np.fromfile(tmp_path / "t2" / f"{split}.bin", dtype=np.uint16))
    assert first["text_field"] == "content"


def test_the_text_field_is_part_of_the_cache_key(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "title": t.upper()}) + "\n" for t in TEXTS))
    by_text = tokenize_files([tmp_path / "a.jsonl"], tmp_path / "t", 0.1)
    by_title = tokenize_files([tmp_path / "a.jsonl"], tmp_path / "t", 0.1, text_field="title")
    assert by_text["content_hash"] != by_title["content_hash"]
    train = np.fromfile(tmp_path / "t" / "train.bin", dtype=np.uint16)  # tokenized again, from the titles
    assert ord("D") in train and ord("d") not in train


def test_a_missing_text_field_names_the_file_the_line_and_the_setting(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(TEXTS[:3]) + b'{"body": "x"}\n'))
    with pytest.raises(DataError, match=r"a.jsonl.gz:4: no 'content' field \(data.text_field\), found \['body'\]"):
        list(read_documents([tmp_path / "a.jsonl.gz"], "content"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet: no 'content' column \(data.text_field\); its columns: \['body'\]"):
        list(read_documents([tmp_path / "b.parquet"], "content"))


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_corrupt_stream_names_the_file_and_the_compressed_byte(tmp_path, suffix):
    body = _jsonl(TEXTS * 20)
    data = bytearray(gzip.compress(body) if suffix == ".jsonl.gz" else zstandard.ZstdCompressor().compress(body))
    where = len(data) // 2
    data[where:where + 16] = bytes(16)
    path = tmp_path / f"a{suffix}"
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as raised:
        list(read_documents([path], "content"))
    message = str(raised.value)
    assert str(path) in message
    first, last = (int(n) for n in message.split("compressed bytes ")[1].split(" ")[0].split("-"))
    assert first <= where < last and last - first <= documents_module._COMPRESSED_BLOCK


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_stream_cut_short_says_so(tmp_path, suffix):
    body = _jsonl(TEXTS)
    data = gzip.compress(body) if suffix == ".jsonl.gz" else zstandard.ZstdCompressor().compress(body)
    path = tmp_path / f"a{suffix}"
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(DataError, match=rf"a{suffix}: the (gzip|zstd) stream ends mid-stream at compressed byte "
                                        rf"{len(data) - 40} \(the file is cut short\)"):
        list(read_documents([path], "content"))


def test_a_file_of_no_document_format_is_refused_by_the_tokenizer(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="notes.csv: not a document format"):
        tokenize_files([tmp_path / "notes.csv"], tmp_path / "t", 0.1)
