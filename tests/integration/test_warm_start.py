"""Warm worker starts (trainer/launch/warm_start.py): the worker ft_launcher starts is a thin client that runs the
trainer as a fork of the node's server. ft_launcher only ever sees the client, so the client must behave as
the trainer would: its output, its exit status, its death taking the trainer with it.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from trainer.env import WARM_START_ENV
from trainer.launch.warm_start import wait_until_serving
from trainer.run.run_dir import RunDir

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the tests that ask it (each waits for the child its own request forked, and leaves none
    behind): its ~4.5 s import once, as a node's server serves every worker start of its launcher."""
    socket_path = tmp_path_factory.mktemp("server") / "server.sock"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.warm_start", str(socket_path)])
    try:
        assert wait_until_serving(str(socket_path), timeout=120)
        yield proc, socket_path
    finally:
        proc.kill()
        proc.wait()


def _client(socket_path, *args, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *args],
                            env={**os.environ, WARM_START_ENV: str(socket_path), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _new_child(proc, before: set[int]) -> psutil.Process:
    """The server's one child that is not in `before` (the children it had when the request was made)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = [child for child in psutil.Process(proc.pid).children() if child.pid not in before]
        if new:
            [child] = new
            return child
        time.sleep(0.05)
    raise AssertionError("the server forked no child for the request within 60 s")


def _children(proc) -> set[int]:
    return {child.pid for child in psutil.Process(proc.pid).children()}


def _hanging_trainer(proc, socket_path, tmp_path, token_dir, training_config):
    """A worker whose trainer hangs at step 2, and that trainer (the server's child)."""
    cfg = training_config(tmp_path, "warm", "--training.num_steps=50", "--faults.schedule=hang@2",
                          "--checkpoint.memory_interval_steps=0")
    config = RunDir(cfg.run_dir).write_config(cfg.to_yaml())
    before = _children(proc)
    client = _client(socket_path, "--config", str(config), "--data-dir", str(token_dir))
    return client, _new_child(proc, before)


def test_the_worker_runs_in_the_server_with_its_own_arguments_output_and_exit_status(server, tmp_path):
    proc, socket_path = server
    client = _client(socket_path, "--config", "local", "--data-dir", str(tmp_path), "--training.num_steps=0",
                     cwd=tmp_path)
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == 2  # a ConfigError, reported as the trainer reports it
    assert "training.num_steps" in stderr  # the child's stderr is the client's
    assert proc.poll() is None  # the server serves the next worker


def test_killing_the_worker_kills_the_trainer_it_runs(server, tmp_path, token_dir, training_config):
    proc, socket_path = server
    client, child = _hanging_trainer(proc, socket_path, tmp_path, token_dir, training_config)
    assert child.cmdline() == psutil.Process(proc.pid).cmdline()  # a fork of the server, not a new interpreter
    client.send_signal(signal.SIGKILL)  # as ft_launcher's stop escalates, or the OOM killer
    client.wait()
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert not alive, "the trainer outlived the worker ft_launcher knows"
    assert proc.poll() is None


def test_a_signal_to_the_worker_reaches_the_trainer_and_its_status_comes_back(server, tmp_path, token_dir,
                                                                              training_config):
    proc, socket_path = server
    client, _ = _hanging_trainer(proc, socket_path, tmp_path, token_dir, training_config)
    time.sleep(1)
    client.send_signal(signal.SIGTERM)  # what ft_launcher sends first when it stops a worker group
    client.communicate(timeout=60)
    assert client.returncode == 128 + signal.SIGTERM
    assert not psutil.Process(proc.pid).children()


def test_without_a_server_the_worker_starts_cold(tmp_path):
    """The launcher names its server's process with the socket (WARM_START_PID_ENV); a server that is gone (or
    never served) leaves the worker to start cold at once, here straight into the config's own error. Without a
    pid the worker would wait wait_until_serving's whole timeout for a server still importing."""
    from trainer.env import WARM_START_PID_ENV

    gone = subprocess.Popen(["true"])
    gone.wait()
    client = _client(tmp_path / "no-such.sock", "--config", "local", "--data-dir", str(tmp_path),
                     "--training.num_steps=0", env={WARM_START_PID_ENV: str(gone.pid)})
    _, stderr = client.communicate(timeout=120)
    assert client.returncode == 2 and "training.num_steps" in stderr


def test_a_worker_waits_for_a_server_still_importing_and_not_for_one_that_died(tmp_path, token_dir,
                                                                             training_config):
    """trainer.launcher no longer waits for its server before ft_launcher starts (the imports overlap the
    rendezvous): the first worker may ask while the server imports. It waits as long as the server lives (the
    trainer then runs as the server's child), and starts cold at once when the server is gone."""
    from trainer.env import WARM_START_PID_ENV

    socket_path = tmp_path / "server.sock"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.warm_start", str(socket_path)])
    cfg = training_config(tmp_path, "early", "--training.num_steps=50", "--faults.schedule=hang@2",
                          "--checkpoint.memory_interval_steps=0")
    config = RunDir(cfg.run_dir).write_config(cfg.to_yaml())
    client = subprocess.Popen([sys.executable, "-m", "trainer", "--config", str(config), "--data-dir", str(token_dir)],
                              env={**os.environ, WARM_START_ENV: str(socket_path), WARM_START_PID_ENV: str(proc.pid)})
    try:
        assert not socket_path.exists()  # asked before the server serves
        deadline = time.monotonic() + 120
        while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
            assert client.poll() is None
            time.sleep(0.1)
        assert len(psutil.Process(proc.pid).children()) == 1  # the trainer is the server's fork, not a cold start
    finally:
        client.kill()
        client.wait()
        proc.kill()
        proc.wait()
    started = time.monotonic()
    assert wait_until_serving(str(tmp_path / "gone.sock"), timeout=60, server=proc.pid) is False
    assert time.monotonic() - started < 5


def test_a_worker_killed_before_it_read_its_trainers_pid_leaves_the_server_serving(server, tmp_path, token_dir,
                                                                                  training_config):
    """The client reads the child's pid line after the fork; killed before that, the line stays unread and the
    server's next read of that connection fails with ECONNRESET instead of EOF (Linux af_unix). Seen in a
    clean-clone CI run: the server died of it. Forced here by a client that never reads."""
    import array
    import json
    import socket as sockets

    proc, socket_path = server
    cfg = training_config(tmp_path, "unread", "--training.num_steps=50", "--faults.schedule=hang@2",
                          "--checkpoint.memory_interval_steps=0")
    config = RunDir(cfg.run_dir).write_config(cfg.to_yaml())
    before = _children(proc)
    client = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    client.connect(str(socket_path))
    request = json.dumps({"argv": ["--config", str(config), "--data-dir", str(token_dir)], "env": dict(os.environ),
                          "cwd": str(tmp_path), "client_pid": os.getpid()}).encode()
    with open(os.devnull, "r+b") as null:
        fds = array.array("i", [null.fileno()] * 3)
        client.sendmsg([len(request).to_bytes(8, "big")], [(sockets.SOL_SOCKET, sockets.SCM_RIGHTS, fds)])
        client.sendall(request)
    child = _new_child(proc, before)
    time.sleep(0.5)  # the pid line has arrived, unread
    client.close()  # the client's end goes with unread data: ECONNRESET on the server's side
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert not alive  # the trainer went with its client
    time.sleep(0.5)
    assert proc.poll() is None  # and the server serves on
