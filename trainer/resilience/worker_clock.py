"""When a worker started: the origin of a restart's re-init and recovery figures (trainer.resilience.hooks)."""

import os
import time

from trainer.env import WORKER_STARTED_ENV


def worker_started_at() -> float:
    """Wall-clock time this worker started, to ~10 ms: its client's start when it runs in the warm server
    (a restart's re-init counts from when ft_launcher started the worker), else this process's.

    Not psutil's create_time(): it adds the start ticks to /proc/stat's btime, which is whole seconds, so a
    worker restarted within a second of a fault can appear to have started before it.
    """
    if os.environ.get(WORKER_STARTED_ENV):
        return float(os.environ[WORKER_STARTED_ENV])
    try:
        with open("/proc/self/stat") as handle:
            after_name = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
    except OSError:  # not Linux: whole seconds are the best there is
        import psutil  # noqa: PLC0415 - only off Linux

        return psutil.Process().create_time()
    start_ticks = int(after_name[19])  # field 22, starttime, counted from field 3 (state)
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
