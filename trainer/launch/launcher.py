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

With --check-node=GPUS,EFA it first checks the node (trainer.node_health) and exits 44 when it is not fit.
With --run-dir it samples this node's system metrics into ``<run_dir>/system/samples.jsonl`` (a line per sample, each naming its node) (the train
step forwards them to MLflow), and it ends the launch with exit code 42 when the restart budget gave up
(``<run_dir>/gave_up.json`` of this launch's lease generation; trainer.resilience.budget): ft_launcher's own
restart count is kept out of the way, so this is what stops a crash loop at this layer.

In a multi-node job it is the node: its exit code says what becomes of it (trainer.launch.node_lifecycle) — 43 when
its rendezvous waited resilience.replacement_timeout_seconds for a lost node's replacement in vain (the whole
job restarts); every process it starts carries the node's token, so the node_loss drill can end them all.
"""

import contextlib
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

from trainer.checkpoint.node_folders import owner_name, remove_dead_owners
from trainer.env import (CRASH_LOOP_EXIT_CODE, GENERATION_ENV, GROUP_RESTART_EXIT_CODE, NODE_GENERATION_ENV, NODE_INDEX_ENV,
                         NODE_LAUNCHER_PID_ENV, NODE_RANK_ENV, NODE_STORE_ENV, NODE_TOKEN_ENV, NODE_UNHEALTHY_EXIT_CODE,
                         REPLACEMENT_TIMEOUT_EXIT_CODE, REPLICA_GROUP_ENV, WARM_START_ENV, WARM_START_PID_ENV)
from trainer.launch.groups import REPLICA_GROUPS_OPTION, join_replica_group
from trainer.resilience.health import node_problems
from trainer.launch.node_watch import NodeWatch
from trainer.launch.parent_watch import forked_children_die_with_this_process, watch_parent
from trainer.launch.rendezvous_store import report_finished
from trainer.launch.warm_start import wait_until_serving
from trainer.observe.system_metrics import SystemMetricsSampler, nvml
from trainer.resilience.budget import read_gave_up
from trainer.resilience.nvrx_compat import (FT_LAUNCHER_MODULE, evict_predecessors_from_rendezvous,
                                            quiet_health_checks_without_gpu, runtime_launcher_args, stable_node_rank)
from trainer.run.lease import claim_node
from trainer.run.run_dir import RunDir

LAUNCHERS = {"ft_launcher": FT_LAUNCHER_MODULE, "torchrun": "torch.distributed.run"}
NODE_STORE_OPTION = "--node-store="
FORK_SERVER_OPTION = "--fork-server"
RUN_DIR_OPTION = "--run-dir="
CHECK_NODE_OPTION = "--check-node="
STORE_TIMEOUT_OPTION = "--store-timeout="
USAGE = (f"usage: python -m trainer.launcher [{NODE_STORE_OPTION}DIR] [{FORK_SERVER_OPTION}] [{RUN_DIR_OPTION}DIR] "
         f"[{CHECK_NODE_OPTION}GPUS,EFA] [{REPLICA_GROUPS_OPTION}R] [{STORE_TIMEOUT_OPTION}SECONDS] "
         f"{{{'|'.join(LAUNCHERS)}}} LAUNCHER-ARGS...")
SYSTEM_METRICS_SECONDS = 10.0


def launch_node_store(root: Path) -> Path:
    """This launch's node-memory folder under root; folders of launches (or processes) no longer running are
    removed."""
    root.mkdir(parents=True, exist_ok=True)
    remove_dead_owners(root)
    folder = root / owner_name("launch", psutil.Process())
    folder.mkdir()
    return folder


def start_fork_server() -> tuple[subprocess.Popen, Path]:
    """The node's warm server, and the folder of its socket; its workers find it through WARM_START_ENV. Not
    waited for: its imports (seconds) run while ft_launcher starts and meets the other nodes, and a worker
    asks it only once it serves (trainer.warm_start.run_in_fork_server waits while it is alive)."""
    folder = Path(tempfile.mkdtemp(prefix="rt-fork-"))  # short: a Unix socket path has ~100 characters
    socket_path = folder / "server.sock"
    server = subprocess.Popen([sys.executable, "-m", "trainer.warm_start", str(socket_path)])
    os.environ[WARM_START_ENV] = str(socket_path)
    os.environ[WARM_START_PID_ENV] = str(server.pid)

    def report_a_slow_start() -> None:
        if not wait_until_serving(str(socket_path), server=server.pid):
            print("trainer.launcher: the fork server did not start within 60 s; workers start cold", file=sys.stderr)

    threading.Thread(target=report_a_slow_start, name="fork-server-start", daemon=True).start()
    return server, folder


class GiveUpWatch:
    """Polls the run folder for the restart budget's give-up of this launch, then stops the launcher the way a
    SIGTERM does (ft_launcher and torchrun stop their workers and raise SignalException), again every
    `resend_seconds` until the launcher has returned: the exception a signal raises can be swallowed where it
    lands (seen: inside a logging handler's write, which reports and drops it), and the launcher would go on
    restarting workers that exit 42 at once."""

    def __init__(self, run_dir: Path, generation: int | None, interval_seconds: float = 1.0,
                 resend_seconds: float = 5.0):
        self.run_dir = run_dir
        self.generation = generation
        self.started = time.time()
        self.interval_seconds = interval_seconds
        self.resend_seconds = resend_seconds
        self.fired: dict | None = None
        self.done = threading.Event()  # set once the launcher returned: no more signals

    def matches(self, record: dict | None) -> bool:
        if record is None:
            return False
        group = os.environ.get(REPLICA_GROUP_ENV)
        if record.get("group") != (int(group) if group else None):  # another replica group's give-up
            return False
        if self.generation is not None:
            return record.get("generation") == self.generation
        return record.get("time", 0) >= self.started

    def stop(self) -> None:
        """The launcher returned (main thread): no more signals, and none still in flight may interrupt the exit."""
        self.done.set()
        if self.fired is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def start(self) -> "GiveUpWatch":
        threading.Thread(target=self._run, name="give-up-watch", daemon=True).start()
        return self

    def _run(self) -> None:
        while self.fired is None and not self.done.wait(self.interval_seconds):
            record = read_gave_up(self.run_dir)
            if self.matches(record):
                self.fired = record
                print(f"trainer.launcher: the restart budget gave up; stopping the launch: {record['message']}",
                      file=sys.stderr, flush=True)
        while self.fired is not None and not self.done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            self.done.wait(self.resend_seconds)


def parse_options(argv: list[str]) -> tuple[dict[str, str | bool], list[str]]:
    options: dict[str, str | bool] = {}
    argv = list(argv)
    while argv and argv[0].startswith("--"):
        arg = argv.pop(0)
        if arg == FORK_SERVER_OPTION:
            options["fork_server"] = True
        elif arg.startswith(NODE_STORE_OPTION):
            options["node_store"] = arg[len(NODE_STORE_OPTION):]
        elif arg.startswith(RUN_DIR_OPTION):
            options["run_dir"] = arg[len(RUN_DIR_OPTION):]
        elif arg.startswith(CHECK_NODE_OPTION):
            options["check_node"] = arg[len(CHECK_NODE_OPTION):]
        elif arg.startswith(REPLICA_GROUPS_OPTION):
            options["replica_groups"] = arg[len(REPLICA_GROUPS_OPTION):]
        elif arg.startswith(STORE_TIMEOUT_OPTION):
            options["store_timeout"] = arg[len(STORE_TIMEOUT_OPTION):]
        else:
            sys.exit(f"{USAGE}\nunknown option {arg!r}")
    if not argv or argv[0] not in LAUNCHERS:
        sys.exit(USAGE)
    return options, argv


def is_rendezvous_timeout(err: BaseException | None) -> bool:
    """Whether err is, or was raised while handling, a RendezvousTimeoutError (torch's and NVRx's copy of
    torch elastic each define one; ft_launcher turns it into sys.exit(1) inside its handler)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if any(kind.__name__ == "RendezvousTimeoutError" for kind in type(err).__mro__):
            return True
        err = err.__cause__ or err.__context__
    return False


def external_store(args: list[str]) -> str | None:
    """The rendezvous store's endpoint when no launcher hosts it (trainer.rendezvous_store)."""
    if not any(a.startswith("--rdzv-conf=") and "is_host=false" in a for a in args):
        return None
    return next((a.split("=", 1)[1] for a in args if a.startswith("--rdzv-endpoint=")), None)


def main(argv: list[str]) -> None:
    options, argv = parse_options(argv)
    groups = int(options.get("replica_groups") or 1)
    try:  # a TrainJob's pod: its replica group's own world (trainer.launch.groups), before anything reads it
        group_env, launcher_args = join_replica_group(dict(os.environ), argv[1:], groups)
    except ValueError as err:
        sys.exit(f"trainer.launcher: {err}")
    os.environ.update(group_env)
    argv = [argv[0], *launcher_args]
    watch_parent()
    forked_children_die_with_this_process()
    os.environ.update({NODE_LAUNCHER_PID_ENV: str(os.getpid()), NODE_TOKEN_ENV: uuid.uuid4().hex,
                       **stable_node_rank(os.environ)})
    if options.get("check_node"):  # before joining: a broken machine fails here, and its pod is replaced
        try:
            gpus, efa = (int(n) for n in str(options["check_node"]).split(","))
        except ValueError:
            sys.exit(f"{USAGE}\n{CHECK_NODE_OPTION} takes GPUS,EFA (e.g. 8,32), not {options['check_node']!r}")
        problems = node_problems(gpus, efa)
        if problems:
            print(f"trainer.launcher: node {os.environ.get(NODE_RANK_ENV, '?')} is not fit to train: "
                  f"{'; '.join(problems)}", file=sys.stderr, flush=True)
            sys.exit(NODE_UNHEALTHY_EXIT_CODE)
    run_dir = Path(options["run_dir"]) if options.get("run_dir") else None
    node_index = int(os.environ.get(NODE_INDEX_ENV) or os.environ.get(NODE_RANK_ENV) or 0)
    if run_dir is not None:  # before any worker starts: from here on, this node index's earlier launchers are fenced
        os.environ[NODE_GENERATION_ENV] = str(claim_node(run_dir, node_index))
    try:
        store_timeout = float(options.get("store_timeout") or 0)
    except ValueError:
        sys.exit(f"{USAGE}\n{STORE_TIMEOUT_OPTION} takes seconds, not {options['store_timeout']!r}")
    store = server = None
    if options.get("node_store"):
        store = launch_node_store(Path(options["node_store"]))
        os.environ[NODE_STORE_ENV] = str(store)
    if options.get("fork_server"):
        server, server_folder = start_fork_server()
    launcher, module = argv[0], LAUNCHERS[argv[0]]
    sys.argv = [module, *runtime_launcher_args(launcher, argv[1:], dict(os.environ))]
    if launcher == "ft_launcher" and nvml() is None:
        quiet_health_checks_without_gpu()
        print("trainer.launcher: no NVIDIA driver on this node: GPU and NIC health checks are off", file=sys.stderr)
    give_up = None
    metrics = contextlib.nullcontext()
    if run_dir is not None:
        generation = os.environ.get(GENERATION_ENV)
        give_up = GiveUpWatch(run_dir, int(generation) if generation else None).start()
        node = f"node-{os.environ.get(NODE_INDEX_ENV, os.environ.get(NODE_RANK_ENV, '0'))}"
        metrics = SystemMetricsSampler(RunDir(run_dir).system_samples, SYSTEM_METRICS_SECONDS, node=node)
    store_endpoint = external_store(argv)
    node_watch = NodeWatch(run_dir=run_dir, node_index=node_index,
                           node_generation=int(os.environ[NODE_GENERATION_ENV]) if run_dir is not None else None,
                           store_endpoint=store_endpoint, store_timeout_seconds=store_timeout).start()
    if store_endpoint is not None and launcher == "ft_launcher":
        local_addr = next((a.split("=", 1)[1] for a in argv if a.startswith("--local-addr=")), socket.getfqdn())
        evict_predecessors_from_rendezvous(local_addr)
    try:
        with metrics:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except BaseException as err:  # ft_launcher's SignalException after the watch's SIGTERM, ChildFailedError, ...
        node_watch.stop()
        if node_watch.fired is not None:  # cut off or fenced: the watch said why
            sys.exit(node_watch.fired[0])
        if give_up is not None:
            give_up.stop()
        if is_rendezvous_timeout(err) and not (give_up is not None and give_up.matches(read_gave_up(run_dir))):
            # With replica groups only this node's group waited: that group restarts, the others train on.
            code, scope = ((GROUP_RESTART_EXIT_CODE, f"replica group {os.environ.get(REPLICA_GROUP_ENV)} restarts")
                           if groups > 1 else (REPLACEMENT_TIMEOUT_EXIT_CODE, "the whole job restarts"))
            print(f"trainer.launcher: node {os.environ.get(NODE_RANK_ENV, '?')}: the rendezvous timed out waiting for "
                  "every node (its join_timeout: resilience.replacement_timeout_seconds); a lost node's replacement "
                  f"did not come in time: {scope} (exit code {code})", file=sys.stderr, flush=True)
            sys.exit(code)
        if give_up is None or not give_up.matches(read_gave_up(run_dir)):
            raise
    finally:
        node_watch.stop()
        if give_up is not None:
            give_up.stop()
        if server is not None:
            server.kill()
            shutil.rmtree(server_folder, ignore_errors=True)
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)
    if node_watch.fired is not None:
        sys.exit(node_watch.fired[0])
    if give_up is not None and give_up.matches(read_gave_up(run_dir)):
        sys.exit(CRASH_LOOP_EXIT_CODE)
    if store_endpoint is not None:
        report_finished(store_endpoint)
