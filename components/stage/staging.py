"""Stage training data from S3 to where the trainer reads it, verifiably, then tokenize it.

Two modes (``data.stage_mode``), one dataset manifest (``<dataset_dir>/stage-manifest.json``: files, bytes,
object count, checksums, S3 URI, FSx path, token shards) for the next steps and MLflow:

- ``copy`` (any POSIX path): parallel ranged downloads, each verified and renamed into place
  (components.stage.s3_copy); incremental by the manifest (key, size, ETag, mtime), so unchanged objects
  are skipped; optionally files no longer in S3 are deleted.
- ``dra`` (FSx for Lustre): ``components.stage.fsx`` links the file system to the prefix and imports metadata.

Raw text (``.txt``, ``.jsonl``, ``.parquet``) is then tokenized into the trainer's shards with a held-out
split, cached by content hash. No KFP imports: the stage component and the tests call ``stage_dataset``.
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
from components.stage.s3_copy import StageError, copy_from_s3, list_objects, parse_s3_uri, s3_client, select_objects
from components.stage.shards import collect_shards, dataset_lock, plan_groups, tokenize_group
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)

RAW_DIR = "raw"
STAGE_MANIFEST = "stage-manifest.json"
STAGE_ERROR = "stage.error.json"  # a failed stage, beside the dataset (a cached task serves many runs)
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def listing_fingerprint(data, objects: list[dict[str, Any]]) -> str:
    """What staging produces depends on: the listing (keys, sizes, ETags) and the data settings."""
    listing = sorted((o["key"], o["bytes"], o["etag"]) for o in objects)
    return hashlib.sha256(json.dumps([data.s3_uri, data.stage_mode, data.tokenizer, data.val_fraction, data.on_bad_key,
                                      listing]).encode()).hexdigest()[:32]


def data_fingerprint(data) -> str:
    """A hash of the prefix's listing — the KFP cache key of the stage step. Never raises: when the listing
    fails the fingerprint is unique, so the stage step runs and reports the error."""
    try:
        bucket, prefix = parse_s3_uri(data.s3_uri)
        objects = list_objects(s3_client(data.s3_endpoint_url), bucket, prefix)
    except Exception as err:  # noqa: BLE001
        log.warning("cannot list %s for the cache key (%s): the stage step will run", data.s3_uri, err)
        return f"unlisted-{time.time_ns()}"
    return listing_fingerprint(data, objects)


def not_writable_hint(namespace: str) -> str:
    """What to do when the pods' uid cannot write below the FSx root (root-owned until prepared)."""
    return ("The FSx file system's root and what a DRA imports without POSIX metadata belong to root: run the "
            f"one-time preparation Job (`kubectl -n {namespace} get job fsx-prepare`, manifests/base/fsx/"
            "prepare-job.yaml) that creates runs/ and datasets/ for uid 10001; see docs/first-run-on-eks.md")


def stage_dataset(data, dataset_dir: Path, fsx_root: Path, *, fsx=None, tokenize: bool = True) -> dict[str, Any]:
    """Stage data.s3_uri into <dataset_dir>/raw by data.stage_mode, tokenize it, write the manifest.

    `data` is the config's DataConfig; `fsx` an FSx client for dra mode (created when omitted). Concurrent
    stages of the same dataset folder (two pipeline runs at once) take turns. The dataset folder is created
    here, before a DRA links raw/ below it, so the token shards beside raw/ are this uid's to write.
    The manifest's "token_groups" are data.tokenize_tasks groups of the text files (components.stage.shards);
    with tokenize=False (the pipeline, whose tasks tokenize the groups) its "tokens" stay None until
    collect_shards' result completes it, else each group is tokenized here in turn.
    """
    dataset_dir = Path(dataset_dir)
    try:
        dataset_dir.mkdir(parents=True, exist_ok=True)
    except PermissionError as err:
        raise StageError(f"cannot create {dataset_dir} as uid {os.getuid()}: {err.strerror}. "
                         f"{not_writable_hint('resilient-train')}") from err
    with dataset_lock(dataset_dir):
        return _stage_locked(data, dataset_dir, Path(fsx_root), fsx, tokenize)


def _stage_locked(data, dataset_dir: Path, fsx_root: Path, fsx, tokenize: bool) -> dict[str, Any]:
    started = time.perf_counter()
    bucket, prefix = parse_s3_uri(data.s3_uri)
    raw_dir = dataset_dir / RAW_DIR
    manifest_path = dataset_dir / STAGE_MANIFEST
    previous = {}
    if manifest_path.is_file():
        previous = {o["key"]: o for o in json.loads(manifest_path.read_text()).get("objects", [])}
    client = s3_client(data.s3_endpoint_url, data.max_workers)

    dra = None
    if data.stage_mode == "dra":
        fsx_path = "/" + str(raw_dir.relative_to(fsx_root)) if raw_dir.is_relative_to(fsx_root) else None
        if fsx_path is None:
            raise StageError(f"dataset folder {raw_dir} is not under data.fsx_root {fsx_root}")
        listed = list_objects(client, bucket, prefix)
        dra = stage_via_dra(fsx or fsx_client(), file_system_id=data.fsx_file_system_id, mount_root=fsx_root,
                            fsx_path=fsx_path, s3_uri=data.s3_uri,
                            auto_import=[e.strip() for e in data.dra_auto_import.split(",") if e.strip()],
                            timeout=data.dra_import_timeout_seconds, poll_seconds=data.dra_poll_seconds,
                            data_fingerprint=listing_fingerprint(data, listed),
                            require_lustre_mount=data.require_lustre_mount, preload_contents=data.preload,
                            max_workers=data.max_workers)
        mapped, skipped = select_objects(listed, bucket, prefix, raw_dir, data.on_bad_key)
        missing = [o["key"] for o, path in mapped if not path.is_file()]
        if missing:
            raise StageError(f"{len(missing)} object(s) under {data.s3_uri} are not visible under {raw_dir} after "
                             f"the metadata import (e.g. {missing[0]}): check DRA {dra['association_id']}")
        # The file system made these files, not us: one that resolves outside raw/ is never read.
        outside = [str(path) for _, path in mapped if not inside(path, raw_dir)]
        if outside:
            raise StageError(f"{outside[0]} resolves outside {raw_dir} (a symlink): refusing to read it")
        copied = {"objects": [o for o, _ in mapped], "downloaded": 0, "deleted": [],
                  "files": [str(path) for _, path in mapped]}
    else:
        mapped, skipped = select_objects(list_objects(client, bucket, prefix), bucket, prefix, raw_dir, data.on_bad_key)
        copied = copy_from_s3(client, bucket, mapped, raw_dir, previous, max_workers=data.max_workers,
                              delete_removed=data.delete_removed)

    text_files = [Path(f) for f in copied["files"] if Path(f).suffix in TEXT_SUFFIXES]
    if not text_files:
        raise StageError(f"no {', '.join(TEXT_SUFFIXES)} files under {data.s3_uri}: nothing to tokenize")
    groups = plan_groups(text_files, dataset_dir, data.tokenize_tasks)
    tokens, tokenize_started = None, time.perf_counter()
    if tokenize:
        shards = [tokenize_group(group, dataset_dir, data.val_fraction, data.tokenizer) for group in groups]
        tokens = collect_shards(shards, dataset_dir, data.val_fraction, data.tokenizer)

    objects = copied["objects"]
    manifest = {"mode": data.stage_mode, "s3_uri": data.s3_uri, "dataset_dir": str(dataset_dir),
                "fsx_path": dra["fsx_path"] if dra else str(raw_dir), "objects": objects,
                "object_count": len(objects), "bytes": sum(o["bytes"] for o in objects),
                "downloaded": copied["downloaded"], "deleted": copied["deleted"],
                "skipped_count": len(skipped), "skipped_keys": [b.as_dict() for b in skipped],
                "dra": dra, "token_groups": groups, "tokens": tokens,
                "manifest_hash": hashlib.sha256(json.dumps(sorted((o["key"], o["etag"], o["bytes"]) for o in objects))
                                                .encode()).hexdigest(),
                "stage_seconds": time.perf_counter() - started,
                "tokenize_seconds": time.perf_counter() - tokenize_started if tokenize else None}
    write_json(manifest_path, manifest)  # last: a half-staged dataset never has a manifest claiming it complete
    return manifest
