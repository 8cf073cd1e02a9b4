"""Stage training data from S3 to where the trainer reads it, verifiably, then tokenize it.

Two modes (``data.stage_mode``), one dataset manifest (``<dataset_dir>/stage-manifest.json``: files, bytes,
object count, checksums, S3 URI, FSx path, token shards) for the next steps and MLflow:

- ``copy`` (any POSIX path): parallel ranged downloads through s3transfer into a temporary name, size and
  checksum verified (the ETag's MD5 for single-part objects, S3's additional checksums when present), then
  renamed into place; incremental by the manifest (key, size, ETag, mtime), so unchanged objects are
  skipped; optionally files no longer in S3 are deleted.
- ``dra`` (FSx for Lustre): ``components.stage.fsx`` links the file system to the prefix and imports metadata.

Raw text (``.txt``, ``.jsonl``, ``.parquet``) is then tokenized into the trainer's shards with a held-out
split, cached by content hash. No KFP imports: the stage component and the tests call ``stage_dataset``.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError
from tqdm import tqdm

from components.stage.fsx import REPORT_DIR, fsx_client, stage_via_dra
from components.stage.object_paths import BadKey, inside, map_objects
from components.stage.shards import collect_shards, dataset_lock, plan_groups, tokenize_group
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)

RAW_DIR = "raw"
PARTIAL_DIR = ".partial"  # downloads in flight, beside raw/
STAGE_MANIFEST = "stage-manifest.json"
STAGE_ERROR = "stage.error.json"  # a failed stage, beside the dataset (a cached task serves many runs)
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
_CHUNK = 8 * 1024 * 1024
MULTIPART_THRESHOLD = 16 * 1024 * 1024


class StageError(RuntimeError):
    """The data cannot be staged; the message names the S3 location or file and what to do."""


def s3_client(endpoint_url: str = "", max_workers: int = 8):
    """A boto3 S3 client with bounded standard retries (throttling and 5xx are retried, then surface)."""
    return boto3.client("s3", endpoint_url=endpoint_url or None,
                        config=BotoConfig(retries={"max_attempts": 5, "mode": "standard"},
                                          max_pool_connections=max(10, max_workers * 2)))


def s3_error(err: Exception, where: str) -> StageError:
    """A botocore error as a StageError that says what to do."""
    if isinstance(err, EndpointConnectionError):
        return StageError(f"cannot reach the S3 endpoint for {where}: {err} "
                          "(check data.s3_endpoint_url / AWS_ENDPOINT_URL_S3)")
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "")
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("404", "NoSuchBucket"):
            return StageError(f"{where}: the S3 bucket does not exist (data.s3_uri): create it and upload the "
                              "data, or fix data.s3_uri")
        if code in ("403", "AccessDenied"):
            return StageError(f"{where}: access denied (data.s3_uri): grant this role s3:ListBucket on the bucket "
                              "and s3:GetObject on the prefix")
        if code in ("SlowDown", "Throttling", "RequestLimitExceeded") or status >= 500:
            return StageError(f"{where}: S3 kept failing after the retries ({code or status}); try again later "
                              "or lower data.max_workers")
    return StageError(f"{where}: {err}")


def parse_s3_uri(s3_uri: str) -> tuple[str, str]:
    if not s3_uri.startswith("s3://") or len(s3_uri) <= len("s3://"):
        raise StageError(f"data.s3_uri {s3_uri!r} must look like s3://bucket/prefix")
    bucket, _, prefix = s3_uri[len("s3://") :].partition("/")
    return bucket, prefix.strip("/")


def list_objects(client, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """Every key under the prefix, folder markers included (``map_objects`` decides what each one becomes),
    except the FSx import reports that DRA mode writes below it."""
    key_prefix = f"{prefix}/" if prefix else ""
    reports = key_prefix + REPORT_DIR + "/"
    objects = []
    try:
        client.head_bucket(Bucket=bucket)
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix):
            for item in page.get("Contents", []):
                if item["Key"].startswith(reports):
                    continue
                objects.append({"key": item["Key"], "bytes": item["Size"], "etag": item["ETag"].strip('"'),
                                "mtime": item["LastModified"].timestamp(),
                                "checksum_algorithm": (item.get("ChecksumAlgorithm") or [None])[0]})
    except (ClientError, BotoCoreError) as err:
        raise s3_error(err, f"s3://{bucket}/{key_prefix}") from err
    return objects


def select_objects(objects: list[dict[str, Any]], bucket: str, prefix: str, raw_dir: Path,
                   on_bad_key: str) -> tuple[list[tuple[dict[str, Any], Path]], list[BadKey]]:
    """(object, path below raw_dir) for every key that is safe to stage; bad keys fail the stage or, with
    data.on_bad_key=skip, are left out with a warning (and counted in the manifest)."""
    mapped, bad = map_objects(objects, prefix, raw_dir)
    if bad and on_bad_key == "fail":
        shown = "; ".join(f"{b.key!r}: {b.reason}" for b in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise StageError(f"{len(bad)} key(s) under s3://{bucket}/{prefix} cannot become files below {raw_dir}: "
                         f"{shown}{more}. Rename or remove those objects, or set data.on_bad_key=skip to stage "
                         "the rest without them")
    for item in bad:
        log.warning("skipping s3://%s/%r: %s (data.on_bad_key=skip)", bucket, item.key, item.reason)
    if not mapped:
        raise StageError(f"no objects under s3://{bucket}/{prefix} (data.s3_uri)"
                         + (f" that can be staged ({len(bad)} skipped)" if bad else "")
                         + ": upload the training data there")
    return mapped, bad


def _checksum(path: Path, algorithm: str) -> str:
    """Base64 of the whole-object checksum, as S3 reports a FULL_OBJECT checksum."""
    if algorithm == "CRC32":
        value = 0
        with path.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                value = zlib.crc32(chunk, value)
        return base64.b64encode(value.to_bytes(4, "big")).decode()
    digest = {"SHA256": hashlib.sha256, "SHA1": hashlib.sha1}[algorithm]()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return base64.b64encode(digest.digest()).decode()


def _verify(client, bucket: str, obj: dict[str, Any], tmp: Path) -> str:
    """Check the downloaded file against S3; returns what was checked."""
    size = tmp.stat().st_size
    if size != obj["bytes"]:
        raise StageError(f"s3://{bucket}/{obj['key']}: downloaded {size} bytes, S3 lists {obj['bytes']}")
    algorithm = obj.get("checksum_algorithm")
    if algorithm in ("CRC32", "SHA256", "SHA1"):
        head = client.head_object(Bucket=bucket, Key=obj["key"], ChecksumMode="ENABLED")
        expected = head.get(f"Checksum{algorithm}")
        # A multipart upload's COMPOSITE checksum is a checksum of the parts' checksums: not comparable.
        # Trust it as a whole-object checksum only when S3 says FULL_OBJECT or the upload had one part.
        full_object = head.get("ChecksumType") == "FULL_OBJECT" or "-" not in obj["etag"]
        if expected and "-" not in expected and full_object:
            if _checksum(tmp, algorithm) != expected:
                raise StageError(f"s3://{bucket}/{obj['key']}: {algorithm} differs from S3's (corrupted in transit)")
            return algorithm.lower()
    if "-" not in obj["etag"]:  # a single-part upload's ETag is the MD5 of the body
        digest = hashlib.md5()
        with tmp.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != obj["etag"]:
            raise StageError(f"s3://{bucket}/{obj['key']}: MD5 differs from its ETag (corrupted in transit)")
        return "md5"
    return "size"


def _download(client, bucket: str, obj: dict[str, Any], target: Path, partial_dir: Path, raw_dir: Path,
              transfer_config, progress) -> str:
    """Download into partial_dir (outside raw/, so no key can collide with a temporary name), verify, rename."""
    tmp = partial_dir / (hashlib.sha256(obj["key"].encode()).hexdigest()[:40] + ".part")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not inside(target.parent, raw_dir):  # a symlink planted below raw/ must not lead the write out
            raise StageError(f"s3://{bucket}/{obj['key']}: {target.parent} resolves outside {raw_dir}; refusing "
                             "to write there (remove the symlink)")
        client.download_file(bucket, obj["key"], str(tmp), Config=transfer_config, Callback=progress)
        checked = _verify(client, bucket, obj, tmp)
        os.replace(tmp, target)
        return checked
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno == errno.ENOSPC:
            raise StageError(f"disk full writing {target} (s3://{bucket}/{obj['key']}, {obj['bytes']} bytes): "
                             "free space or point data.fsx_root at a larger volume") from err
        raise StageError(f"cannot write {target}: {err}") from err
    except (ClientError, BotoCoreError) as err:
        tmp.unlink(missing_ok=True)
        raise s3_error(err, f"s3://{bucket}/{obj['key']}") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _progress_bar(total: int, description: str, unit: str = "B"):
    return tqdm(total=total, desc=description, unit=unit, unit_scale=True, disable=not sys.stderr.isatty())


def copy_from_s3(client, bucket: str, mapped: list[tuple[dict[str, Any], Path]], raw_dir: Path,
                 previous: dict[str, dict], *, max_workers: int = 8, delete_removed: bool = False) -> dict[str, Any]:
    """Copy mode: download new or changed objects (already mapped to their paths) into raw_dir."""
    to_fetch = []
    for obj, target in mapped:
        old = previous.get(obj["key"])
        unchanged = (old is not None and (old["etag"], old["bytes"], old.get("mtime")) == (obj["etag"], obj["bytes"], obj["mtime"])
                     and target.is_file() and target.stat().st_size == obj["bytes"])
        if unchanged:
            obj["verified"] = old.get("verified", "size")
        else:
            to_fetch.append((obj, target))

    partial_dir = raw_dir.parent / PARTIAL_DIR
    shutil.rmtree(partial_dir, ignore_errors=True)  # left by an interrupted stage: never renamed into place
    partial_dir.mkdir(parents=True)
    transfer_config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD,
                                     max_concurrency=max(1, max_workers // 2), use_threads=True)
    lock = threading.Lock()
    with _progress_bar(sum(o["bytes"] for o, _ in to_fetch), "download") as bar:
        def progress(n: int) -> None:
            with lock:
                bar.update(n)

        def fetch(item: tuple[dict[str, Any], Path]) -> None:
            obj, target = item
            obj["verified"] = _download(client, bucket, obj, target, partial_dir, raw_dir, transfer_config, progress)

        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            list(pool.map(fetch, to_fetch))
    shutil.rmtree(partial_dir, ignore_errors=True)

    deleted = []
    if delete_removed and raw_dir.is_dir():
        keep = {target for _, target in mapped}
        for path in sorted(p for p in raw_dir.rglob("*") if p.is_file()):
            if path not in keep:
                path.unlink()
                deleted.append(str(path.relative_to(raw_dir)))
    log.info("copied s3://%s: %d objects, %d downloaded, %d unchanged, %d deleted", bucket, len(mapped),
             len(to_fetch), len(mapped) - len(to_fetch), len(deleted))
    return {"objects": [obj for obj, _ in mapped], "downloaded": len(to_fetch), "deleted": deleted,
            "files": [str(target) for _, target in mapped]}


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
