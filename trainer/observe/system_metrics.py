"""A training node's system metrics, sampled by its launcher into the run folder (``system/samples.jsonl``,
which every node appends to: one file for the forwarder to tail, not one per node).

    with SystemMetricsSampler(RunDir(run_dir).system_samples, interval_seconds=10, node="node-0"):
        run_the_launcher()

Each line: ``{"time": …, "node": "node-0", "sample": n, "system/cpu_utilization_percentage": …, …}`` — psutil
for CPU, memory and disk, NVML for each GPU when an NVIDIA driver is present (named as MLflow's own system
metrics name them), appended whole (trainer.run.events.append_record). The train step forwards them to MLflow
aggregated across nodes (components.run_metrics: minimum, median and maximum, and which node is at either end),
so on EKS MLflow describes the training nodes, not the pipeline pod that waits for them, in keys that do not
multiply with the cluster.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from trainer.env import NODE_GENERATION_ENV
from trainer.run.events import append_record
from trainer.run.lease import LeaseLost, check_fence_of_this_process

log = logging.getLogger(__name__)


def nvml():
    """pynvml, initialised; None (with one line, not a traceback) on a machine without an NVIDIA driver."""
    try:
        import pynvml  # optional: machines without NVIDIA drivers have no NVML

        pynvml.nvmlInit()
        return pynvml
    except Exception as err:  # noqa: BLE001 - NVMLError_LibraryNotFound, ImportError, driver errors alike
        log.info("no NVIDIA driver here (%s): GPU metrics and GPU health checks are off", type(err).__name__)
        return None


class SystemMetricsSampler:
    """Appends a sample to `path` every interval_seconds on a daemon thread, and one more when stopped."""

    def __init__(self, path: Path, interval_seconds: float = 10.0, node: str = "node-0"):
        self.path = Path(path)
        self.interval_seconds = interval_seconds
        self.node = node
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None

    def __enter__(self) -> "SystemMetricsSampler":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        psutil.cpu_percent(None)  # the first call only primes the counter
        self._nvml = nvml()
        self._thread = threading.Thread(target=self._run, name="system-metrics", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                self.sample()
            except LeaseLost as err:  # this node was replaced: it samples nothing more into the run folder
                log.warning("system metrics stop: %s", err)
                return

    def sample(self) -> dict[str, Any]:
        memory = psutil.virtual_memory()
        disk = psutil.disk_io_counters()
        record: dict[str, Any] = {
            "time": time.time(), "node": self.node, "sample": self.samples,
            # which launcher of the node sampled it: a node replaced while cut off is told from its successor
            **({"node_generation": int(os.environ[NODE_GENERATION_ENV])} if os.environ.get(NODE_GENERATION_ENV) else {}),
            "system/cpu_utilization_percentage": psutil.cpu_percent(None),
            "system/system_memory_usage_megabytes": (memory.total - memory.available) / 2**20,
            "system/system_memory_usage_percentage": memory.percent,
        }
        if disk is not None:
            record["system/disk_read_megabytes"] = disk.read_bytes / 2**20
            record["system/disk_write_megabytes"] = disk.write_bytes / 2**20
        if self._nvml is not None:
            gpu = self._nvml
            for index in range(gpu.nvmlDeviceGetCount()):
                handle = gpu.nvmlDeviceGetHandleByIndex(index)
                record[f"system/gpu_{index}_utilization_percentage"] = gpu.nvmlDeviceGetUtilizationRates(handle).gpu
                info = gpu.nvmlDeviceGetMemoryInfo(handle)
                record[f"system/gpu_{index}_memory_usage_megabytes"] = info.used / 2**20
                record[f"system/gpu_{index}_power_usage_watts"] = gpu.nvmlDeviceGetPowerUsage(handle) / 1000
        check_fence_of_this_process(self.path.parent.parent)  # <run_dir>/system/samples.jsonl: a fenced node stops
        append_record(self.path, record)
        self.samples += 1
        return record

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.sample()  # at least one sample, even for a short run
        except LeaseLost:  # a node replaced while it ran writes nothing more
            pass
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down a driver library that is going away anyway
                pass
