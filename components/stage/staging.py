"""Stage a corpus from S3 to where the trainer reads it, verifiably, then tokenize it.

Two modes (``data.stage_mode``), one manifest per staged prefix (``stage-manifest.json`` beside its files: objects,
bytes, checksums, S3 URI, FSx path) for the next steps and MLflow:

- ``copy`` (any POSIX path): parallel ranged downloads, each verified and renamed into place
  (components.stage.s3_copy); incremental by the manifest (key, size, ETag, mtime), so unchanged objects
  are skipped; optionally files no longer in S3 are deleted.
- ``dra`` (FSx for Lustre): ``components.stage.fsx`` links the file system to the prefix and imports metadata.

``stage_prefix`` does that for any prefix (a corpus, a base model, a tokenizer: components.stage.models);
``stage_dataset`` then tokenizes a corpus's documents (.jsonl, .jsonl.gz, .jsonl.zst, .parquet, .txt) into the
trainer's shards with a held-out split, cached by content hash. Files of no document format are skipped and counted
(data.unknown_files=skip) or refused. No KFP imports: the stage component and the tests call these.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from components.stage.fsx import fsx_client, stage_via_dra
from components.stage.object_paths import inside
from components.stage.s3_copy import (StageError, StageInputError, copy_from_s3, list_objects, parse_s3_uri, s3_client,
                                      select_objects)
from components.stage.shards import collect_shards, dataset_lock, plan_groups, tokenize_group
from trainer.config import DatasetConfig
from trainer.data.documents import DOCUMENT_FORMATS, document_format
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)

RAW_DIR = "raw"
STAGE_MANIFEST = "stage-manifest.json"
STAGE_ERROR = "stage.error.json"  # a failed stage, beside the dataset (a cached task serves many runs)
SHOWN_UNKNOWN = 100  # unknown files named in the manifest (all are counted)


def listing_fingerprint(data, objects: list[dict[str, Any]], s3_uri: str = "") -> str:
    """What staging one prefix produces depends on: its listing (keys, sizes, ETags) and the data settings."""
    listing = sorted((o["key"], o["bytes"], o["etag"]) for o in objects)
    return hashlib.sha256(json.dumps([s3_uri or data.s3_uri, data.stage_mode, data.tokenizer, data.val_fraction,
                                      data.on_bad_key, data.unknown_files, listing]).encode()).hexdigest()[:32]


def data_fingerprint(cfg) -> str:
    """A hash of every staged prefix's listing (each corpus, the base model, the tokenizer) and the settings that
    shape what staging writes — the KFP cache key of the stage step. Never raises: when a listing fails the
    fingerprint is unique, so the stage step runs and reports the error."""
    client = s3_client(cfg.data.s3_endpoint_url)
    parts = []
    try:
        for uri in staged_prefixes(cfg):
            bucket, prefix = parse_s3_uri(uri)
            parts.append(listing_fingerprint(cfg.data, list_objects(client, bucket, prefix), uri))
    except Exception as err:  # noqa: BLE001
        log.warning("cannot list the staged prefixes for the cache key (%s): the stage step will run", err)
        return f"unlisted-{time.time_ns()}"
    sources = [(s.name, s.weight, s.text_field) for s in cfg.data.sources()]
    return hashlib.sha256(json.dumps([parts, sources, cfg.data.dataset_name]).encode()).hexdigest()[:32]


def staged_prefixes(cfg) -> list[str]:
    """Every S3 prefix the stage step stages: the base model's, the tokenizer's (when another), the lm-eval task
    folder's, each corpus's."""
    models = [uri for uri in (cfg.model.init_from, cfg.tokenizer_source, cfg.eval.lm_eval_include_path)
              if uri.startswith("s3://")]
    return list(dict.fromkeys(uri.rstrip("/") for uri in models)) + [source.s3_uri for source in cfg.data.sources()]


def not_writable_hint(namespace: str) -> str:
    """What to do when the pods' uid cannot write below the FSx root (root-owned until prepared)."""
    return ("The FSx file system's root and what a DRA imports without POSIX metadata belong to root: run the "
            f"one-time preparation Job (`kubectl -n {namespace} get job fsx-prepare`, manifests/base/fsx/"
            "prepare-job.yaml) that creates runs/ and datasets/ for uid 10001; see docs/first-run-on-eks.md")


def make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except PermissionError as err:
        raise StageError(f"cannot create {folder} as uid {os.getuid()}: {err.strerror}. "
                         f"{not_writable_hint('resilient-train')}") from err


def stage_prefix(data, s3_uri: str, files_dir: Path, fsx_root: Path, previous: dict[str, Any], fsx=None, *,
                 field: str = "data.s3_uri") -> dict[str, Any]:
    """Put the objects under s3_uri (the config's `field`, which errors name) into files_dir by data.stage_mode (the
    caller holds the folder's lock); returns what the manifest records of them ("files": the staged paths)."""
    bucket, prefix = parse_s3_uri(s3_uri)
    client = s3_client(data.s3_endpoint_url, data.max_workers)
    listed = list_objects(client, bucket, prefix, field)
    mapped, skipped = select_objects(listed, bucket, prefix, files_dir, data.on_bad_key, field)
    dra = None
    if data.stage_mode == "dra":
        fsx_path = "/" + str(files_dir.relative_to(fsx_root)) if files_dir.is_relative_to(fsx_root) else None
        if fsx_path is None:
            raise StageError(f"folder {files_dir} is not under data.fsx_root {fsx_root}")
        dra = stage_via_dra(fsx or fsx_client(), file_system_id=data.fsx_file_system_id, mount_root=fsx_root,
                            fsx_path=fsx_path, s3_uri=s3_uri,
                            auto_import=[e.strip() for e in data.dra_auto_import.split(",") if e.strip()],
                            timeout=data.dra_import_timeout_seconds, poll_seconds=data.dra_poll_seconds,
                            data_fingerprint=listing_fingerprint(data, listed, s3_uri),
                            require_lustre_mount=data.require_lustre_mount, preload_contents=data.preload,
                            max_workers=data.max_workers)
        missing = [o["key"] for o, path in mapped if not path.is_file()]
        if missing:
            raise StageError(f"{len(missing)} object(s) under {s3_uri} are not visible under {files_dir} after the "
                             f"metadata import (e.g. {missing[0]}): check DRA {dra['association_id']}")
        # The file system made these files, not us: one that resolves outside the folder is never read.
        outside = [str(path) for _, path in mapped if not inside(path, files_dir)]
        if outside:
            raise StageError(f"{outside[0]} resolves outside {files_dir} (a symlink): refusing to read it")
        copied = {"objects": [o for o, _ in mapped], "downloaded": 0, "deleted": [],
                  "files": [str(path) for _, path in mapped]}
    else:
        copied = copy_from_s3(client, bucket, mapped, files_dir, previous, max_workers=data.max_workers,
                              delete_removed=data.delete_removed)
    objects = copied["objects"]
    return {"mode": data.stage_mode, "s3_uri": s3_uri, "fsx_path": dra["fsx_path"] if dra else str(files_dir),
            "objects": objects, "object_count": len(objects), "bytes": sum(o["bytes"] for o in objects),
            "downloaded": copied["downloaded"], "deleted": copied["deleted"], "skipped_count": len(skipped),
            "skipped_keys": [b.as_dict() for b in skipped], "dra": dra, "files": copied["files"],
            "manifest_hash": hashlib.sha256(json.dumps(sorted((o["key"], o["etag"], o["bytes"]) for o in objects))
                                            .encode()).hexdigest()}


def previous_objects(manifest_path: Path) -> dict[str, dict]:
    """The objects an earlier stage of the folder recorded (what copy mode need not download again)."""
    if not manifest_path.is_file():
        return {}
    return {o["key"]: o for o in json.loads(manifest_path.read_text()).get("objects", [])}


def stage_dataset(data, dataset_dir: Path, fsx_root: Path, *, fsx=None, tokenize: bool = True,
                  source: DatasetConfig | None = None, tokenizer: str | None = None,
                  field: str = "data.s3_uri", conversations=None) -> dict[str, Any]:
    """Stage a corpus (default: data's one, data.s3_uri) into <dataset_dir>/raw by data.stage_mode, tokenize it
    with `tokenizer` (default data.tokenizer, or byte: a name or folder; a run's is Config.tokenizer_spec), write the
    manifest. `conversations`: a fine-tuning corpus's format (Config.data.conversation_format), None for text.

    `fsx` is an FSx client for dra mode (created when omitted). Concurrent stages of the same dataset folder (two
    pipeline runs at once) take turns. The dataset folder is created here, before a DRA links raw/ below it, so
    the token shards beside raw/ are this uid's to write. The manifest's "token_groups" are data.tokenize_tasks
    groups of the document files (components.stage.shards), each naming its corpus; with tokenize=False (the
    pipeline, whose tasks tokenize the groups) its "tokens" stay None until collect_shards' result completes it,
    else each group is tokenized here in turn.
    """
    source = source or data.sources()[0]
    dataset_dir = Path(dataset_dir)
    make_folder(dataset_dir)
    with dataset_lock(dataset_dir):
        started = time.perf_counter()
        manifest_path = dataset_dir / STAGE_MANIFEST
        staged = stage_prefix(data, source.s3_uri, dataset_dir / RAW_DIR, Path(fsx_root),
                              previous_objects(manifest_path), fsx, field=field)
        files = [Path(f) for f in staged.pop("files")]
        documents = [f for f in files if document_format(f)]
        unknown = sorted(str(f.relative_to(dataset_dir / RAW_DIR)) for f in files if not document_format(f))
        if unknown and data.unknown_files == "fail":
            raise StageInputError(f"{len(unknown)} file(s) under {source.s3_uri} are no document format "
                                  f"({', '.join(DOCUMENT_FORMATS)}): {', '.join(unknown[:5])}. Remove them, or set "
                                  "data.unknown_files=skip to train on the rest")
        if unknown:
            log.warning("%s: %d file(s) of no document format skipped (data.unknown_files=skip), e.g. %s",
                        source.s3_uri, len(unknown), ", ".join(unknown[:3]))
        if not documents:
            raise StageInputError(f"no {', '.join(DOCUMENT_FORMATS)} files under {source.s3_uri} ({len(unknown)} of "
                                  "other types): nothing to tokenize")
        groups = [{**group, "dataset": source.name}
                  for group in plan_groups(documents, dataset_dir, data.tokenize_tasks)]
        tokens, tokenize_started = None, time.perf_counter()
        tokenizer = tokenizer if tokenizer is not None else data.tokenizer or "byte"  # (no base model here)
        if tokenize:
            shards = [tokenize_group(group, dataset_dir, data.val_fraction, tokenizer, source.text_field, conversations)
                      for group in groups]
            tokens = collect_shards(shards, dataset_dir, data.val_fraction, tokenizer, source.text_field,
                                    conversations)
        manifest = {**staged, "dataset": source.name, "weight": source.weight, "text_field": source.text_field,
                    "dataset_dir": str(dataset_dir), "unknown_files_count": len(unknown),
                    "unknown_files": unknown[:SHOWN_UNKNOWN], "token_groups": groups, "tokens": tokens,
                    "stage_seconds": time.perf_counter() - started,
                    "tokenize_seconds": time.perf_counter() - tokenize_started if tokenize else None}
        write_json(manifest_path, manifest)  # last: a half-staged dataset never has a manifest claiming it complete
        return manifest
