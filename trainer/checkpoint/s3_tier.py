"""The S3 tier: committed checkpoints copied to S3 every few commits, and brought back when nothing nearer is.

    <checkpoint.s3_uri>/<run_id>/step-000100/<every file of the committed folder>, manifest.json last

A copy counts only once its manifest is there (uploaded last, deleted first), so an upload or a deletion cut
short is never taken for a checkpoint. Bringing one back downloads it beside the FSx checkpoints as
``step-N.tmp``, verifies it against its manifest (sizes and xxh3-128 hashes) and renames it into place; a
copy that does not verify is skipped with a log line and the next older one is tried. Uploads go through
s3transfer (multipart, several threads); the endpoint is ``data.s3_endpoint_url`` / ``AWS_ENDPOINT_URL_S3``.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any

from trainer.checkpoint.format import MANIFEST, fsync_dir, step_dir_name, verify_checkpoint

log = logging.getLogger(__name__)

_STEP_PREFIX = re.compile(r"/step-(\d+)/$")


class S3TierError(RuntimeError):
    """The S3 tier could not be reached or refused a request; the message names the URI."""


class S3Tier:
    def __init__(self, s3_uri: str, run_id: str, endpoint_url: str = ""):
        bucket, _, prefix = s3_uri[len("s3://"):].partition("/")
        self.bucket = bucket
        self.prefix = "/".join(p for p in (prefix.strip("/"), run_id) if p)
        self.uri = f"s3://{bucket}/{self.prefix}"
        self._endpoint_url = endpoint_url
        self._client = None

    def _s3(self):
        if self._client is None:
            # boto3 inside: the tier is optional, and importing it costs every restarted worker ~0.4 s
            import boto3
            from botocore.config import Config as BotoConfig

            self._client = boto3.client("s3", endpoint_url=self._endpoint_url or None,
                                        config=BotoConfig(retries={"max_attempts": 5, "mode": "standard"}))
        return self._client

    def _key(self, step: int, name: str = "") -> str:
        return f"{self.prefix}/{step_dir_name(step)}/{name}"

    def upload(self, folder: Path, step: int) -> dict[str, Any]:
        """Copy a committed checkpoint folder; its manifest goes last. Returns what was sent."""
        from boto3.s3.transfer import TransferConfig  # with boto3 (see _s3)

        started = time.perf_counter()
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        transfer = TransferConfig(max_concurrency=8, multipart_threshold=64 << 20, multipart_chunksize=64 << 20)
        try:
            for path in sorted(files, key=lambda p: p.name == MANIFEST):
                self._s3().upload_file(str(path), self.bucket, self._key(step, path.relative_to(folder).as_posix()),
                                       Config=transfer)
        except Exception as err:  # botocore and s3transfer raise many types; all mean "not uploaded"
            raise S3TierError(f"uploading {folder} to {self.uri}/{step_dir_name(step)}/ failed: {err}") from err
        return {"step": step, "uri": f"{self.uri}/{step_dir_name(step)}/", "bytes": sum(p.stat().st_size for p in files),
                "seconds": time.perf_counter() - started}

    def steps(self) -> list[int]:
        """Steps with a complete copy (manifest present), oldest first."""
        found = []
        try:
            pages = self._s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/",
                                                                        Delimiter="/")
            prefixes = [p["Prefix"] for page in pages for p in page.get("CommonPrefixes", [])]
            for prefix in prefixes:
                match = _STEP_PREFIX.search(prefix)
                if match and self._exists(prefix + MANIFEST):
                    found.append(int(match.group(1)))
        except S3TierError:
            raise
        except Exception as err:  # noqa: BLE001 - see upload
            raise S3TierError(f"listing {self.uri}/ failed: {err}") from err
        return sorted(found)

    def _exists(self, key: str) -> bool:
        try:
            self._s3().head_object(Bucket=self.bucket, Key=key)
            return True
        except Exception as err:  # noqa: BLE001 - a 404 is the answer; anything else is not
            if getattr(err, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise S3TierError(f"reading s3://{self.bucket}/{key} failed: {err}") from err

    def retain(self, keep_last: int) -> None:
        """Delete all but the newest keep_last complete copies."""
        for step in self.steps()[:-keep_last]:
            self._delete(step)

    def delete_after(self, step: int) -> None:
        """Delete the copies after `step` (an abandoned branch: trainer.job.numeric_recovery)."""
        for found in self.steps():
            if found > step:
                self._delete(found)

    def _delete(self, step: int) -> None:
        """One copy, its manifest first: a copy without it is incomplete to every reader."""
        keys = [item["Key"] for page in self._s3().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(step)) for item in page.get("Contents", [])]
        manifest = self._key(step, MANIFEST)
        for key in [k for k in keys if k == manifest] + [k for k in keys if k != manifest]:
            self._s3().delete_object(Bucket=self.bucket, Key=key)
        log.info("S3 tier: deleted %s/%s/", self.uri, step_dir_name(step))

    def restore_newest(self, directory: Path, newer_than: int | None,
                       at_most: int | None = None) -> tuple[Path, int] | None:
        """Download the newest copy newer than `newer_than` (and not after `at_most`) that verifies into
        directory/step-N; None when there is none. Copies that do not verify are logged and skipped."""
        for step in reversed(self.steps()):
            if at_most is not None and step > at_most:
                continue
            if newer_than is not None and step <= newer_than:
                return None
            staging = directory / (step_dir_name(step) + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            started = time.perf_counter()
            self._download(step, staging)
            verified = verify_checkpoint(staging)
            if not verified.ok:
                log.warning("S3 tier: %s/%s/ does not verify (%s): skipped", self.uri, step_dir_name(step),
                            "; ".join(verified.problems))
                shutil.rmtree(staging, ignore_errors=True)
                continue
            final = directory / step_dir_name(step)
            if final.exists():  # a broken FSx copy of the same step: the verified S3 copy replaces it
                shutil.rmtree(final)
            staging.rename(final)
            fsync_dir(directory)
            log.info("S3 tier: step %d restored from %s/%s/ in %.1f s", step, self.uri, step_dir_name(step),
                     time.perf_counter() - started)
            return final, step
        return None

    def _download(self, step: int, staging: Path) -> None:
        prefix = self._key(step)
        staging.mkdir(parents=True)
        try:
            for page in self._s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    relative = item["Key"][len(prefix):]
                    # Keys are ours (written by upload); still, never write outside the staging folder.
                    target = (staging / relative).resolve()
                    if not relative or not target.is_relative_to(staging.resolve()):
                        raise S3TierError(f"s3://{self.bucket}/{item['Key']}: not a checkpoint file name")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    self._s3().download_file(self.bucket, item["Key"], str(target))
        except S3TierError:
            raise
        except Exception as err:  # noqa: BLE001 - see upload
            raise S3TierError(f"downloading {self.uri}/{step_dir_name(step)}/ failed: {err}") from err
