"""S3 objects onto a POSIX path: the listing, which keys may become files, and the parallel verified copy.

Parallel ranged downloads through s3transfer into a temporary name beside ``raw/`` (``.partial/``), size and
checksum verified (the ETag's MD5 for single-part objects, S3's additional checksums when present), then
renamed into place. Every botocore failure becomes a ``StageError`` that names the S3 location and says what
to do. components.stage.staging decides what to copy and writes the manifest.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import os
import shutil
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError
from tqdm import tqdm

from components.stage.fsx import REPORT_DIR
from components.stage.object_paths import BadKey, inside, map_objects
from trainer.config.rules import InputError

log = logging.getLogger(__name__)

PARTIAL_DIR = ".partial"  # downloads in flight, beside raw/
_CHUNK = 8 * 1024 * 1024
MULTIPART_THRESHOLD = 16 * 1024 * 1024


class StageError(RuntimeError):
    """The data cannot be staged; the message names the S3 location or file and what to do."""


class StageInputError(StageError, InputError):
    """What the config points at cannot be staged as it is (no such bucket or prefix, no access, keys that
    cannot become files, files of no known format): the user must change the data or the config."""


def s3_client(endpoint_url: str = "", max_workers: int = 8):
    """A boto3 S3 client with bounded standard retries (throttling and 5xx are retried, then surface)."""
    return boto3.client("s3", endpoint_url=endpoint_url or None,
                        config=BotoConfig(retries={"max_attempts": 5, "mode": "standard"},
                                          max_pool_connections=max(10, max_workers * 2)))


def s3_error(err: Exception, where: str, field: str = "data.s3_uri") -> StageError:
    """A botocore error as a StageError that says what to do."""
    if isinstance(err, EndpointConnectionError):
        return StageError(f"cannot reach the S3 endpoint for {where}: {err} "
                          "(check data.s3_endpoint_url / AWS_ENDPOINT_URL_S3)")
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "")
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("404", "NoSuchBucket"):
            return StageInputError(f"{where}: the S3 bucket does not exist ({field}): create it and upload the "
                                   f"data, or fix {field}")
        if code in ("403", "AccessDenied"):
            return StageInputError(f"{where}: access denied ({field}): grant this role s3:ListBucket on the bucket "
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


def list_objects(client, bucket: str, prefix: str, field: str = "data.s3_uri") -> list[dict[str, Any]]:
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
        raise s3_error(err, f"s3://{bucket}/{key_prefix}", field) from err
    return objects


def select_objects(objects: list[dict[str, Any]], bucket: str, prefix: str, raw_dir: Path, on_bad_key: str,
                   field: str = "data.s3_uri") -> tuple[list[tuple[dict[str, Any], Path]], list[BadKey]]:
    """(object, path below raw_dir) for every key that is safe to stage; bad keys fail the stage or, with
    data.on_bad_key=skip, are left out with a warning (and counted in the manifest)."""
    mapped, bad = map_objects(objects, prefix, raw_dir)
    if bad and on_bad_key == "fail":
        shown = "; ".join(f"{b.key!r}: {b.reason}" for b in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise StageInputError(f"{len(bad)} key(s) under s3://{bucket}/{prefix} ({field}) cannot become files below "
                              f"{raw_dir}: {shown}{more}. Rename or remove those objects, or set data.on_bad_key=skip "
                              "to stage the rest without them")
    for item in bad:
        log.warning("skipping s3://%s/%r: %s (data.on_bad_key=skip)", bucket, item.key, item.reason)
    if not mapped:
        raise StageInputError(f"no objects under s3://{bucket}/{prefix}"
                              + (f" that can be staged ({len(bad)} skipped)" if bad else "")
                              + f" ({field}): upload the files there, or fix {field}")
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
