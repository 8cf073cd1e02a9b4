"""System metrics sampled while a step runs (psutil; NVML GPUs when present), named as MLflow names them.

    with SystemMetricsSampler(interval_seconds=10) as sampler:
        run_training()
    tracker.log_metrics(run, sampler.records)   # {"step": sample index, "time": …, "system/…": value}
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psutil

log = logging.getLogger(__name__)


class SystemMetricsSampler:
    def __init__(self, interval_seconds: float = 10.0):
        self.interval_seconds = interval_seconds
        self.records: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None

    def __enter__(self) -> "SystemMetricsSampler":
        psutil.cpu_percent(None)  # the first call only primes the counter
        try:
            import pynvml  # optional: machines without NVIDIA drivers have no NVML

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVIDIA driver: CPU metrics only
            self._nvml = None
        self._thread = threading.Thread(target=self._run, name="system-metrics", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self.sample()

    def sample(self) -> dict[str, Any]:
        memory = psutil.virtual_memory()
        disk = psutil.disk_io_counters()
        record: dict[str, Any] = {
            "step": len(self.records), "time": time.time(),
            "system/cpu_utilization_percentage": psutil.cpu_percent(None),
            "system/system_memory_usage_megabytes": (memory.total - memory.available) / 2**20,
            "system/system_memory_usage_percentage": memory.percent,
        }
        if disk is not None:
            record["system/disk_read_megabytes"] = disk.read_bytes / 2**20
            record["system/disk_write_megabytes"] = disk.write_bytes / 2**20
        if self._nvml is not None:
            nvml = self._nvml
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                record[f"system/gpu_{index}_utilization_percentage"] = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
                record[f"system/gpu_{index}_memory_usage_megabytes"] = info.used / 2**20
                record[f"system/gpu_{index}_power_usage_watts"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000
        self.records.append(record)
        return record

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()  # at least one sample, even for a short step
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
