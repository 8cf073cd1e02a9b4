"""The one place that knows how NVIDIA Resiliency Extension (NVRx) differs across versions.

Supported: 0.4.1 (what Python 3.11 gets from PyPI) and >= 0.6 (NGC/DLC GPU images, Python 3.12).
Everything else in the project imports NVRx through this module. NVRx (and torch, for the checkpoint
helpers) is imported inside the function that needs it: NVRx is optional and its modules move between
versions, and the launch-command helpers here must stay importable where neither is installed.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import inspect
import logging
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable

from trainer.env import FT_RANK_MONITOR_SOCKET_ENV, NODE_RANK_ENV


def nvrx_version() -> str | None:
    try:
        return version("nvidia-resiliency-ext")
    except PackageNotFoundError:
        return None


def nvrx_available() -> bool:
    return importlib.util.find_spec("nvidia_resiliency_ext") is not None


def async_calls_queue(persistent: bool = True):
    """NVRx's AsyncCallsQueue (GPU async checkpointing); a persistent worker process by default."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue  # optional (see above)

    return AsyncCallsQueue(persistent=persistent)


def filesystem_writer_async_class() -> type:
    """NVRx's FileSystemWriterAsync: each rank's shards written by processes forked in NVRx's checkpoint worker."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync  # optional

    return FileSystemWriterAsync


def plan_async_save(state_dict: dict[str, Any], writer, process_group=None) -> tuple:
    """save_state_dict_async_plan across versions (enable_cache appeared after 0.3)."""
    # optional (see above)
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan
    from torch.distributed.checkpoint import DefaultSavePlanner

    kwargs: dict[str, Any] = {"planner": DefaultSavePlanner()}
    if "enable_cache" in inspect.signature(save_state_dict_async_plan).parameters:
        kwargs["enable_cache"] = True
    return save_state_dict_async_plan(state_dict, writer, process_group, 0, **kwargs)


def async_request(writer, plan_result: tuple, on_finalized: Callable[[], None]):
    """An AsyncRequest that writes the planned shards and, once every rank is done, finalizes DCP metadata."""
    # optional (see above)
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_finalize

    returned = writer.get_save_function_and_args()
    # 0.4+: (save_fn, preload_fn, args); earlier: (save_fn, args).
    save_fn, preload_fn, save_args = returned if len(returned) == 3 else (returned[0], None, returned[1])

    def finalize() -> None:
        save_state_dict_async_finalize(*plan_result)
        on_finalized()

    kwargs = {"preload_fn": preload_fn} if preload_fn is not None else {}
    return AsyncRequest(save_fn, save_args, [finalize], **kwargs)


# -- fault tolerance (ft_launcher) -----------------------------------------------------------------


# ft_launcher's entry module: the same path in 0.4.1 and >= 0.6.
FT_LAUNCHER_MODULE = "nvidia_resiliency_ext.fault_tolerance.launcher"


HEALTH_CHECK_FLAG = "--ft-node-health-check-endpoint"  # NVRx >= 0.5
# NVRx >= 0.6 stops restarting after --ft-max-no-progress-cycles cycles that did not advance an iteration it
# reads from a file (progress_tracker.py): off, so that one rule (trainer.resilience.budget) decides at every
# layer. 0.4.1 has no such tracker and no such flag.
NO_PROGRESS_FLAG = "--ft-max-no-progress-cycles"
# Flags only newer versions know, with the first version that does: dropped on older ones where the launcher runs.
NEWER_FLAGS = {HEALTH_CHECK_FLAG: ((0, 5), "running without the node health check"),
               NO_PROGRESS_FLAG: ((0, 6), "this version has no progress tracker of its own to turn off")}


WORKLOAD_CHECK_INTERVAL_SECONDS = 1.0


WORKERS_STOP_TIMEOUT_SECONDS = 3


def ft_launcher_flags(initial_heartbeat_timeout: float, heartbeat_timeout: float, max_restarts: int,
                      node_health_check_endpoint: str = "") -> list[str]:
    """Flags spelled the same in 0.4.1 and >= 0.5; timeouts always passed (their defaults differ by version).
    Flags only newer versions know are dropped at run time by `runtime_launcher_args`, where the version is."""
    flags = [f"--max-restarts={max_restarts}",
             f"--ft-initial-rank-heartbeat-timeout={initial_heartbeat_timeout}",
             f"--ft-rank-heartbeat-timeout={heartbeat_timeout}",
             # The rank monitors look for a missed heartbeat every this many seconds (NVRx default 5 s, added to
             # every hang's detection); 1 s costs a timer per rank.
             f"--ft-workload-check-interval={WORKLOAD_CHECK_INTERVAL_SECONDS}",
             f"{NO_PROGRESS_FLAG}=0",
             # A worker blocked in a collective with a peer cut off from the network runs no Python signal handler:
             # its SIGTERM does nothing, and every restart waited for the SIGKILL (30 s in 0.4.1, 15 s later; seen
             # as a 41 s recovery from a cut where 11 s was the rest). Workers keep nothing a graceful stop saves.
             f"--workers-stop-timeout={WORKERS_STOP_TIMEOUT_SECONDS}"]
    if node_health_check_endpoint:
        flags.append(f"{HEALTH_CHECK_FLAG}={node_health_check_endpoint}")
    return flags


def _version_tuple(text: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (text or "0").split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def runtime_launcher_args(launcher: str, args: list[str], environ: dict[str, str]) -> list[str]:
    """The launcher's arguments adjusted where it runs (trainer.launcher): flags the installed NVRx does not
    know are dropped with a warning, and on a TrainJob node the c10d rendezvous is told explicitly whether this
    node hosts the store (node rank 0) instead of guessing it from host names that DNS may not serve yet."""
    args = list(args)
    if launcher == "ft_launcher":
        installed = _version_tuple(nvrx_version())
        for flag, (since, consequence) in NEWER_FLAGS.items():
            kept = [a for a in args if not a.startswith(flag)]
            if len(kept) != len(args) and installed < since:
                level = logging.WARNING if flag == HEALTH_CHECK_FLAG else logging.INFO  # one the user asked for
                logging.getLogger(__name__).log(level, "NVRx %s has no %s: %s", nvrx_version(), flag, consequence)
                args = kept
    node_rank = environ.get(NODE_RANK_ENV)
    if node_rank is not None and "--rdzv-backend=c10d" in args and not any("is_host=" in a for a in args):
        is_host = f"is_host={'true' if node_rank == '0' else 'false'}"
        for index, arg in enumerate(args):
            if arg.startswith("--rdzv-conf="):
                args[index] = f"{arg},{is_host}"
                break
        else:
            args.append(f"--rdzv-conf={is_host}")
    return args


def stable_node_rank(environ: dict[str, str]) -> dict[str, str]:
    """What keeps a node's group rank across rendezvous rounds, so survivors of a node loss keep the ranks their
    node memory was written by and the replacement takes the lost node's: NVRx >= 0.6's barrier rendezvous
    orders nodes by an infrastructure rank, GROUP_RANK when SLURM is absent; NVRx 0.4.1's rendezvous re-uses
    each node's rank of the previous round (its _assign_ranks) and gives a newcomer the free one."""
    node_rank = environ.get(NODE_RANK_ENV)
    return {"GROUP_RANK": node_rank} if node_rank is not None and "GROUP_RANK" not in environ else {}


def evict_predecessors_from_rendezvous(local_addr: str) -> bool:
    """A replacement node removes its dead predecessor from the rendezvous at once, instead of waiting for its
    keep-alive to lapse: NVRx's rendezvous (0.4.1's _ft_rendezvous, torch's dynamic rendezvous before it) starts
    the next round only once every participant of the last one has left, and a dead node leaves only when it
    has missed 3 keep-alives of 5 s — hard-coded — which was most of a replacement's downtime (~14 s of 15 s
    measured here). A participant with this node's address and another process id is a predecessor: one
    launcher per node address (a pod's host name; locally 127.0.0.<index + 1>), and a replacement starts only
    after its predecessor ended (podReplacementPolicy Failed; the local runner waits for its exit).

    Returns whether it is installed: not where NVRx's rendezvous lacks the state holder patched here (then the
    keep-alive timeout applies)."""
    try:
        rendezvous = importlib.import_module("nvidia_resiliency_ext.fault_tolerance._ft_rendezvous")  # optional NVRx
        holder = rendezvous._BackendRendezvousStateHolder
        holder._sanitize  # noqa: B018 - present, or this NVRx has another design
    except (ImportError, AttributeError):
        logging.getLogger(__name__).info("NVRx %s: no rendezvous state holder to patch; a lost node leaves the "
                                         "rendezvous after its keep-alive lapses", nvrx_version())
        return False
    original, this_process = holder._sanitize, os.getpid()

    def _sanitize(self) -> None:
        for node in list(self._state.last_heartbeats):
            if node.addr == local_addr and node.pid != this_process:
                self._state.last_heartbeats[node] = datetime.datetime.min  # dead: removed as the lapsed are
        original(self)

    holder._sanitize = _sanitize
    return True


# NVRx's GPU/NIC health checks (ft_launcher and its rank monitors) log an NVML traceback per rank and launch
# where no NVIDIA driver exists; the same module in 0.4.1 and >= 0.6.
HEALTH_CHECK_LOGGER = "nvidia_resiliency_ext.shared_utils.health_check"


def quiet_health_checks_without_gpu() -> None:
    """On a machine without NVML: one line instead of NVRx's tracebacks (they say nothing a CPU run needs)."""
    logging.getLogger(HEALTH_CHECK_LOGGER).setLevel(logging.CRITICAL)


def under_ft_launcher() -> bool:
    return bool(os.environ.get(FT_RANK_MONITOR_SOCKET_ENV))


def rank_monitor_client():
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # optional (see the module's docstring)

    return RankMonitorClient()


# -- in-process restart --------------------------------------------------------------------------------


def in_process_wrapper(*, store_port: int, soft_timeout: float, on_cuda: bool):
    """inprocess.Wrapper configured for this project, on CPU/gloo as on CUDA/NCCL.

    - Abort: NVRx's AbortTorchDistributed aborts NCCL only (on a CPU build its error is swallowed, then it
      destroys the process group); on gloo that destroy is the abort — a rank blocked in a collective is
      released by the group's own short timeout (resilience.collective_timeout).
    - Health checks: CudaHealthCheck on CUDA; none on CPU. NVRx >= 0.5 also chains GPU/NIC checks when
      LOCAL_RANK is set, which fail without NVML, so LOCAL_RANK is hidden while the Wrapper is built.
    """
    from nvidia_resiliency_ext import inprocess  # optional (see the module's docstring)

    seconds = datetime.timedelta(seconds=1)
    kwargs = dict(
        store_kwargs={"port": store_port},
        abort=inprocess.abort.AbortTorchDistributed(),
        health_check=inprocess.health_check.CudaHealthCheck() if on_cuda else None,
        # No count of iterations (RetryController): restarts after which training progressed are free; the
        # restart budget (trainer.resilience.budget) ends a run of restarts without progress.
        soft_timeout=soft_timeout * seconds,
        hard_timeout=(soft_timeout + 15) * seconds,
        heartbeat_timeout=(soft_timeout + 10) * seconds,
        barrier_timeout=(soft_timeout + 60) * seconds,
        completion_timeout=(soft_timeout + 60) * seconds,
        last_call_wait=seconds,
    )
    hidden = None if on_cuda else os.environ.pop("LOCAL_RANK", None)
    try:
        return inprocess.Wrapper(**kwargs)
    finally:
        if hidden is not None:
            os.environ["LOCAL_RANK"] = hidden


# -- straggler detection ------------------------------------------------------------------------------


# The straggler package moved: 0.4.1 has nvidia_resiliency_ext.straggler, newer versions
# nvidia_resiliency_ext.attribution.straggler; Detector, Report, ReportGenerator and Statistic are the same there.
STRAGGLER_PACKAGES = ("nvidia_resiliency_ext.attribution.straggler", "nvidia_resiliency_ext.straggler")


def straggler_package():
    """NVRx's straggler package (its Detector, Report, Statistic), or None where NVRx has none."""
    for name in STRAGGLER_PACKAGES:
        try:
            return importlib.import_module(name)  # optional (see the module's docstring)
        except ImportError:
            continue
    return None


def straggler_report_generator(node_name: str):
    """NVRx's ReportGenerator, gathering every rank's scores on rank 0 over the default process group. It needs
    no CUDA (it all-reduces on the backend's device), unlike the Detector that feeds it on GPUs."""
    package = straggler_package()
    reporting = importlib.import_module(f"{package.__name__}.reporting")  # optional (see the module's docstring)
    return reporting.ReportGenerator(scores_to_compute=["relative_perf_scores", "individual_perf_scores"],
                                     gather_on_rank0=True, node_name=node_name)


def straggler_detector(node_name: str):
    """NVRx's Detector (CUDA only: CUPTI kernel timing, torch.cuda.synchronize before each report), initialized
    to report when asked (generate_report) rather than on its own clock."""
    detector = straggler_package().Detector
    detector.initialize(scores_to_compute="all", gather_on_rank0=True, profiling_interval=1,
                        report_time_interval=1e9, node_name=node_name)
    return detector
