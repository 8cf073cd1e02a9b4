"""Where an HF export lives (eval.export_uri): an S3 prefix, written by the ranks straight from FSx, or a folder.

    <eval.export_uri>/<run_id>/step-000100/   model-*.safetensors, model.safetensors.index.json, config.json,
                                              tokenizer files, then export-complete.json (last)

An export counts only once ``export-complete.json`` is there: it is written last, by rank 0, after every rank has
uploaded its share of the files, and it lists every file with its size. A reader (the champion's evaluation, the
registration) checks it first and every file against it, so an upload cut short is never registered or evaluated.
Uploads and downloads go through s3transfer (multipart, several threads), the endpoint ``data.s3_endpoint_url`` or
``AWS_ENDPOINT_URL_S3``. The tracking server never sees these bytes: the registry only records the URI.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from trainer.config.rules import InputError, is_s3_uri

log = logging.getLogger(__name__)

EXPORT_COMPLETE = "export-complete.json"


class ExportStoreError(RuntimeError):
    """An export could not be written to, or read from, its URI; the message names the URI and what to do."""


class ExportUriNotWritable(InputError):
    """eval.export_uri cannot be written: found before training starts, so no GPU time is spent for nothing."""


class ExportIncomplete(ExportStoreError):
    """No complete export at a URI (never finished, or its files are gone); the message names what is missing."""


def _split(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def _client(endpoint_url: str):
    # boto3 inside: imported only by a job that exports (it costs every restarted worker ~0.4 s at import)
    import boto3
    from botocore.config import Config as BotoConfig

    return boto3.client("s3", endpoint_url=endpoint_url or None,
                        config=BotoConfig(retries={"max_attempts": 5, "mode": "standard"}))


def _transfer_config():
    from boto3.s3.transfer import TransferConfig  # with boto3 (see _client)

    return TransferConfig(max_concurrency=8, multipart_threshold=64 << 20, multipart_chunksize=64 << 20)


def check_writable(export_uri: str, endpoint_url: str = "") -> None:
    """Write and delete a probe under export_uri; ExportUriNotWritable naming it and the cause otherwise."""
    probe = f".write-probe-{uuid.uuid4().hex}"
    try:
        if is_s3_uri(export_uri):
            bucket, prefix = _split(export_uri)
            key = f"{prefix}/{probe}" if prefix else probe
            client = _client(endpoint_url)
            client.put_object(Bucket=bucket, Key=key, Body=b"")
            client.delete_object(Bucket=bucket, Key=key)
        else:
            Path(export_uri).mkdir(parents=True, exist_ok=True)
            (Path(export_uri) / probe).write_bytes(b"")
            (Path(export_uri) / probe).unlink()
    except Exception as err:  # botocore and the file system raise many types; all mean "cannot write there"
        raise ExportUriNotWritable(f"eval.export_uri={export_uri!r} is not writable ({err}): give a prefix this job's "
                                   "role may write (s3:PutObject, s3:DeleteObject), or a writable folder") from err


def upload_share(folder: Path, uri: str, rank: int, world_size: int, endpoint_url: str = "",
                 beat: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """This rank's share of the export's files (every world_size-th, by name) to the S3 URI; beat() after each
    (a heartbeat: 16 GB of files take minutes). Raises ExportStoreError naming the file and the URI."""
    started = time.perf_counter()
    bucket, prefix = _split(uri)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != EXPORT_COMPLETE)[rank::world_size]
    client, config = _client(endpoint_url), _transfer_config()
    for path in files:
        try:
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}", Config=config)
        except Exception as err:  # botocore and s3transfer raise many types; all mean "not uploaded"
            raise ExportStoreError(f"uploading {path} to {uri}/{path.name} failed: {err}") from err
        beat()
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "seconds": time.perf_counter() - started}


def complete_marker(folder: Path, info: dict[str, Any]) -> dict[str, Any]:
    """What export-complete.json says: every file of the export with its size, and where the export came from."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != EXPORT_COMPLETE}
    return {**info, "files": files, "bytes": sum(files.values()), "completed_at": time.time()}


def write_marker(uri: str, marker: dict[str, Any], endpoint_url: str = "") -> None:
    """export-complete.json, last: from now on the export at uri exists."""
    body = json.dumps(marker, indent=2).encode()
    try:
        if is_s3_uri(uri):
            bucket, prefix = _split(uri)
            _client(endpoint_url).put_object(Bucket=bucket, Key=f"{prefix}/{EXPORT_COMPLETE}", Body=body)
        else:
            staging = Path(uri) / f".{EXPORT_COMPLETE}.tmp"
            staging.write_bytes(body)
            staging.rename(Path(uri) / EXPORT_COMPLETE)
    except Exception as err:  # as in upload_share
        raise ExportStoreError(f"writing {uri}/{EXPORT_COMPLETE} failed: {err}") from err


def read_marker(uri: str, endpoint_url: str = "") -> dict[str, Any]:
    """The export's export-complete.json, every file it lists checked for its size; ExportIncomplete otherwise."""
    try:
        if is_s3_uri(uri):
            bucket, prefix = _split(uri)
            client = _client(endpoint_url)
            marker = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/{EXPORT_COMPLETE}")["Body"].read())
            listed = {}
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
                listed.update({item["Key"].rsplit("/", 1)[-1]: item["Size"] for item in page.get("Contents", [])})
        else:
            marker = json.loads((Path(uri) / EXPORT_COMPLETE).read_text())
            listed = {p.name: p.stat().st_size for p in Path(uri).iterdir() if p.is_file()}
    except Exception as err:  # missing object or file, unreadable JSON: no complete export there
        raise ExportIncomplete(f"no complete export at {uri}: {EXPORT_COMPLETE} unreadable ({err}); the export never "
                               "finished, or its files were deleted") from err
    for name, size in marker["files"].items():
        if listed.get(name) != size:
            raise ExportIncomplete(f"export at {uri} is incomplete: {name} is "
                                   f"{'missing' if name not in listed else f'{listed[name]} bytes'}, "
                                   f"{EXPORT_COMPLETE} says {size} bytes")
    return marker


def download_share(uri: str, marker: dict[str, Any], target: Path, rank: int, world_size: int,
                   endpoint_url: str = "", beat: Callable[[], None] = lambda: None) -> int:
    """This rank's share of an export's files into target (a folder every rank sees); bytes downloaded; beat()
    after each file."""
    bucket, prefix = _split(uri)
    client, config = _client(endpoint_url), _transfer_config()
    target.mkdir(parents=True, exist_ok=True)
    done = 0
    for name in sorted(marker["files"])[rank::world_size]:
        path = target / name
        if path.is_file() and path.stat().st_size == marker["files"][name]:
            continue  # a retried evaluation: already here
        try:
            client.download_file(bucket, f"{prefix}/{name}", str(path) + ".part", Config=config)
        except Exception as err:  # as in upload_share
            raise ExportIncomplete(f"downloading {uri}/{name} failed: {err}") from err
        Path(str(path) + ".part").rename(path)
        done += marker["files"][name]
        beat()
    return done


def remove_local(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
