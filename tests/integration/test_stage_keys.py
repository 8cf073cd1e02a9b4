"""Hostile and unusual S3 keys against a real S3-compatible server on loopback.

S3 object keys are arbitrary UTF-8 strings up to 1,024 bytes: '/' has no meaning to S3, so '..', '.', empty
segments ('a//b'), a leading '/' after the prefix and even NUL are all valid keys (Amazon S3 User Guide,
"Naming Amazon S3 objects": "The name for a key is a sequence of Unicode characters whose UTF-8 encoding is
at most 1,024 bytes long"; "Object key names with the value '..' or '.' ... require special handling").
A POSIX file system gives those same strings meaning (path resolution, POSIX.1-2017 §4.13; NAME_MAX per
component from pathconf(3)), so a key must be checked before it becomes a path — or anyone who can write to
the bucket can write anywhere the pod can.
"""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest

from components.stage.s3_copy import StageError
from components.stage.staging import stage_dataset
from trainer.config import load_config

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def s3(s3_server):
    client = boto3.client("s3")  # endpoint from AWS_ENDPOINT_URL_S3, set by the server fixture
    client.create_bucket(Bucket="data")
    client.put_object(Bucket="data", Key="corpus/good.jsonl",
                      Body="".join(json.dumps({"text": f"good document number {i}."}) + "\n" for i in range(80)).encode())
    client.put_object(Bucket="data", Key="corpus/other.txt", Body=b"another document.\n\nand one more.")
    return client


def stage(tmp_path, *overrides, s3_uri="s3://data/corpus"):
    data = load_config(None, [f"--data.s3_uri={s3_uri}", *overrides]).data
    return stage_dataset(data, tmp_path / "fsx" / "datasets" / "ds", tmp_path / "fsx")


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("key, reason", [
    ("corpus/../escape.txt", "'..' segment"),
    ("corpus/sub/../../escape.txt", "'..' segment"),
    ("corpus/./dot.txt", "'.' segment"),
    ("corpus/a//b.txt", "empty path segment"),
    ("corpus/x\x00y.txt", "NUL"),
    ("corpus/" + "n" * 256 + ".txt", "longer than the file system's NAME_MAX"),
])
def test_a_hostile_key_fails_the_stage_naming_the_key_and_writes_nothing_outside(s3, tmp_path, key, reason):
    s3.put_object(Bucket="data", Key=key, Body=b"evil")
    with pytest.raises(StageError) as err:
        stage(tmp_path)
    assert repr(key) in str(err.value) and reason in str(err.value)
    assert "data.on_bad_key=skip" in str(err.value)  # says what to do
    # Not one file written (the keys are checked before any download); the stage lock is all there is.
    assert files_under(tmp_path / "fsx") == {"datasets/ds/.stage.lock"}
    assert not (tmp_path / "fsx" / "datasets" / "ds" / "stage-manifest.json").exists()


def test_an_absolute_path_from_an_empty_segment_is_refused(s3, tmp_path):
    target = Path("/tmp") / f"rt-escape-{uuid.uuid4().hex}.txt"
    key = f"corpus/{target}"  # corpus//tmp/rt-escape-….txt: joined naively this is an absolute path
    s3.put_object(Bucket="data", Key=key, Body=b"evil")
    try:
        with pytest.raises(StageError, match="empty path segment"):
            stage(tmp_path)
        assert not target.exists()
        manifest = stage(tmp_path, "--data.on_bad_key=skip")
        assert not target.exists()
        assert manifest["skipped_keys"] == [{"key": key, "reason": "empty path segment (a '//' or a leading '/')"}]
    finally:
        target.unlink(missing_ok=True)


def test_skip_mode_stages_the_rest_and_counts_what_it_skipped(s3, tmp_path):
    for key in ("corpus/../escape.txt", "corpus/a//b.txt", "corpus/x\x00y.txt"):
        s3.put_object(Bucket="data", Key=key, Body=b"evil")
    manifest = stage(tmp_path, "--data.on_bad_key=skip")
    dataset = tmp_path / "fsx" / "datasets" / "ds"
    assert files_under(dataset / "raw") == {"good.jsonl", "other.txt"}
    assert not (dataset / "escape.txt").exists() and not (tmp_path / "fsx" / "datasets" / "escape.txt").exists()
    assert manifest["skipped_count"] == 3
    assert sorted(s["key"] for s in manifest["skipped_keys"]) == sorted(
        ["corpus/../escape.txt", "corpus/a//b.txt", "corpus/x\x00y.txt"])
    assert manifest["object_count"] == 2
    on_disk = json.loads((dataset / "stage-manifest.json").read_text())
    assert on_disk["skipped_count"] == 3


def test_an_object_that_is_also_a_directory_of_other_objects(s3, tmp_path):
    s3.put_object(Bucket="data", Key="corpus/a", Body=b"a file named a")
    s3.put_object(Bucket="data", Key="corpus/a/b.txt", Body=b"a document under a/.")
    with pytest.raises(StageError, match=r"'corpus/a'.*also a directory of other objects.*'corpus/a/b.txt'"):
        stage(tmp_path)
    manifest = stage(tmp_path, "--data.on_bad_key=skip")
    assert [s["key"] for s in manifest["skipped_keys"]] == ["corpus/a"]
    assert (tmp_path / "fsx" / "datasets" / "ds" / "raw" / "a" / "b.txt").read_bytes() == b"a document under a/."


def test_unusual_but_valid_keys_stage_byte_identical(s3, tmp_path):
    bodies = {
        "corpus/with space/and+plus%percent#hash.txt": b"symbols in the key.",
        "corpus/ünïcödé/日本語/файл.txt": "unicode everywhere.".encode(),
        "corpus/empty.txt": b"",
        "corpus/" + "/".join(f"d{i}" for i in range(12)) + "/deep.txt": b"twelve folders deep.",
        "corpus/" + "/".join(["k" * 200, "l" * 200, "m" * 200]) + "/" + "n" * 180 + ".txt": b"a long key.",
    }
    for key, body in bodies.items():
        s3.put_object(Bucket="data", Key=key, Body=body)
    s3.put_object(Bucket="data", Key="corpus/markers/", Body=b"")  # a console-made "folder": not a file
    big = os.urandom(17 * 1024 * 1024)  # above the 16 MiB multipart threshold of the uploader and the stager
    s3.upload_fileobj(__import__("io").BytesIO(big), "data", "corpus/multi part.bin")
    assert len(max(bodies, key=lambda k: len(k.encode())).encode()) >= 790

    manifest = stage(tmp_path)
    raw = tmp_path / "fsx" / "datasets" / "ds" / "raw"
    for key, body in bodies.items():
        assert (raw / key[len("corpus/"):]).read_bytes() == body, key
    assert (raw / "multi part.bin").read_bytes() == big
    assert (raw / "markers").is_dir() is False and manifest["skipped_count"] == 0
    assert manifest["object_count"] == len(bodies) + 3  # + good.jsonl, other.txt, the multipart object
    assert files_under(raw) == {k[len("corpus/"):] for k in bodies} | {"good.jsonl", "other.txt", "multi part.bin"}


def test_the_stage_command_runs_the_stage_step_alone(s3, tmp_path):
    """`python -m pipelines stage` as a user pre-warming FSx runs it: exit 2 naming the key (the input is unusable
    as it is), 0 with skip."""
    s3.put_object(Bucket="data", Key="corpus/../escape.txt", Body=b"evil")
    command = [sys.executable, "-m", "pipelines", "stage", "--config", "local", f"--run.work_dir={tmp_path}",
               "--local.s3_server=false", "--local.upload_demo_data=false", "--data.s3_uri=s3://data/corpus"]
    failed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert "'corpus/../escape.txt'" in failed.stderr and "'..' segment" in failed.stderr
    assert not (tmp_path / "fsx" / "datasets" / "escape.txt").exists()

    staged = subprocess.run([*command, "--data.on_bad_key=skip"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert staged.returncode == 0, staged.stdout + staged.stderr
    manifest_path = tmp_path / "fsx" / "datasets" / "demo" / "stage-manifest.json"
    assert staged.stdout.strip().splitlines()[-1] == str(manifest_path)
    manifest = json.loads(manifest_path.read_text())
    assert manifest["object_count"] == 2 and manifest["skipped_count"] == 1
    assert "1 key(s) skipped" in staged.stdout
