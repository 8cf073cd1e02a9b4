"""Stage training data from S3 onto a POSIX path (the FSx mount, or a local folder) and tokenize it.

Copy mode: objects under the prefix are downloaded in parallel to a temporary name, checked for size,
renamed into place and recorded in a manifest; unchanged objects (same size and ETag) are skipped on the
next run. The raw text is then tokenized into the trainer's shards (cached by content hash).
No KFP imports: the pipeline's stage component and the tests call ``stage_s3_to_local``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RAW_DIR = "raw"
STAGE_MANIFEST = "stage-manifest.json"
TEXT_SUFFIXES = (".txt", ".jsonl")


class StageError(RuntimeError):
    """The data cannot be staged; the message names the S3 location or file and what to do."""


def s3_client(endpoint_url: str = ""):
    """A boto3 S3 client; endpoint_url overrides boto3's own resolution (AWS_ENDPOINT_URL_S3 etc.)."""
    import boto3
    from botocore.config import Config as BotoConfig

    return boto3.client("s3", endpoint_url=endpoint_url or None,
                        config=BotoConfig(retries={"max_attempts": 5, "mode": "standard"}))


def _check_bucket(client, bucket: str, s3_uri: str) -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError

    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchBucket"):
            raise StageError(f"S3 bucket {bucket!r} does not exist (data.s3_uri={s3_uri}): "
                             "create it and upload the data, or fix data.s3_uri") from err
        if code in ("403", "AccessDenied"):
            raise StageError(f"access denied to S3 bucket {bucket!r} (data.s3_uri={s3_uri}): "
                             "grant s3:ListBucket and s3:GetObject on it to this role") from err
        raise StageError(f"S3 bucket {bucket!r}: {err}") from err
    except EndpointConnectionError as err:
        raise StageError(f"cannot reach the S3 endpoint for {s3_uri}: {err} "
                         "(check data.s3_endpoint_url / AWS_ENDPOINT_URL_S3)") from err


def list_objects(client, bucket: str, prefix: str) -> list[dict[str, Any]]:
    key_prefix = f"{prefix}/" if prefix else ""
    objects = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix):
        for item in page.get("Contents", []):
            if not item["Key"].endswith("/"):
                objects.append({"key": item["Key"], "bytes": item["Size"], "etag": item["ETag"].strip('"')})
    return objects


def _download(client, bucket: str, obj: dict[str, Any], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.part")
    client.download_file(bucket, obj["key"], str(tmp))
    size = tmp.stat().st_size
    if size != obj["bytes"]:
        tmp.unlink(missing_ok=True)
        raise StageError(f"s3://{bucket}/{obj['key']}: downloaded {size} bytes, S3 lists {obj['bytes']}")
    # A single-part upload's ETag is the MD5 of the body; multipart ETags ("…-N") are not.
    if "-" not in obj["etag"] and hashlib.md5(tmp.read_bytes()).hexdigest() != obj["etag"]:
        tmp.unlink(missing_ok=True)
        raise StageError(f"s3://{bucket}/{obj['key']}: MD5 differs from its ETag (corrupted in transit)")
    os.replace(tmp, target)


def stage_s3_to_local(s3_uri: str, dataset_dir: Path, *, endpoint_url: str = "", max_workers: int = 8,
                      val_fraction: float = 0.05, tokenizer: str = "byte") -> dict[str, Any]:
    """Download s3_uri's objects into <dataset_dir>/raw, tokenize them, and return the dataset manifest."""
    from trainer.data import tokenize_files

    started = time.perf_counter()
    if not s3_uri.startswith("s3://"):
        raise StageError(f"data.s3_uri {s3_uri!r} must look like s3://bucket/prefix")
    bucket, _, prefix = s3_uri[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    dataset_dir = Path(dataset_dir)
    raw_dir = dataset_dir / RAW_DIR

    client = s3_client(endpoint_url)
    _check_bucket(client, bucket, s3_uri)
    objects = list_objects(client, bucket, prefix)
    if not objects:
        raise StageError(f"no objects under {s3_uri} (data.s3_uri): upload the training data there first")

    manifest_path = dataset_dir / STAGE_MANIFEST
    previous = {}
    if manifest_path.is_file():
        previous = {o["key"]: o for o in json.loads(manifest_path.read_text()).get("objects", [])}

    def local_path(obj: dict[str, Any]) -> Path:
        relative = obj["key"][len(prefix) + 1 :] if prefix else obj["key"]
        return raw_dir / relative

    to_fetch = []
    for obj in objects:
        target = local_path(obj)
        old = previous.get(obj["key"])
        unchanged = (old is not None and old["etag"] == obj["etag"] and old["bytes"] == obj["bytes"]
                     and target.is_file() and target.stat().st_size == obj["bytes"])
        if not unchanged:
            to_fetch.append(obj)
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        list(pool.map(lambda o: _download(client, bucket, o, local_path(o)), to_fetch))
    log.info("staged %s: %d objects, %d downloaded, %d unchanged", s3_uri, len(objects), len(to_fetch),
             len(objects) - len(to_fetch))

    text_files = [local_path(o) for o in objects if local_path(o).suffix in TEXT_SUFFIXES]
    if not text_files:
        raise StageError(f"no {' or '.join(TEXT_SUFFIXES)} files under {s3_uri}: nothing to tokenize")
    tokens = tokenize_files(text_files, dataset_dir, val_fraction, tokenizer)

    manifest = {"s3_uri": s3_uri, "dataset_dir": str(dataset_dir), "objects": objects,
                "object_count": len(objects), "bytes": sum(o["bytes"] for o in objects),
                "downloaded": len(to_fetch), "tokens": tokens, "stage_seconds": time.perf_counter() - started}
    tmp = manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(manifest_path)
    return manifest
