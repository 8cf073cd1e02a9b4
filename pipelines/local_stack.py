"""The embedded local stack: an S3-compatible server on loopback and the environment that points boto3 at it.

Started and stopped by PID, never by process name, so it cannot touch anything else on the machine. boto3
code stays unchanged: it finds the server through the standard ``AWS_ENDPOINT_URL_S3`` setting.
MLflow needs no server locally (a sqlite store; ``MlflowServer`` runs one on loopback for the tests and for
anyone who wants the REST path), and the FSx mount is a plain folder.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

# moto accepts any credentials; fixed ones keep the user's real keys away from the local server.
_LOCAL_AWS_ENV = {"AWS_ACCESS_KEY_ID": "local-testing", "AWS_SECRET_ACCESS_KEY": "local-testing",
                  "AWS_SESSION_TOKEN": "", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}


class LocalStackError(RuntimeError):
    """A local service failed to start; the message names it and its log file."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float, name: str, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalStackError(f"{name} exited with code {proc.returncode} while starting; see {log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise LocalStackError(f"{name} did not listen on 127.0.0.1:{port} within {timeout:.0f} s; see {log_path}")


class S3Server:
    """moto's S3-compatible server on 127.0.0.1 on a free port, as a child process."""

    def __init__(self, log_dir: Path, startup_timeout: float = 60.0):
        self.log_path = Path(log_dir) / "s3-server.log"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._saved_env: dict[str, str | None] = {}

    @property
    def endpoint_url(self) -> str:
        assert self.port is not None, "server not started"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "S3Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        with self.log_path.open("ab") as log_file:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_for_port(self.port, self.proc, self.startup_timeout, "the S3 server (moto)", self.log_path)
        except LocalStackError:
            self.stop()
            raise
        env = {**_LOCAL_AWS_ENV, "AWS_ENDPOINT_URL_S3": self.endpoint_url}
        self._saved_env = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        log.info("S3 server (moto) pid %d at %s; log %s", self.proc.pid, self.endpoint_url, self.log_path)
        return self

    def stop(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        log.info("S3 server (moto) pid %d stopped", self.proc.pid)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 over a sqlite store, in its own process group.

    The server starts a job-runner child that outlives a SIGTERM to the parent, so the whole group is
    stopped. The same port can be started again after ``stop()`` (an outage, as the tests make one).
    """

    def __init__(self, store_dir: Path, port: int | None = None, startup_timeout: float = 90.0):
        self.store_dir = Path(store_dir)
        self.log_path = self.store_dir / "mlflow-server.log"
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def tracking_uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "MlflowServer":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--workers", "1", "--backend-store-uri", f"sqlite:///{self.store_dir / 'mlflow.db'}",
                   "--default-artifact-root", (self.store_dir / "artifacts").as_uri()]
        with self.log_path.open("ab") as log_file:
            self.proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LocalStackError(f"mlflow server exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.tracking_uri + "/health", timeout=1) as answer:
                    if answer.status == 200:
                        log.info("MLflow server pid %d at %s", self.proc.pid, self.tracking_uri)
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise LocalStackError(f"mlflow server not healthy at {self.tracking_uri} within "
                              f"{self.startup_timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.1)
            if not _group_alive(self.proc.pid):
                break
        self.proc.poll()
        log.info("MLflow server pid %d stopped", self.proc.pid)

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
