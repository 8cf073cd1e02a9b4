"""DRA mode: link an FSx for Lustre file system to an S3 prefix and import the prefix's metadata.

    stage_via_dra(fsx_client, file_system_id="fs-…", mount_root=Path("/fsx"), fsx_path="/datasets/demo/raw",
                  s3_uri="s3://bucket/datasets/demo", ...)

1. the file system exists, is AVAILABLE, is Lustre 2.12/2.15 and not SCRATCH_1 (those cannot hold DRAs);
2. the DRA linking fsx_path to the S3 prefix is found, or created (auto-import policy, batch metadata
   import) — a path that overlaps another DRA, or a 9th DRA, is refused with the conflicting DRA named;
3. wait (backoff, timeout) until it is AVAILABLE; MISCONFIGURED / FAILED surface with AWS's message;
4. an ``IMPORT_METADATA_FROM_REPOSITORY`` task for the DRA's S3 prefix, with a completion report written to
   ``<prefix>/.fsx-reports`` in that linked repository; FAILED / CANCELED surface with the report's location.
   The FSx API reference (CreateDataRepositoryTask) fixes both: an import task's ``Paths`` are paths in the
   S3 bucket (``s3://bucket/prefix``), not on the file system, and a report ``Path`` must lie within the
   ``DataRepositoryPath`` of one of the file system's associations;
5. optionally preload file contents (``lfs hsm_restore``, in parallel; verified with ``lfs hsm_action``).
   Without the ``lfs`` tool the preload is skipped loudly and the manifest says so.

Idempotent: a re-run finds the same DRA and only imports; the import task's ClientRequestToken is derived
from the file system, the prefix and the listing's fingerprint, so a retried step (same data) gets the same
task back instead of starting a second one, and changed data gets a new task. The FSx control plane cannot exist on this
machine; the tests drive this module through ``botocore.stub.Stubber``, which checks every request
against FSx's service model.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

log = logging.getLogger(__name__)

MAX_DRAS_PER_FILE_SYSTEM = 8
DRA_VERSIONS = ("2.12", "2.15")
REPORT_DIR = ".fsx-reports"  # below the DRA's S3 prefix; never staged as data
_TAG = {"Key": "managed-by", "Value": "resilient-train"}


class FsxError(RuntimeError):
    """The FSx side cannot stage the data; the message names the file system, DRA or task and what to do."""


def fsx_client(region: str = ""):
    return boto3.client("fsx", region_name=region or None,
                        config=BotoConfig(retries={"max_attempts": 8, "mode": "standard"}))


def mount_type(path: Path) -> str | None:
    """The file system type of the mount holding path (from /proc/mounts), None when unknown."""
    path = Path(path).resolve()
    best, best_type = "", None
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        if (str(path) == mount_point or str(path).startswith(mount_point.rstrip("/") + "/")) and len(mount_point) > len(best):
            best, best_type = mount_point, fields[2]
    return best_type


def check_file_system(client, file_system_id: str) -> dict[str, Any]:
    try:
        [fs] = client.describe_file_systems(FileSystemIds=[file_system_id])["FileSystems"]
    except ClientError as err:
        if err.response["Error"]["Code"] == "FileSystemNotFound":
            raise FsxError(f"FSx file system {file_system_id} not found (data.fsx_file_system_id): check the id "
                           "and the region (AWS_REGION)") from err
        raise
    if fs["FileSystemType"] != "LUSTRE":
        raise FsxError(f"FSx file system {file_system_id} is {fs['FileSystemType']}, not LUSTRE: DRAs need FSx "
                       "for Lustre (data.fsx_file_system_id)")
    if fs["Lifecycle"] != "AVAILABLE":
        raise FsxError(f"FSx file system {file_system_id} is {fs['Lifecycle']}, not AVAILABLE: wait for it or fix "
                       f"it ({fs.get('FailureDetails', {}).get('Message', 'no details')})")
    deployment = fs.get("LustreConfiguration", {}).get("DeploymentType")
    version = fs.get("FileSystemTypeVersion", "2.10")
    if deployment == "SCRATCH_1" or version not in DRA_VERSIONS:
        raise FsxError(f"FSx file system {file_system_id} ({deployment}, Lustre {version}) cannot hold a data "
                       f"repository association: use SCRATCH_2 or PERSISTENT with FileSystemTypeVersion "
                       f"{' or '.join(DRA_VERSIONS)} (2.10 is the API's default unless set)")
    return fs


def _overlaps(a: str, b: str) -> bool:
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def find_or_create_dra(client, file_system_id: str, fsx_path: str, s3_path: str, auto_import: list[str]) -> tuple[dict, bool]:
    """The DRA linking fsx_path to s3_path: (association, created)."""
    associations: list[dict] = []
    kwargs: dict[str, Any] = {"Filters": [{"Name": "file-system-id", "Values": [file_system_id]}]}
    while True:  # botocore has no paginator for this call
        page = client.describe_data_repository_associations(**kwargs)
        associations.extend(page["Associations"])
        if not page.get("NextToken"):
            break
        kwargs["NextToken"] = page["NextToken"]
    for dra in associations:
        if dra["Lifecycle"] in ("DELETING",):
            continue
        same_fsx = dra["FileSystemPath"].rstrip("/") == fsx_path.rstrip("/")
        same_s3 = dra["DataRepositoryPath"].rstrip("/") == s3_path.rstrip("/")
        if same_fsx and same_s3:
            log.info("found DRA %s: %s <-> %s (%s)", dra["AssociationId"], fsx_path, s3_path, dra["Lifecycle"])
            return dra, False
        if _overlaps(dra["FileSystemPath"], fsx_path):
            raise FsxError(f"FSx path {fsx_path} overlaps DRA {dra['AssociationId']} ({dra['FileSystemPath']} <-> "
                           f"{dra['DataRepositoryPath']}) on {file_system_id}: DRA paths must not nest; choose "
                           "another data.dataset_name or delete that DRA")
    if len([d for d in associations if d["Lifecycle"] != "DELETING"]) >= MAX_DRAS_PER_FILE_SYSTEM:
        raise FsxError(f"{file_system_id} already has {MAX_DRAS_PER_FILE_SYSTEM} data repository associations, "
                       "the most a file system can hold: delete one that is no longer used "
                       f"({', '.join(d['AssociationId'] for d in associations)})")
    s3: dict[str, Any] = {}
    if auto_import:
        s3["AutoImportPolicy"] = {"Events": auto_import}
    dra = client.create_data_repository_association(
        FileSystemId=file_system_id, FileSystemPath=fsx_path, DataRepositoryPath=s3_path,
        BatchImportMetaDataOnCreate=True, S3=s3, ClientRequestToken=_token(file_system_id, fsx_path, s3_path),
        Tags=[_TAG])["Association"]
    log.info("created DRA %s: %s <-> %s", dra["AssociationId"], fsx_path, s3_path)
    return dra, True


def _token(*parts: str) -> str:
    """A ClientRequestToken stable for the same request, so a retried call does not create a second one."""
    return uuid.uuid5(uuid.NAMESPACE_URL, "|".join(parts)).hex[:32]


class _Poller:
    """Backoff polling with an overall deadline."""

    def __init__(self, timeout: float, first_interval: float, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.deadline = clock() + timeout
        self.interval = first_interval
        self.max_interval = first_interval * 8
        self.timeout = timeout
        self.sleep, self.clock = sleep, clock

    def wait(self) -> bool:
        """Sleep before the next poll; False once the deadline has passed."""
        if self.clock() >= self.deadline:
            return False
        self.sleep(min(self.interval, max(0.0, self.deadline - self.clock())))
        self.interval = min(self.interval * 2, self.max_interval)
        return True


def wait_for_dra(client, association_id: str, poller: _Poller) -> dict:
    while True:
        [dra] = client.describe_data_repository_associations(AssociationIds=[association_id])["Associations"]
        state = dra["Lifecycle"]
        if state == "AVAILABLE":
            return dra
        if state in ("MISCONFIGURED", "FAILED"):
            message = dra.get("FailureDetails", {}).get("Message", "no details from FSx")
            raise FsxError(f"DRA {association_id} ({dra['FileSystemPath']} <-> {dra['DataRepositoryPath']}) is "
                           f"{state}: {message}. Check the S3 bucket policy / the file system role, then re-run")
        if not poller.wait():
            raise FsxError(f"DRA {association_id} still {state} after {poller.timeout:.0f} s "
                           "(data.dra_import_timeout_seconds): check it in the FSx console, then re-run")


def import_metadata(client, file_system_id: str, data_repository_path: str, fsx_path: str, data_fingerprint: str,
                    poller: _Poller) -> dict:
    """Run an IMPORT_METADATA_FROM_REPOSITORY task for the DRA's S3 prefix and wait for it; the finished task."""
    s3_prefix = data_repository_path.rstrip("/") + "/"
    report_path = s3_prefix + REPORT_DIR
    task = client.create_data_repository_task(
        Type="IMPORT_METADATA_FROM_REPOSITORY", Paths=[s3_prefix], FileSystemId=file_system_id,
        Report={"Enabled": True, "Path": report_path, "Format": "REPORT_CSV_20191124", "Scope": "FAILED_FILES_ONLY"},
        ClientRequestToken=_token(file_system_id, s3_prefix, data_fingerprint), Tags=[_TAG])["DataRepositoryTask"]
    task_id = task["TaskId"]
    log.info("metadata import task %s for %s -> %s started", task_id, s3_prefix, fsx_path)
    while True:
        [task] = client.describe_data_repository_tasks(TaskIds=[task_id])["DataRepositoryTasks"]
        state = task["Lifecycle"]
        if state == "SUCCEEDED":
            status = task.get("Status", {})
            log.info("import task %s succeeded: %s of %s files", task_id, status.get("SucceededCount"),
                     status.get("TotalCount"))
            return task
        if state in ("FAILED", "CANCELED", "CANCELING"):
            message = task.get("FailureDetails", {}).get("Message", "no details from FSx")
            report = task.get("Report", {}).get("Path", report_path)
            raise FsxError(f"metadata import task {task_id} for {fsx_path} is {state}: {message}. Failed files are "
                           f"listed in the completion report under {report}")
        if not poller.wait():
            raise FsxError(f"metadata import task {task_id} for {fsx_path} still {state} after "
                           f"{poller.timeout:.0f} s (data.dra_import_timeout_seconds): it keeps running on FSx; "
                           "re-run the stage step to wait again, or raise the timeout")


def preload(directory: Path, max_workers: int = 8, lfs: str | None = None) -> dict[str, Any]:
    """Restore file contents from S3 ahead of the first read; what was done, or why it was skipped."""
    lfs = lfs or shutil.which("lfs")
    if lfs is None:
        reason = ("the lfs tool (Lustre client utilities) is not in this image: file contents load lazily on first "
                  "read, so the first epoch reads through FSx from S3. Install lustre-client utilities in the "
                  "pipeline image, or set data.preload=false to silence this")
        log.warning("preload skipped: %s", reason)
        return {"requested": True, "preloaded_files": 0, "skipped": reason}
    files = [p for p in Path(directory).rglob("*") if p.is_file()]
    batches = [files[i : i + 256] for i in range(0, len(files), 256)]

    def restore(batch: list[Path]) -> None:
        subprocess.run([lfs, "hsm_restore", *map(str, batch)], check=True, capture_output=True)

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        list(pool.map(restore, batches))
    pending = files
    deadline = time.monotonic() + 3600
    while pending and time.monotonic() < deadline:
        out = subprocess.run([lfs, "hsm_action", *map(str, pending)], check=True, capture_output=True,
                             text=True).stdout
        pending = [Path(line.split(":", 1)[0]) for line in out.splitlines() if "NOOP" not in line]
        if pending:
            time.sleep(2)
    if pending:
        raise FsxError(f"{len(pending)} file(s) under {directory} still restoring after an hour, e.g. {pending[0]}")
    log.info("preloaded %d files under %s", len(files), directory)
    return {"requested": True, "preloaded_files": len(files), "skipped": None}


def stage_via_dra(client, *, file_system_id: str, mount_root: Path, fsx_path: str, s3_uri: str,
                  auto_import: list[str], timeout: float, poll_seconds: float, data_fingerprint: str,
                  require_lustre_mount: bool = True, preload_contents: bool = True, max_workers: int = 8,
                  sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """The whole DRA flow; returns what the dataset manifest records about it. data_fingerprint identifies the
    S3 listing being imported (the import task's idempotency)."""
    started = time.perf_counter()
    if require_lustre_mount and mount_type(mount_root) != "lustre":
        raise FsxError(f"data.fsx_root {mount_root} is not on a Lustre mount (found {mount_type(mount_root)!r}): "
                       "mount the FSx file system there (the FSx CSI driver's PVC) or use data.stage_mode=copy")
    fs = check_file_system(client, file_system_id)
    s3_path = s3_uri.rstrip("/") + "/"
    dra, created = find_or_create_dra(client, file_system_id, fsx_path, s3_path, auto_import)
    dra = wait_for_dra(client, dra["AssociationId"], _Poller(timeout, poll_seconds, sleep))
    task = import_metadata(client, file_system_id, dra["DataRepositoryPath"], fsx_path, data_fingerprint,
                           _Poller(timeout, poll_seconds, sleep))
    local_dir = Path(mount_root) / fsx_path.lstrip("/")
    preloaded = (preload(local_dir, max_workers) if preload_contents
                 else {"requested": False, "preloaded_files": 0, "skipped": None})
    return {"file_system_id": file_system_id, "file_system_dns": fs.get("DNSName"),
            "mount_name": fs.get("LustreConfiguration", {}).get("MountName"),
            "association_id": dra["AssociationId"], "association_created": created, "fsx_path": fsx_path,
            "data_repository_path": dra["DataRepositoryPath"], "import_task_id": task["TaskId"],
            "import_status": task.get("Status", {}), "import_report": task.get("Report", {}).get("Path"),
            "preload": preloaded, "preloaded_files": preloaded["preloaded_files"],
            "dra_seconds": time.perf_counter() - started}
