"""Copy-mode staging against a real S3-compatible server on loopback (real HTTP through boto3)."""

import json

import boto3
import pytest

from components.stage.s3_copy import MULTIPART_THRESHOLD, StageError
from components.stage.staging import stage_dataset
from pipelines.demo_data import upload_corpus
from trainer.config import load_config

pytestmark = pytest.mark.integration


@pytest.fixture
def s3(s3_server):
    return boto3.client("s3")  # endpoint from AWS_ENDPOINT_URL_S3, set by the server fixture


def stage(tmp_path, s3_uri, *overrides):
    data = load_config(None, [f"--data.s3_uri={s3_uri}", *overrides]).data
    return stage_dataset(data, tmp_path / "fsx" / "ds", tmp_path / "fsx")


def test_stage_downloads_verifies_and_tokenizes_tricky_keys(s3, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    upload_corpus(s3, "data", "corpus/v1", num_documents=200)
    s3.put_object(Bucket="data", Key="corpus/v1/nested/dir with space/ünï.txt", Body="héllo there.\n\nbye now.".encode())
    s3.put_object(Bucket="data", Key="corpus/v1/empty.txt", Body=b"")
    s3.put_object(Bucket="data", Key="corpus/v1/checked.txt", Body=b"with an S3 checksum.", ChecksumAlgorithm="SHA256")
    table = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["a parquet document.", "another one."], "id": [1, 2]}), table)
    s3.upload_file(str(table), "data", "corpus/v1/docs.parquet")
    big = tmp_path / "big.txt"
    big.write_bytes((b"a long line of text for a big object.\n\n" * 8192) * 60)  # ~19 MB: multipart
    assert big.stat().st_size > MULTIPART_THRESHOLD
    s3.upload_file(str(big), "data", "corpus/v1/big.txt")

    manifest = stage(tmp_path, "s3://data/corpus/v1", "--data.val_fraction=0.1")

    raw = tmp_path / "fsx" / "ds" / "raw"
    assert manifest["object_count"] == 9 and manifest["downloaded"] == 9 and manifest["mode"] == "copy"
    assert (raw / "nested" / "dir with space" / "ünï.txt").read_text().startswith("héllo")
    assert (raw / "empty.txt").stat().st_size == 0
    assert (raw / "big.txt").read_bytes() == big.read_bytes()
    verified = {o["key"].rsplit("/", 1)[-1]: o["verified"] for o in manifest["objects"]}
    assert verified["checked.txt"] == "sha256" and verified["empty.txt"] in ("crc32", "md5")
    assert verified["checked.txt"] == "sha256" and verified["ünï.txt"] == "crc32"  # boto3's default upload checksum and verified["big.txt"] == "size"
    assert manifest["tokens"]["splits"]["train"]["tokens"] > 0
    assert not list(raw.rglob(".*.part"))
    assert json.loads((tmp_path / "fsx" / "ds" / "stage-manifest.json").read_text())["bytes"] == manifest["bytes"]


def test_restage_skips_unchanged_fetches_changed_and_deletes_removed(s3, tmp_path):
    upload_corpus(s3, "data", "corpus", num_documents=100)
    s3.put_object(Bucket="data", Key="corpus/old.txt", Body=b"to be removed.")
    first = stage(tmp_path, "s3://data/corpus")
    again = stage(tmp_path, "s3://data/corpus")
    assert again["downloaded"] == 0
    assert again["tokens"]["content_hash"] == first["tokens"]["content_hash"]

    s3.put_object(Bucket="data", Key="corpus/part-000.jsonl", Body=b'{"text": "a new document entirely."}\n' * 50)
    s3.delete_object(Bucket="data", Key="corpus/old.txt")
    kept = stage(tmp_path, "s3://data/corpus")
    assert kept["downloaded"] == 1 and kept["deleted"] == []
    assert (tmp_path / "fsx" / "ds" / "raw" / "old.txt").exists()  # deletion is opt-in
    changed = stage(tmp_path, "s3://data/corpus", "--data.delete_removed=true")
    assert changed["deleted"] == ["old.txt"] and not (tmp_path / "fsx" / "ds" / "raw" / "old.txt").exists()
    assert changed["tokens"]["content_hash"] != first["tokens"]["content_hash"]


def test_missing_bucket_is_named(s3, tmp_path):
    with pytest.raises(StageError, match=r"s3://nope/x/: the S3 bucket does not exist \(data.s3_uri\)"):
        stage(tmp_path, "s3://nope/x")
    assert not (tmp_path / "fsx" / "ds" / "stage-manifest.json").exists()


def test_empty_prefix_is_named(s3, tmp_path):
    s3.create_bucket(Bucket="empty")
    with pytest.raises(StageError, match=r"no objects under s3://empty/data"):
        stage(tmp_path, "s3://empty/data")


def test_prefix_without_text_files_is_refused(s3, tmp_path):
    s3.create_bucket(Bucket="bin")
    s3.put_object(Bucket="bin", Key="data/x.bin", Body=b"\x00\x01")
    with pytest.raises(StageError, match="nothing to tokenize"):
        stage(tmp_path, "s3://bin/data")


def test_throttling_and_access_denied_say_what_to_do():
    from botocore.exceptions import ClientError

    from components.stage.s3_copy import s3_error

    def error(code, status):
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    assert "lower data.max_workers" in str(s3_error(error("SlowDown", 503), "s3://b/k"))
    assert "lower data.max_workers" in str(s3_error(error("InternalError", 500), "s3://b/k"))
    assert "s3:GetObject" in str(s3_error(error("AccessDenied", 403), "s3://b/k"))


def test_single_part_objects_without_s3_checksums_are_checked_by_md5(s3, tmp_path):
    from botocore.config import Config

    plain = boto3.client("s3", config=Config(request_checksum_calculation="when_required"))
    upload_corpus(plain, "md5", "d", num_documents=50)
    manifest = stage(tmp_path, "s3://md5/d")
    assert {o["verified"] for o in manifest["objects"]} == {"md5"}


def test_dra_mode_stages_through_the_fsx_api_and_writes_the_same_manifest(s3, tmp_path):
    """S3 is the real loopback server; FSx is botocore's Stubber (checked against FSx's service model), and the
    files the metadata import makes visible on the Lustre mount are written by the test."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
    import boto3 as aws
    from botocore.stub import Stubber
    from test_fsx_dra import (FS, dra, expect_describe_fs, expect_dra_state, expect_import,  # noqa: E402
                              expect_list_dras)

    upload_corpus(s3, "bucket", "datasets/demo", num_documents=50)
    data = load_config(None, ["--data.s3_uri=s3://bucket/datasets/demo", "--data.stage_mode=dra",
                              f"--data.fsx_file_system_id={FS}", "--data.require_lustre_mount=false",
                              "--data.dra_poll_seconds=0.01"]).data
    fsx_root = tmp_path / "fsx"
    dataset_dir = fsx_root / "datasets" / "demo"
    fsx = aws.client("fsx", region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")
    with Stubber(fsx) as stubber:
        expect_describe_fs(stubber)
        expect_list_dras(stubber, [dra("AVAILABLE")])
        expect_dra_state(stubber, "AVAILABLE")
        expect_import(stubber, "SUCCEEDED")
        with pytest.raises(StageError, match="not visible under .* after the metadata import"):
            stage_dataset(data, dataset_dir, fsx_root, fsx=fsx)

        for obj in s3.list_objects_v2(Bucket="bucket", Prefix="datasets/demo/")["Contents"]:  # the Lustre view
            target = dataset_dir / "raw" / obj["Key"][len("datasets/demo/"):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(s3.get_object(Bucket="bucket", Key=obj["Key"])["Body"].read())
        expect_describe_fs(stubber)
        expect_list_dras(stubber, [dra("AVAILABLE")])
        expect_dra_state(stubber, "AVAILABLE")
        expect_import(stubber, "SUCCEEDED")
        manifest = stage_dataset(data, dataset_dir, fsx_root, fsx=fsx)
        stubber.assert_no_pending_responses()
    assert manifest["mode"] == "dra" and manifest["fsx_path"] == "/datasets/demo/raw"
    assert manifest["dra"]["association_id"] == "dra-0123456789abcdef0" and manifest["downloaded"] == 0
    assert manifest["object_count"] > 0 and manifest["tokens"]["splits"]["train"]["tokens"] > 0
    # No lfs here: the preload was asked for, skipped loudly, and the manifest says why.
    assert manifest["dra"]["preload"]["requested"] and "lfs tool" in manifest["dra"]["preload"]["skipped"]
