"""No training process outlives the process that started it.

torchrun and ft_launcher start every worker in a session of its own, ft_launcher forks a rank monitor per
worker, and DCP's writer is a spawned child of a worker, so a signal to the launcher's process group
reaches none of them: a killed launcher leaves orphaned trainers that go on writing checkpoints into the run
folder. Each of these processes therefore watches its parent and SIGKILLs itself the moment it is gone.

A thread polling ``getppid()`` rather than ``prctl(PR_SET_PDEATHSIG)``: the death signal follows the parent
*thread*, and DCP spawns its writer from a pool thread that exits after the first save, which would kill a
healthy writer.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Callable

from trainer.env import TORCHELASTIC_RUN_ID_ENV

# Set by torchrun and ft_launcher for every worker they start.


def _watch(parent_pid: int, interval_seconds: float, before_exit: Callable[[], None] | None) -> None:
    while True:
        if os.getppid() != parent_pid:  # re-parented: the parent is gone
            if before_exit is not None:
                before_exit()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(interval_seconds)


def watch_parent(parent_pid: int | None = None, interval_seconds: float = 0.2,
                 before_exit: Callable[[], None] | None = None) -> None:
    """SIGKILL this process as soon as parent_pid (default: the current parent) is no longer its parent, after
    before_exit() (what its parent would have cleaned up: a SIGKILLed parent cleans nothing)."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    if os.getppid() != parent_pid or parent_pid == 1:  # already orphaned before the watch began
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch, args=(parent_pid, interval_seconds, before_exit), name="parent-watch",
                     daemon=True).start()


def _watch_pid(pid: int, interval_seconds: float) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(interval_seconds)


def watch_process(pid: int, interval_seconds: float = 0.2) -> None:
    """SIGKILL this process as soon as process pid (not its parent: trainer.warm_start's client) is gone."""
    threading.Thread(target=_watch_pid, args=(pid, interval_seconds), name="process-watch", daemon=True).start()


def die_with_parent() -> None:
    """In a launcher's worker, or a multiprocessing child of one: watch the parent (no-op otherwise, so
    `nohup python -m trainer` keeps running after its shell exits)."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        watch_parent(parent.pid)
    elif os.environ.get(TORCHELASTIC_RUN_ID_ENV):
        watch_parent()


def forked_children_die_with_this_process() -> None:
    """Every child this process forks (without exec) watches it: ft_launcher's rank monitor servers."""
    os.register_at_fork(after_in_child=watch_parent)
