"""Warm worker starts: a node-local fork server that has already imported the trainer.

A worker (re)started by ft_launcher or torchrun spends most of its re-init importing torch, transformers and
the trainer (about 4 s here). The launcher (trainer.launcher) therefore starts this server once per node;
it imports all of that, then forks a child for every worker that asks. The worker ft_launcher starts is a
thin client (``python -m trainer`` with ``WARM_START_ENV`` set; it imports nothing heavy): it hands the
server its arguments, environment, working directory and stdin/stdout/stderr (SCM_RIGHTS), forwards the
signals it gets to the child and exits with the child's exit status. So ft_launcher still starts, watches
and stops one process per rank, and the rank's real work starts ~4 s sooner.

Lifetimes: the child dies with its client (the server SIGKILLs it when the client's connection drops, and
the child itself watches the client) and with the server (it watches its parent), the server dies with the
launcher. The server stays single-threaded (a selector loop), so forking it is safe.
"""

import array
import atexit
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback

from trainer.env import WARM_START_PID_ENV, WORKER_STARTED_ENV
from trainer.launch.parent_watch import die_with_parent, watch_parent, watch_process
from trainer.resilience.node_exit import remove_fork_server_socket
from trainer.resilience.worker_clock import worker_started_at

_FDS = 3  # stdin, stdout, stderr
_MAX_REQUEST = 1 << 20

# DCP's writer and NVRx's monitors start with `spawn`, which re-imports the main module as __mp_main__: in a
# forked worker that is this module, so they too watch their parent here.
if __name__ == "__mp_main__":
    die_with_parent()


# -- client (the process ft_launcher starts) ------------------------------------------------------------


def run_in_fork_server(socket_path: str, argv: list[str]) -> int | None:
    """Run `python -m trainer argv` as a fork of the server; its exit status, or None when there is no
    server to ask (the caller then runs the trainer in this process)."""
    server = int(os.environ[WARM_START_PID_ENV]) if os.environ.get(WARM_START_PID_ENV) else None
    if not wait_until_serving(socket_path, server=server):  # still importing when the first worker starts
        return None
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(socket_path)
    except OSError:
        client.close()
        return None
    env = {**os.environ, WORKER_STARTED_ENV: repr(worker_started_at())}
    request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(),
                          "client_pid": os.getpid()}).encode()
    # Length-prefixed, and the connection stays open both ways: the server takes its end (EOF) as the client's
    # death, so the request cannot be ended by a half-close.
    header = len(request).to_bytes(8, "big")
    client.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", range(_FDS)))])
    client.sendall(request)
    reader = client.makefile("r")
    line = reader.readline()
    if not line.strip():  # the server refused the request
        client.close()
        return None
    child_pid = int(line)

    def forward(signum, frame):
        try:
            os.kill(child_pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    status = reader.readline()  # the server writes the exit status when the child is gone
    return int(status) if status.strip() else 1


# -- server -------------------------------------------------------------------------------------------------


def serve(socket_path: str) -> None:
    """Import the trainer once, then fork a child per request until the launcher goes.

    The garbage collector stays off in the server, as CPython's gc.freeze documents for a process that forks
    without exec: the import allocates ~10^6 objects that live as long as the server, so collecting them while
    importing is wasted (~0.5 s of the ~6 s import on the critical path of every launch), and frozen before each
    fork they are never scanned by a child's collections (nor their pages copied by them)."""
    gc.disable()
    importlib.import_module("trainer.job.cli")  # the point of the server: once per node, not once per worker start
    watch_parent(before_exit=lambda: remove_fork_server_socket(socket_path))  # dies with the launcher
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()  # SIGCHLD wakes the selector
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "children")
    children: dict[int, socket.socket] = {}  # child pid -> its client's connection
    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                connection, _ = listener.accept()
                pid = _fork_child(connection, listener)
                if pid is not None:
                    children[pid] = connection
                    selector.register(connection, selectors.EVENT_READ, pid)
            elif key.data == "children":
                os.read(wake_read, 4096)
                _reap(children, selector)
            else:  # the client's connection: it only ever ends (the client is gone)
                pid = key.data
                if not _receive_one(key.fileobj):
                    selector.unregister(key.fileobj)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _receive_one(connection: socket.socket) -> bytes:
    """A byte from the client, b"" once it is gone. A client killed before it read the child's pid leaves that line
    unread, and Linux then reports the close as ECONNRESET (af_unix: unix_release_sock), not as EOF: the same end.
    Seen in CI: the server died of it, taking every later worker's warm start with it."""
    try:
        return connection.recv(1)
    except ConnectionResetError:
        return b""


def _fork_child(connection: socket.socket, listener: socket.socket) -> int | None:
    header, fds = b"", []
    while len(header) < 8:
        data, ancillary, _, _ = connection.recvmsg(8 - len(header), socket.CMSG_SPACE(_FDS * 4))
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", raw[:len(raw) - len(raw) % 4]))
        if not data:
            break
        header += data
    size = int.from_bytes(header, "big") if len(header) == 8 else _MAX_REQUEST + 1
    payload = b""
    while len(payload) < size <= _MAX_REQUEST:
        data = connection.recv(size - len(payload))
        if not data:
            break
        payload += data
    if len(fds) != _FDS or len(payload) != size:  # a broken request: drop it (its client then starts cold)
        for fd in fds:
            os.close(fd)
        connection.close()
        return None
    request = json.loads(payload)
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        listener.close()
        _run_child(request, fds, connection)  # never returns
    for fd in fds:
        os.close(fd)
    connection.sendall(f"{pid}\n".encode())
    return pid


def _run_child(request: dict, fds: list[int], connection: socket.socket) -> None:
    code = 1
    try:
        gc.enable()  # the worker collects its own garbage as any process does; the server's is frozen
        connection.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        # The server imported torch under the launcher's environment; of what the launcher sets per worker,
        # only OMP_NUM_THREADS is read at import time, so it is applied here as a cold start would.
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch  # noqa: PLC0415 - already imported by the server: a lookup

            torch.set_num_threads(int(threads))
        os.chdir(request["cwd"])
        sys.argv = [sys.argv[0], *request["argv"]]
        watch_parent()  # the server
        watch_process(request["client_pid"])  # the worker ft_launcher knows
        from trainer.job.cli import main  # imported by the server already: only a lookup here

        code = main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as a normal process would, then the exit status
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # what a normal interpreter exit runs (DCP writers, logging)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        try:  # a signal death as a shell would report it: 128 + signal
            connection.sendall(f"{code if code >= 0 else 128 - code}\n".encode())
        except OSError:
            pass
        try:
            selector.unregister(connection)
        except (KeyError, ValueError):
            pass
        connection.close()


def wait_until_serving(socket_path: str, timeout: float = 60.0, server: int | None = None) -> bool:
    """True once the server accepts connections (its imports done); False after `timeout`, or at once when the
    server process (pid `server`, when known) is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and not _alive(server):
            return False
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(socket_path)
            return True
        except OSError:
            time.sleep(0.05)
        finally:
            probe.close()
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by the launcher) is gone too
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
