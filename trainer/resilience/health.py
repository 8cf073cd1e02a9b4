"""GPU health checks through NVML: ECC counters, retired pages, remapped rows and critical XID events.

Findings are recorded as ``gpu_health`` events (rank, GPU, counters, XIDs) and a node that shows an XID
which should take it out of service is flagged ``node_bad`` — for the operator and the orchestrator (on
EKS a node with such XIDs should be cordoned; the seed's list: 63, 64, 94, 95). Without NVML (a CPU
machine) the checker logs once and does nothing.
"""

from __future__ import annotations

import logging
import resource
from typing import Any

log = logging.getLogger(__name__)

# 63/64: ECC page retirement or row remapping recorded/failed; 94/95: contained/uncontained ECC error.
NODE_BAD_XIDS = frozenset({63, 64, 94, 95})


def efa_memlock_check(environ: dict[str, str], getrlimit=None) -> dict[str, Any] | None:
    """With EFA (FI_PROVIDER=efa), RDMA memory registration pins NCCL's buffers, which needs an unlimited
    memlock limit; an added IPC_LOCK capability would not help a non-root process. The container inherits the
    limit from containerd (LimitMEMLOCK=infinity on the EKS accelerated AMIs). None without EFA; else the
    finding, with `ok` False and what to do when the limit is too low."""
    if environ.get("FI_PROVIDER") != "efa":
        return None
    soft, hard = (getrlimit or resource.getrlimit)(resource.RLIMIT_MEMLOCK)
    ok = soft == resource.RLIM_INFINITY
    finding = {"ok": ok, "memlock_soft": soft, "memlock_hard": hard}
    if not ok:
        finding["fix"] = ("the memlock limit is not unlimited, so EFA cannot register NCCL's buffers and NCCL falls "
                          "back to TCP or fails: run the node's containerd with LimitMEMLOCK=infinity (the EKS "
                          "accelerated AMIs do; check with `systemctl show containerd -p LimitMEMLOCK`)")
    return finding


def classify_xids(xids: list[int]) -> dict[str, Any]:
    bad = sorted({x for x in xids if x in NODE_BAD_XIDS})
    return {"xids": sorted(set(xids)), "node_bad": bool(bad), "node_bad_xids": bad}


class GpuHealth:
    def __init__(self, device, events, interval_steps: int):
        self.events = events
        self.interval_steps = interval_steps
        self.nvml = None
        self.handle = None
        self.event_set = None
        if device.type != "cuda" or interval_steps <= 0:
            return
        try:
            import pynvml  # optional: only on GPU images (nvidia-ml-py); its absence disables the checks

            pynvml.nvmlInit()
            index = device.index if device.index is not None else 0
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml = pynvml
            self.index = index
            try:  # XID events need driver support; ECC counters still work without them
                self.event_set = pynvml.nvmlEventSetCreate()
                pynvml.nvmlDeviceRegisterEvents(self.handle, pynvml.nvmlEventTypeXidCriticalError, self.event_set)
            except pynvml.NVMLError as err:
                log.info("XID event monitoring unavailable: %s", err)
                self.event_set = None
        except Exception as err:  # NVMLError_LibraryNotFound and friends
            log.info("GPU health checks off: NVML unavailable (%s)", err)
            self.nvml = None

    @property
    def enabled(self) -> bool:
        return self.nvml is not None

    def maybe_check(self, step: int) -> None:
        if self.enabled and (step == 1 or step % self.interval_steps == 0):
            self.check(step)

    def check(self, step: int) -> dict[str, Any]:
        nvml, handle = self.nvml, self.handle
        report: dict[str, Any] = {"step": step, "gpu": self.index}
        for name, call in {
            "ecc_sbe_volatile": lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC),
            "ecc_dbe_volatile": lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC),
            "retired_pages_dbe": lambda: len(nvml.nvmlDeviceGetRetiredPages(
                handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)),
            "remapped_rows": lambda: nvml.nvmlDeviceGetRemappedRows(handle),
        }.items():
            try:
                report[name] = call()
            except nvml.NVMLError:  # not supported on this GPU generation
                report[name] = None
        xids = []
        while self.event_set is not None:
            try:
                data = nvml.nvmlEventSetWait(self.event_set, 0)
            except nvml.NVMLError:  # timeout: no more pending events
                break
            xids.append(int(data.eventData))
        report.update(classify_xids(xids))
        rows = report.get("remapped_rows")
        unhealthy = bool(report["ecc_dbe_volatile"]) or report["node_bad"] or (rows is not None and rows[3])
        if unhealthy or step == 1:
            self.events.write("gpu_health", unhealthy=unhealthy, **report)
        if unhealthy:
            log.error("GPU %d unhealthy at step %d: %s", self.index, step, report)
        return report
