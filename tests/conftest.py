import pytest


@pytest.fixture
def s3_server(tmp_path):
    """A real S3-compatible server (moto) on loopback; boto3 finds it through AWS_ENDPOINT_URL_S3."""
    from pipelines.local_stack import S3Server

    with S3Server(log_dir=tmp_path / "s3-logs") as server:
        yield server
