"""The DRA flow against botocore's Stubber: every request is checked against FSx's real service model, and
the import task against the rules of the FSx API reference (CreateDataRepositoryTask), which botocore ships
as the operation's documentation: for import tasks "the list contains paths in the Amazon S3 bucket ... in
the format s3://bucket-name/prefix", and the report "Path you provide must be within the Amazon S3 location
that the file system is linked to ... The DataRepositoryPath of one of the associations"."""

import datetime

import boto3
import pytest
from botocore.stub import ANY, Stubber

from components.stage.fsx import FsxError, stage_via_dra

FS = "fs-0123456789abcdef0"
FSX_PATH = "/datasets/demo/raw"
S3_PATH = "s3://bucket/datasets/demo/"
NOW = datetime.datetime(2026, 11, 29, tzinfo=datetime.timezone.utc)


@pytest.fixture
def fsx():
    client = boto3.client("fsx", region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test")
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def file_system(version="2.15", deployment="SCRATCH_2", lifecycle="AVAILABLE"):
    return {"FileSystems": [{"FileSystemId": FS, "FileSystemType": "LUSTRE", "Lifecycle": lifecycle,
                             "FileSystemTypeVersion": version, "DNSName": f"{FS}.fsx.us-east-1.amazonaws.com",
                             "LustreConfiguration": {"DeploymentType": deployment, "MountName": "abcdefgh"}}]}


def dra(lifecycle="AVAILABLE", association_id="dra-0123456789abcdef0", fsx_path=FSX_PATH, s3_path=S3_PATH, **extra):
    return {"AssociationId": association_id, "FileSystemId": FS, "Lifecycle": lifecycle, "FileSystemPath": fsx_path,
            "DataRepositoryPath": s3_path, "CreationTime": NOW, **extra}


def task(lifecycle, **extra):
    return {"TaskId": "task-0123456789abcdef0", "Lifecycle": lifecycle, "Type": "IMPORT_METADATA_FROM_REPOSITORY",
            "CreationTime": NOW, "FileSystemId": FS, "Paths": [S3_PATH], **extra}


def expect_describe_fs(stubber, **kwargs):
    stubber.add_response("describe_file_systems", file_system(**kwargs), {"FileSystemIds": [FS]})


def expect_list_dras(stubber, associations):
    stubber.add_response("describe_data_repository_associations", {"Associations": associations},
                         {"Filters": [{"Name": "file-system-id", "Values": [FS]}]})


def expect_dra_state(stubber, lifecycle, **extra):
    stubber.add_response("describe_data_repository_associations", {"Associations": [dra(lifecycle, **extra)]},
                         {"AssociationIds": ["dra-0123456789abcdef0"]})


def expect_import(stubber, *lifecycles, **final):
    stubber.add_response("create_data_repository_task", {"DataRepositoryTask": task("PENDING")}, {
        "Type": "IMPORT_METADATA_FROM_REPOSITORY", "Paths": ANY, "FileSystemId": FS, "Report": ANY,
        "ClientRequestToken": ANY, "Tags": ANY})
    for index, lifecycle in enumerate(lifecycles):
        extra = final if index == len(lifecycles) - 1 else {}
        stubber.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [task(lifecycle, **extra)]},
                             {"TaskIds": ["task-0123456789abcdef0"]})


def sent_import_tasks(client):
    """Every CreateDataRepositoryTask request the client makes (the Stubber then validates it against the model)."""
    sent = []
    client.meta.events.register("before-parameter-build.fsx.CreateDataRepositoryTask",
                                lambda params, **kwargs: sent.append(dict(params)))
    return sent


def run(client, tmp_path, sleeps=None, **overrides):
    kwargs = dict(file_system_id=FS, mount_root=tmp_path, fsx_path=FSX_PATH, s3_uri=S3_PATH.rstrip("/"),
                  auto_import=["NEW", "CHANGED", "DELETED"], timeout=3600, poll_seconds=5, data_fingerprint="f1",
                  require_lustre_mount=False, preload_contents=False,
                  sleep=(sleeps.append if sleeps is not None else lambda s: None))
    return stage_via_dra(client, **{**kwargs, **overrides})


def test_creates_the_dra_waits_for_it_and_imports(fsx, tmp_path):
    client, stubber = fsx
    expect_describe_fs(stubber)
    expect_list_dras(stubber, [dra(association_id="dra-0aaaaaaaaaaaaaaaa", fsx_path="/other", s3_path="s3://b/o/")])
    stubber.add_response("create_data_repository_association", {"Association": dra("CREATING")}, {
        "FileSystemId": FS, "FileSystemPath": FSX_PATH, "DataRepositoryPath": S3_PATH,
        "BatchImportMetaDataOnCreate": True,
        "S3": {"AutoImportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]}},
        "ClientRequestToken": ANY, "Tags": [{"Key": "managed-by", "Value": "resilient-train"}]})
    expect_dra_state(stubber, "CREATING")
    expect_dra_state(stubber, "AVAILABLE")
    expect_import(stubber, "EXECUTING", "EXECUTING", "SUCCEEDED", Status={"TotalCount": 3, "SucceededCount": 3})
    sleeps = []
    result = run(client, tmp_path, sleeps)
    assert result["association_created"] and result["association_id"] == "dra-0123456789abcdef0"
    assert result["import_status"] == {"TotalCount": 3, "SucceededCount": 3}
    assert result["mount_name"] == "abcdefgh"
    assert sleeps == [5, 5, 10]  # backoff doubles per wait, for the DRA and again for the task


def test_an_existing_dra_is_reused_and_only_imports(fsx, tmp_path):
    client, stubber = fsx
    expect_describe_fs(stubber)
    expect_list_dras(stubber, [dra("AVAILABLE")])
    expect_dra_state(stubber, "AVAILABLE")
    expect_import(stubber, "SUCCEEDED")
    assert run(client, tmp_path)["association_created"] is False


def test_overlapping_paths_are_refused_naming_the_dra(fsx, tmp_path):
    client, stubber = fsx
    expect_describe_fs(stubber)
    expect_list_dras(stubber, [dra(association_id="dra-0bbbbbbbbbbbbbbbb", fsx_path="/datasets", s3_path="s3://x/y/")])
    with pytest.raises(FsxError, match=r"/datasets/demo/raw overlaps DRA dra-0bbbbbbbbbbbbbbbb \(/datasets <-> s3://x/y/\)"):
        run(client, tmp_path)


def test_a_ninth_dra_is_refused(fsx, tmp_path):
    client, stubber = fsx
    expect_describe_fs(stubber)
    expect_list_dras(stubber, [dra(association_id=f"dra-0{i:016x}", fsx_path=f"/p{i}", s3_path=f"s3://b/p{i}/")
                               for i in range(8)])
    with pytest.raises(FsxError, match="already has 8 data repository associations"):
        run(client, tmp_path)


def test_a_misconfigured_dra_surfaces_aws_message(fsx, tmp_path):
    client, stubber = fsx
    expect_describe_fs(stubber)
    expect_list_dras(stubber, [dra("CREATING")])
    expect_dra_state(stubber, "MISCONFIGURED", FailureDetails={"Message": "Access denied to s3://bucket"})
    with pytest.raises(FsxError, match=r"is MISCONFIGURED: Access denied to s3://bucket"):
        run(client, tmp_path)


def test_a_failed_import_names_the_report(fsx, tmp_path):
    client, stubber = fsx
    expect_describe_fs(stubber)
    expect_list_dras(stubber, [dra("AVAILABLE")])
    expect_dra_state(stubber, "AVAILABLE")
    expect_import(stubber, "EXECUTING", "FAILED", FailureDetails={"Message": "2 files failed"},
                  Report={"Enabled": True, "Path": S3_PATH + ".fsx-reports"})
    with pytest.raises(FsxError, match=r"task-0123456789abcdef0 .* FAILED: 2 files failed.*report under "
                                       r"s3://bucket/datasets/demo/.fsx-reports"):
        run(client, tmp_path)


def test_an_import_that_outlasts_the_timeout_is_reported(fsx, tmp_path, monkeypatch):
    import components.stage.fsx as fsx_module

    client, stubber = fsx
    expect_describe_fs(stubber)
    expect_list_dras(stubber, [dra("AVAILABLE")])
    expect_dra_state(stubber, "AVAILABLE")
    expect_import(stubber, "EXECUTING", "EXECUTING", "EXECUTING")
    clock = [0.0]  # advanced by the sleeps: polls at 0, 4 and 12 s; at 12 s the 12 s budget is spent

    class FakeTimePoller(fsx_module._Poller):
        def __init__(self, timeout, first_interval, sleep):
            super().__init__(timeout, first_interval, sleep, clock=lambda: clock[0])

    monkeypatch.setattr(fsx_module, "_Poller", FakeTimePoller)
    with pytest.raises(FsxError, match=r"still EXECUTING after 12 s \(data.dra_import_timeout_seconds\)"):
        run(client, tmp_path, timeout=12, poll_seconds=4,
            sleep=lambda seconds: clock.__setitem__(0, clock[0] + seconds))


@pytest.mark.parametrize("kwargs, message", [
    ({"version": "2.10"}, r"SCRATCH_2, Lustre 2.10\) cannot hold a data repository association"),
    ({"deployment": "SCRATCH_1", "version": "2.12"}, r"SCRATCH_1, Lustre 2.12\) cannot hold"),
    ({"lifecycle": "CREATING"}, "is CREATING, not AVAILABLE"),
])
def test_file_systems_that_cannot_hold_a_dra_are_refused(fsx, tmp_path, kwargs, message):
    client, stubber = fsx
    expect_describe_fs(stubber, **kwargs)
    with pytest.raises(FsxError, match=message):
        run(client, tmp_path)


def test_an_unknown_file_system_is_named(fsx, tmp_path):
    client, stubber = fsx
    stubber.add_client_error("describe_file_systems", service_error_code="FileSystemNotFound",
                             service_message="not found", http_status_code=400,
                             expected_params={"FileSystemIds": [FS]})
    with pytest.raises(FsxError, match=rf"FSx file system {FS} not found \(data.fsx_file_system_id\)"):
        run(client, tmp_path)


def test_a_target_that_is_not_a_lustre_mount_is_refused(fsx, tmp_path):
    client, _ = fsx
    with pytest.raises(FsxError, match=rf"data.fsx_root {tmp_path} is not on a Lustre mount"):
        run(client, tmp_path, require_lustre_mount=True)


def _within(path: str, repository: str) -> bool:
    return path.rstrip("/").startswith(repository.rstrip("/") + "/") or path.rstrip("/") == repository.rstrip("/")


def test_the_import_task_reads_the_linked_s3_prefix_and_reports_into_it(fsx, tmp_path):
    client, stubber = fsx
    expect_describe_fs(stubber)
    expect_list_dras(stubber, [dra("AVAILABLE")])
    expect_dra_state(stubber, "AVAILABLE")
    expect_import(stubber, "SUCCEEDED")
    sent = sent_import_tasks(client)
    run(client, tmp_path)
    [request] = sent
    association = dra("AVAILABLE")
    assert all(p.startswith("s3://") and _within(p, association["DataRepositoryPath"]) for p in request["Paths"])
    assert not any(p.startswith(FSX_PATH) for p in request["Paths"])  # an FSx path here fails every import
    assert request["Report"]["Enabled"] and request["Report"]["Path"].startswith("s3://")
    assert _within(request["Report"]["Path"], association["DataRepositoryPath"])


def test_a_retried_import_reuses_its_token_and_changed_data_gets_a_new_one(tmp_path):
    """A retried step must not start a second task for the same data (ClientRequestToken is the API's
    idempotency token), while a re-stage after the data changed must import again."""
    tokens = []
    for fingerprint in ("listing-1", "listing-1", "listing-2"):
        client = boto3.client("fsx", region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")
        with Stubber(client) as stubber:
            expect_describe_fs(stubber)
            expect_list_dras(stubber, [dra("AVAILABLE")])
            expect_dra_state(stubber, "AVAILABLE")
            expect_import(stubber, "SUCCEEDED")
            sent = sent_import_tasks(client)
            run(client, tmp_path, data_fingerprint=fingerprint)
        tokens.append(sent[0]["ClientRequestToken"])
    assert tokens[0] == tokens[1] != tokens[2]


def test_a_missing_lfs_skips_the_preload_loudly_and_says_so(tmp_path, monkeypatch, caplog):
    from components.stage.fsx import preload

    monkeypatch.setenv("PATH", str(tmp_path))  # no lfs on it
    (tmp_path / "a.txt").write_text("x")
    result = preload(tmp_path)
    assert result["preloaded_files"] == 0 and "lfs tool" in result["skipped"]
    assert any(r.levelname == "WARNING" and "preload skipped" in r.message for r in caplog.records)
