"""ft_launcher or torchrun, run in this process so that nothing it starts outlives it.

    python -m trainer.launcher [--node-store=DIR] [--fork-server] ft_launcher --max-restarts=3 ... -m trainer ...
    python -m trainer.launcher [--node-store=DIR] [--fork-server] torchrun --max-restarts=3 ... -m trainer ...

What the pipeline's train step runs on one machine and a TrainJob runs on each node. The launcher watches
the process that started it, and every helper it forks (ft_launcher's rank monitor servers) watches the
launcher; the workers watch it from their side (trainer.__main__). So killing the step, or the launcher,
stops the whole job. Version- and node-dependent flags are settled here, where NVRx is installed
(trainer.resilience.nvrx_compat.runtime_launcher_args).

It is also the node's keeper of the memory tier: with --node-store it makes this launch's folder there
(``DIR/launch-<pid>-<start>``), hands it to every worker it starts (trainer.checkpoint.node_store), so
restarted workers find the state their predecessors left, and removes it when the launch ends — along with
folders of launches on this node that are no longer alive. With --fork-server it starts the node's warm
server first (trainer.warm_start), so every worker — and every restarted one — starts as a fork of a process
that has already imported the trainer.
"""

import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from trainer.checkpoint.node_store import NODE_STORE_ENV
from trainer.parent_watch import forked_children_die_with_this_process, watch_parent
from trainer.resilience.nvrx_compat import FT_LAUNCHER_MODULE, runtime_launcher_args
from trainer.warm_start import WARM_START_ENV, wait_until_serving

LAUNCHERS = {"ft_launcher": FT_LAUNCHER_MODULE, "torchrun": "torch.distributed.run"}
NODE_STORE_OPTION = "--node-store="
FORK_SERVER_OPTION = "--fork-server"


def _launch_name(proc: psutil.Process) -> str:
    return f"launch-{proc.pid}-{int(proc.create_time() * 100)}"


def launch_node_store(root: Path) -> Path:
    """This launch's node-memory folder under root; folders of launches no longer running are removed."""
    root.mkdir(parents=True, exist_ok=True)
    for folder in root.glob("launch-*"):
        try:
            alive = _launch_name(psutil.Process(int(folder.name.split("-")[1]))) == folder.name
        except (ValueError, IndexError, psutil.NoSuchProcess, psutil.AccessDenied):
            alive = False
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
    folder = root / _launch_name(psutil.Process())
    folder.mkdir()
    return folder


def start_fork_server() -> tuple[subprocess.Popen, Path]:
    """The node's warm server, and the folder of its socket; its workers find it through WARM_START_ENV."""
    folder = Path(tempfile.mkdtemp(prefix="rt-fork-"))  # short: a Unix socket path has ~100 characters
    socket_path = folder / "server.sock"
    server = subprocess.Popen([sys.executable, "-m", "trainer.warm_start", str(socket_path)])
    if wait_until_serving(str(socket_path)):
        os.environ[WARM_START_ENV] = str(socket_path)
    else:  # the workers then start cold, as without the server
        print("trainer.launcher: the fork server did not start within 60 s; workers start cold", file=sys.stderr)
    return server, folder


def main(argv: list[str]) -> None:
    store_root = argv.pop(0)[len(NODE_STORE_OPTION):] if argv and argv[0].startswith(NODE_STORE_OPTION) else None
    fork_server = bool(argv) and argv[0] == FORK_SERVER_OPTION and bool(argv.pop(0))
    if not argv or argv[0] not in LAUNCHERS:
        sys.exit(f"usage: python -m trainer.launcher [{NODE_STORE_OPTION}DIR] [{FORK_SERVER_OPTION}] "
                 f"{{{'|'.join(LAUNCHERS)}}} LAUNCHER-ARGS...")
    watch_parent()
    forked_children_die_with_this_process()
    store = server = None
    if store_root is not None:
        store = launch_node_store(Path(store_root))
        os.environ[NODE_STORE_ENV] = str(store)
    if fork_server:
        server, server_folder = start_fork_server()
    launcher, module = argv[0], LAUNCHERS[argv[0]]
    sys.argv = [module, *runtime_launcher_args(launcher, argv[1:], dict(os.environ))]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        if server is not None:
            server.kill()
            shutil.rmtree(server_folder, ignore_errors=True)
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
