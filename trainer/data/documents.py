"""Documents from a corpus's files, streamed: JSON lines (plain, gzip or zstd), parquet and plain text.

    for chunk in text_chunks(files, "content"):         # whole documents, about CHUNK_CHARS each, in file order
        for text in documents(chunk, "content"): ...     # what a tokenizing worker does with one

| format | a document is | its text |
|---|---|---|
| ``.jsonl`` | a line (a JSON object) | the field ``text_field`` |
| ``.jsonl.gz``, ``.jsonl.zst`` | the same, compressed (several gzip members / zstd frames allowed) | the same |
| ``.parquet`` | a row | the column ``text_field`` (empty values skipped) |
| ``.txt`` | a block between blank lines, stripped | the block |

Every bad input is a DataError naming the file and where: the line of a line without the field, the byte of the
compressed file where a gzip or zstd stream is corrupt or cut short, the columns a parquet file has instead.
"""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

import orjson

from trainer.config.rules import InputError

DOCUMENT_FORMATS = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt")
CHUNK_CHARS = 4 << 20  # text per tokenization task: bounds memory (a few tasks in flight), amortises a task's cost
_COMPRESSED_BLOCK = 64 << 10  # compressed bytes fed at a time: a corrupt stream is located within this


class DataError(InputError):
    """Documents or token data missing, malformed or too small for the requested batches; the message names the
    file."""


class Chunk(NamedTuple):
    """One tokenization task: whole documents of one file. kind: 'jsonl' (a byte range start..payload of the
    file, read by the task), 'lines' (decompressed JSON lines; start: the number of the first), 'texts' (parquet
    values) or 'txt' (text cut at a blank line)."""

    kind: str
    path: Path
    start: int
    payload: Any


def document_format(path: Path) -> str | None:
    """The format of a file by its name (one of DOCUMENT_FORMATS), None for anything else."""
    name = Path(path).name.lower()
    return next((suffix for suffix in DOCUMENT_FORMATS if name.endswith(suffix)), None)


def text_chunks(files: list[Path], text_field: str, columns: tuple[str, ...] | None = None) -> Iterator[Chunk]:
    """The corpus as tasks of whole documents, in document order, each about CHUNK_CHARS. Nothing holds more.
    `columns`: a fine-tuning corpus's fields (its parquet files' chunks are rows of them, read by `records`)."""
    for path in sorted(files):
        kind = document_format(path)
        if kind == ".parquet" and columns:
            yield from _parquet_rows(path, columns)
        elif kind == ".parquet":
            yield from _parquet_chunks(path, text_field)
        elif kind == ".txt" and columns:
            raise DataError(f"{path}: a fine-tuning corpus (data.format) is JSON lines or parquet records, not "
                            "plain text")
        elif kind == ".jsonl":
            # Byte ranges of whole lines: the task reads its own range, so no text passes through this process.
            with path.open("rb") as handle:
                size, start = path.stat().st_size, 0
                while start < size:
                    handle.seek(start + CHUNK_CHARS)
                    handle.readline()
                    end = min(handle.tell(), size)
                    yield Chunk("jsonl", path, start, end)
                    start = end
        elif kind in (".jsonl.gz", ".jsonl.zst"):
            yield from _compressed_line_chunks(path, kind)
        elif kind == ".txt":
            with path.open(encoding="utf-8") as handle:
                carried = ""
                while text := handle.read(CHUNK_CHARS):
                    text = carried + text
                    cut = text.rfind("\n\n")
                    # Documents are the stripped, non-empty pieces between blank lines: cutting at any "\n\n"
                    # gives the same pieces as splitting the whole file.
                    if cut < 0:
                        carried = text
                        continue
                    yield Chunk("txt", path, 0, text[:cut])
                    carried = text[cut + 2:]
                if carried:
                    yield Chunk("txt", path, 0, carried)
        else:
            raise DataError(f"{path}: not a document format ({', '.join(DOCUMENT_FORMATS)}); the stage step skips "
                            "such files (data.unknown_files)")


def documents(chunk: Chunk, text_field: str) -> Iterable[str]:
    """The documents of one task, in order."""
    if chunk.kind == "texts":
        yield from chunk.payload
    elif chunk.kind == "jsonl":  # start: the range's first byte; payload: its end
        with chunk.path.open("rb") as handle:
            handle.seek(chunk.start)
            data = handle.read(chunk.payload - chunk.start)
        yield from _json_lines(chunk.path, data, text_field, first_line=lambda: _line_number(chunk.path, chunk.start))
    elif chunk.kind == "lines":
        yield from _json_lines(chunk.path, chunk.payload, text_field, first_line=lambda: chunk.start)
    else:
        for block in chunk.payload.split("\n\n"):
            if block.strip():
                yield block.strip()


def records(chunk: Chunk) -> Iterator[tuple[str, Any]]:
    """The records of one task of a fine-tuning corpus, in order: (where it is: file:line or file row n, the parsed
    JSON value or the parquet row). A line that is no JSON is a DataError (the file is not a corpus of records)."""
    if chunk.kind == "rows":
        for offset, row in enumerate(chunk.payload):
            yield f"{chunk.path} row {chunk.start + offset}", row
        return
    if chunk.kind == "jsonl":
        with chunk.path.open("rb") as handle:
            handle.seek(chunk.start)
            data = handle.read(chunk.payload - chunk.start)
        first = _line_number(chunk.path, chunk.start)
    else:
        data, first = chunk.payload, chunk.start
    for index, record in _parsed_lines(chunk.path, data, lambda: first):
        yield f"{chunk.path}:{first + index}", record


def read_documents(files: list[Path], text_field: str = "text") -> Iterable[str]:
    """Every document of the files, streamed (tests, tools)."""
    for chunk in text_chunks(files, text_field):
        yield from documents(chunk, text_field)


def _parsed_lines(path: Path, data: bytes, first_line) -> Iterator[tuple[int, Any]]:
    """(its offset from the chunk's first line, JSON value) of each non-blank line of a chunk; first_line() is the
    chunk's first line's number (counted only for a message: it may read the file up to the chunk)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line() + data.count(b"\n", 0, err.start)
        raise DataError(f"{path}:{line}: not UTF-8 text ({err.reason} at byte {err.start} of the line's chunk)"
                        ) from err
    # Universal newlines, as the file's line reader always had.
    for index, line in enumerate(io.StringIO(text, newline=None)):
        if not line.strip():
            continue
        try:
            yield index, _json(line)
        except ValueError as err:
            raise DataError(f"{path}:{first_line() + index}: not a JSON object ({err})") from err


def _json_lines(path: Path, data: bytes, text_field: str, first_line) -> Iterator[str]:
    for index, record in _parsed_lines(path, data, first_line):
        if not isinstance(record, dict) or text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{first_line() + index}: no {text_field!r} field (data.text_field), found "
                            f"{keys}: set data.text_field (or the corpus's text_field) to the field with the text")
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(f"{path}:{first_line() + index}: the {text_field!r} field is a "
                            f"{type(text).__name__}, not text")
        yield text


def _json(line: str):
    """orjson, and Python's json for what orjson refuses but json reads (NaN, lone surrogates, integers beyond
    64 bits), so the accepted input is what it always was."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


def _line_number(path: Path, offset: int) -> int:
    """The number of the line starting at byte `offset` (for an error message: counts the lines before it)."""
    with path.open("rb") as handle:
        return 1 + sum(block.count(b"\n") for block in iter(lambda: handle.read(min(8 << 20, offset - handle.tell())), b""))


def _parquet_chunks(path: Path, text_field: str) -> Iterator[Chunk]:
    # pyarrow only here: only the stage step reads .parquet, and the trainer image does not have it
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        if text_field not in names:
            raise DataError(f"{path}: no {text_field!r} column (data.text_field); its columns: {names}: set "
                            "data.text_field (or the corpus's text_field) to the column with the text")
        for batch in parquet.iter_batches(columns=[text_field], batch_size=4096):
            yield Chunk("texts", path, 0, [text for text in batch.column(0).to_pylist() if text])
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file: {err}") from err


def _parquet_rows(path: Path, columns: tuple[str, ...]) -> Iterator[Chunk]:
    # pyarrow only here: only the stage step reads .parquet, and the trainer image does not have it
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        missing = [name for name in columns if name not in names]
        if missing:
            raise DataError(f"{path}: no {missing[0]!r} column (the fine-tuning fields data.messages_field, "
                            f"data.prompt_field, data.completion_field); its columns: {names}")
        row = 0
        for batch in parquet.iter_batches(columns=list(columns), batch_size=1024):
            rows = batch.to_pylist()
            yield Chunk("rows", path, row, rows)
            row += len(rows)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file: {err}") from err


class _Decompressor:
    """One gzip member or zstd frame after another, fed in blocks; `feed` returns what they decompress to."""

    def __init__(self, kind: str):
        self.kind = kind
        self._new()

    def _new(self) -> None:
        if self.kind == ".jsonl.gz":
            self._stream = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        else:
            import zstandard  # only for .zst corpora

            self._stream = zstandard.ZstdDecompressor().decompressobj()
        self.fed = False  # the current member/frame has input

    def feed(self, data: bytes) -> bytes:
        out = []
        while data:
            self.fed = True
            out.append(self._stream.decompress(data))
            if not self._stream.eof:
                break
            data = self._stream.unused_data  # the next member/frame
            self._new()
        return b"".join(out)

    @property
    def mid_stream(self) -> bool:
        """Input ended inside a member/frame: the file was cut short."""
        return self.fed and not self._stream.eof


def _compressed_line_chunks(path: Path, kind: str) -> Iterator[Chunk]:
    """Decompressed in this process (a compressed stream has no byte ranges to hand out), cut at line ends."""
    import zstandard  # only for compressed corpora (its error type, for gzip files too)

    decompressor, offset, carried, line = _Decompressor(kind), 0, b"", 1
    name = "gzip" if kind == ".jsonl.gz" else "zstd"
    with path.open("rb") as handle:
        while block := handle.read(_COMPRESSED_BLOCK):
            try:
                carried += decompressor.feed(block)
            except (zlib.error, zstandard.ZstdError) as err:
                raise DataError(f"{path}: corrupt {name} stream at compressed bytes {offset}-{offset + len(block)} "
                                f"({err}): stage the file again or remove it") from err
            offset += len(block)
            cut = carried.rfind(b"\n", 0, len(carried) if len(carried) >= CHUNK_CHARS else 0)
            if cut >= 0:
                yield Chunk("lines", path, line, carried[:cut + 1])
                line += carried.count(b"\n", 0, cut + 1)
                carried = carried[cut + 1:]
    if decompressor.mid_stream:
        raise DataError(f"{path}: the {name} stream ends mid-stream at compressed byte {offset} (the file is cut "
                        "short): stage the file again or remove it")
    if carried:
        yield Chunk("lines", path, line, carried)
