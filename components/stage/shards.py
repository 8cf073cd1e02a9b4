"""Tokenization fanned out over groups of files: one token shard per group, the dataset's tokens.json lists
them in order.

The stage step plans the groups (``plan_groups``: ``data.tokenize_tasks`` contiguous runs of the sorted file
list, balanced by bytes); each group is tokenized on its own (``tokenize_group``: in the pipeline one KFP task
per group under ``dsl.ParallelFor``, on EKS one pod each; in ``stage_dataset`` one after another) into
``<dataset_dir>/shards/<index>-of-<count>/``; ``collect_shards`` then writes ``<dataset_dir>/tokens.json``
naming every shard's files. Because the groups are contiguous in the order one task reads the files, the
shards' concatenation is byte for byte what one task writes, and the content hash combined from the shards'
file digests is the one that task computes: the number of tasks changes neither the tokens nor the hash.
No KFP imports: the components and the tests call these.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

from trainer.data.conversations import ConversationFormat
from trainer.data.shards import (META_FILE, SHARD_FORMAT_VERSION, DataError, combined_content_hash, flag_files,
                                 load_meta, reading_key, shard_files, tokenize_files)
from trainer.data.tokenizer import load_tokenizer
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)

SHARDS_DIR = "shards"
STAGE_LOCK = ".stage.lock"


@contextlib.contextmanager
def dataset_lock(dataset_dir: Path, *, shared: bool = False) -> Iterator[None]:
    """The dataset folder's lock: staging and collecting hold it alone, tokenizing tasks share it (so a
    concurrent run's stage cannot replace raw files under them)."""
    with (Path(dataset_dir) / STAGE_LOCK).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield


def plan_groups(files: list[Path], dataset_dir: Path, count: int) -> list[dict[str, Any]]:
    """At most `count` groups of whole files, contiguous in sorted order, each about the same bytes; files
    are named relative to dataset_dir (what a task on another node finds under the same mount)."""
    files = sorted(files)
    if not files:
        raise DataError(f"no document files to tokenize for {dataset_dir}")
    count = max(1, min(count, len(files)))
    sizes = [path.stat().st_size for path in files]
    total = max(1, sum(sizes))
    groups: list[list[Path]] = [[]]
    done = 0
    for position, (path, size) in enumerate(zip(files, sizes)):
        groups[-1].append(path)
        done += size
        groups_after = count - len(groups)
        files_after = len(files) - position - 1
        # Cut at this group's share of the bytes, or where each group still to come needs one of the files left.
        if groups_after and (done >= total * len(groups) / count or files_after == groups_after):
            groups.append([])
    assert len(groups) == count and all(groups), (count, [len(g) for g in groups])
    return [{"index": index, "count": count, "files": [str(p.relative_to(dataset_dir)) for p in group]}
            for index, group in enumerate(groups)]


def shard_dir(dataset_dir: Path, index: int, count: int) -> Path:
    return Path(dataset_dir) / SHARDS_DIR / f"{index:05d}-of-{count:05d}"


def tokenize_group(group: dict[str, Any], dataset_dir: Path, val_fraction: float, tokenizer: str,
                   text_field: str = "text", conversations: ConversationFormat | None = None) -> dict[str, Any]:
    """Tokenize one planned group into its shard folder (reused when its files are unchanged); returns what
    collect_shards needs: the group's index and count, the shard folder and its content hash (and its seconds)."""
    dataset_dir = Path(dataset_dir)
    files = [dataset_dir / name for name in group["files"]]
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise DataError(f"{missing[0]} (tokenize group {group['index']} of {group['count']}) does not exist: the "
                        "staged files changed since the stage task listed them; run the pipeline again")
    started = time.perf_counter()
    out = shard_dir(dataset_dir, group["index"], group["count"])
    meta = tokenize_files(files, out, val_fraction, tokenizer, require_both_splits=False, text_field=text_field,
                          conversations=conversations)
    return {"index": group["index"], "count": group["count"], "dir": str(out.relative_to(dataset_dir)),
            "content_hash": meta["content_hash"], "seconds": time.perf_counter() - started}


def collect_shards(shards: list[dict[str, Any]], dataset_dir: Path, val_fraction: float, tokenizer: str,
                   text_field: str = "text", conversations: ConversationFormat | None = None) -> dict[str, Any]:
    """The dataset's tokens.json from every group's shard, in group order; then the shards of earlier plans
    (another tokenize_tasks) and the single-file layout of older versions are deleted."""
    dataset_dir = Path(dataset_dir)
    shards = sorted(shards, key=lambda s: s["index"])
    count = shards[0]["count"] if shards else 0
    if not shards or [s["index"] for s in shards] != list(range(count)) or {s["count"] for s in shards} != {count}:
        raise DataError(f"{dataset_dir}: expected one token shard per tokenize group, got groups "
                        f"{[(s['index'], s['count']) for s in shards]}: run the pipeline again")
    metas = []
    for shard in shards:
        meta = load_meta(dataset_dir / shard["dir"])
        if meta.get("content_hash") != shard["content_hash"] or "file_digests" not in meta:
            raise DataError(f"{dataset_dir / shard['dir'] / META_FILE} changed after its tokenize task wrote it (two "
                            "runs with different data.tokenize_tasks or data at once?): run the pipeline again")
        metas.append(meta)
    first = metas[0]
    for shard, meta in zip(shards, metas):
        settings = (meta["tokenizer"], meta["vocab_size"], meta["dtype"], meta["val_fraction"],
                    meta.get("text_field", "text"), meta.get("conversations"))
        if settings != (first["tokenizer"], first["vocab_size"], first["dtype"], val_fraction, text_field,
                        first.get("conversations")):
            raise DataError(f"{dataset_dir / shard['dir'] / META_FILE}: tokenized with other settings than the rest "
                            f"(tokenizer, dtype, data.val_fraction or the text field): run the pipeline again")
    loaded = load_tokenizer(tokenizer)
    digests = [digest for meta in metas for digest in meta["file_digests"]]
    splits = {}
    for split in ("train", "val"):
        files = [f"{shard['dir']}/{name}" for shard, meta in zip(shards, metas)
                 for name in shard_files(meta["splits"][split])]
        flags = [f"{shard['dir']}/{name}" for shard, meta in zip(shards, metas)
                 for name in flag_files(meta["splits"][split])]
        counted = sorted({key for meta in metas for key, value in meta["splits"][split].items()
                          if isinstance(value, int)})
        totals = {key: sum(meta["splits"][split].get(key, 0) for meta in metas) for key in counted}
        if not totals["documents"]:
            raise DataError(f"the {split} split is empty: add documents or change data.val_fraction")
        splits[split] = {"files": files, **({"flags_files": flags} if flags else {}), **totals}
    merged = {"format_version": SHARD_FORMAT_VERSION, "tokenizer": first["tokenizer"], "vocab_size": first["vocab_size"],
              "dtype": first["dtype"], "content_hash": combined_content_hash(digests, val_fraction,
                                                                              loaded.tokenizer.to_str(),
                                                                              reading_key(text_field, conversations,
                                                                                          loaded)),
              "tokenizer_hash": loaded.content_hash(), "val_fraction": val_fraction, "text_field": text_field,
              "splits": splits, "shards": [shard["dir"] for shard in shards],
              **({"conversations": first["conversations"]} if "conversations" in first else {})}
    write_json(dataset_dir / META_FILE, merged)
    _delete_unlisted(dataset_dir, {Path(shard["dir"]).name for shard in shards})
    log.info("%d token shard(s) in %s: %d train / %d val tokens", count, dataset_dir, splits["train"]["tokens"],
             splits["val"]["tokens"])
    return merged


def _delete_unlisted(dataset_dir: Path, listed: set[str]) -> None:
    """Shards no tokens.json names any more: a run still reading them keeps its open files (POSIX unlink)."""
    for stale in sorted((dataset_dir / SHARDS_DIR).iterdir()):
        if stale.name not in listed:
            shutil.rmtree(stale, ignore_errors=True)
    for name in ("train.bin", "val.bin"):  # the single-file layout of versions before the fan-out
        (dataset_dir / name).unlink(missing_ok=True)


def write_mixture(data_dir: Path, parts: list[tuple[Any, Path, dict[str, Any]]]) -> dict[str, Any]:
    """The mixture's tokens.json in data_dir from each corpus's (its DatasetConfig, its folder, its tokens.json):
    the folders (relative to data_dir, so the mount point may move), weights and text fields, one tokenizer for
    all, the totals, and a content hash of the corpora's hashes and weights (trainer.data.batches reads it)."""
    data_dir = Path(data_dir)
    kinds = {(tokens["tokenizer"], tokens["vocab_size"], tokens["dtype"]) for _, _, tokens in parts}
    if len(kinds) != 1:
        raise DataError(f"{data_dir}: the corpora were tokenized with different tokenizers {sorted(kinds)}: stage "
                        "them again with one data.tokenizer")
    [(tokenizer, vocab, dtype)] = kinds
    formats = {json.dumps(tokens.get("conversations"), sort_keys=True) for _, _, tokens in parts}
    if len(formats) != 1:
        raise DataError(f"{data_dir}: the corpora were tokenized as different formats (data.format, training.seq_len"
                        f"): {sorted(formats)}: stage them again with one")
    tokenizer_hash = next((tokens.get("tokenizer_hash") for _, _, tokens in parts), None)
    mixture = [{"name": source.name, "dir": os.path.relpath(folder, data_dir), "weight": source.weight,
                "text_field": source.text_field, "content_hash": tokens["content_hash"]}
               for source, folder, tokens in parts]
    splits = {split: {key: sum(tokens["splits"][split][key] for _, _, tokens in parts)
                      for key in ("tokens", "documents")} for split in ("train", "val")}
    conversations = parts[0][2].get("conversations")
    content_hash = hashlib.sha256(json.dumps([[m["name"], m["weight"], m["content_hash"]] for m in mixture])
                                  .encode()).hexdigest()
    meta = {"format_version": SHARD_FORMAT_VERSION, "mixture": mixture, "tokenizer": tokenizer, "vocab_size": vocab,
            "tokenizer_hash": tokenizer_hash, "dtype": dtype, "content_hash": content_hash, "splits": splits,
            **({"conversations": conversations} if conversations else {})}
    data_dir.mkdir(parents=True, exist_ok=True)
    write_json(data_dir / META_FILE, meta)
    return meta
