"""Staging against a real S3-compatible server on loopback (real HTTP through boto3)."""

import json

import boto3
import pytest

from components.stage import StageError, stage_s3_to_local
from pipelines.demo_data import upload_demo_data

pytestmark = pytest.mark.integration


@pytest.fixture
def s3(s3_server):
    return boto3.client("s3")  # endpoint from AWS_ENDPOINT_URL_S3, set by the server fixture


def test_stage_downloads_verifies_and_tokenizes(s3, tmp_path):
    upload_demo_data(s3, "data", "corpus/v1", num_documents=200)
    s3.put_object(Bucket="data", Key="corpus/v1/nested/dir with space/ünï.txt", Body="héllo there.\n\nbye now.".encode())
    s3.put_object(Bucket="data", Key="corpus/v1/empty.txt", Body=b"")
    manifest = stage_s3_to_local("s3://data/corpus/v1", tmp_path / "ds", val_fraction=0.1)

    assert manifest["object_count"] == 6 and manifest["downloaded"] == 6
    assert (tmp_path / "ds" / "raw" / "nested" / "dir with space" / "ünï.txt").read_text().startswith("héllo")
    assert (tmp_path / "ds" / "raw" / "empty.txt").stat().st_size == 0
    assert manifest["tokens"]["splits"]["train"]["tokens"] > 0
    assert json.loads((tmp_path / "ds" / "stage-manifest.json").read_text())["bytes"] == manifest["bytes"]


def test_restage_skips_unchanged_objects_and_fetches_changed_ones(s3, tmp_path):
    upload_demo_data(s3, "data", "corpus", num_documents=100)
    first = stage_s3_to_local("s3://data/corpus", tmp_path / "ds")
    again = stage_s3_to_local("s3://data/corpus", tmp_path / "ds")
    assert again["downloaded"] == 0
    assert again["tokens"]["content_hash"] == first["tokens"]["content_hash"]

    s3.put_object(Bucket="data", Key="corpus/part-000.jsonl", Body=b'{"text": "a new document entirely."}\n' * 50)
    changed = stage_s3_to_local("s3://data/corpus", tmp_path / "ds")
    assert changed["downloaded"] == 1
    assert changed["tokens"]["content_hash"] != first["tokens"]["content_hash"]


def test_missing_bucket_is_named(s3, tmp_path):
    with pytest.raises(StageError, match=r"S3 bucket 'nope' does not exist \(data.s3_uri=s3://nope/x\)"):
        stage_s3_to_local("s3://nope/x", tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_empty_prefix_is_named(s3, tmp_path):
    s3.create_bucket(Bucket="empty")
    with pytest.raises(StageError, match=r"no objects under s3://empty/data"):
        stage_s3_to_local("s3://empty/data", tmp_path / "ds")


def test_prefix_without_text_files_is_refused(s3, tmp_path):
    s3.create_bucket(Bucket="bin")
    s3.put_object(Bucket="bin", Key="data/x.bin", Body=b"\x00\x01")
    with pytest.raises(StageError, match="nothing to tokenize"):
        stage_s3_to_local("s3://bin/data", tmp_path / "ds")
