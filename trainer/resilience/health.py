"""Health of a node and its GPUs: whether a node is fit to join the job (its GPUs answer NVML, its EFA devices
exist), and, while it trains, each GPU's NVML counters (ECC, retired pages, remapped rows, critical XIDs) and the
memlock limit EFA needs. No torch at import: a node's launcher runs the first check before anything else.

    python -m trainer.node_health --gpus 8 --efa 32            # exit 0, or 44 with one line per problem
    python -m trainer.node_health --gpus 8 --efa 32 --hold     # a warm spare: check, mark ready, wait

trainer.launcher runs the node check before a node's launcher joins the rendezvous (``--check-node=GPUS,EFA``),
so a replacement on a broken machine fails at once (exit code 44: the pod is replaced, counted against its
index's backoff) instead of joining and failing the first collective. The warm spares' placeholder pods
(manifests/components/warm-spares) run it with --hold: a spare reports ready only on a healthy node.

In a rank, GpuHealth records its findings as ``gpu_health`` events (rank, GPU, counters, XIDs), and a node that
shows an XID which should take it out of service is flagged ``node_bad`` — for the operator and the orchestrator
(on EKS a node with such XIDs should be cordoned; the seed's list: 63, 64, 94, 95), and for the decision by cause
(trainer.config.decisions: hardware, replace_node). Without NVML (a CPU machine) it logs once and does nothing.
"""

from __future__ import annotations

import argparse
import glob
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

from trainer.env import NODE_UNHEALTHY_EXIT_CODE

log = logging.getLogger(__name__)

EFA_DEVICES = "/dev/infiniband/uverbs*"  # one per EFA interface the device plugin gives the container
READY_FILE = Path("/tmp/node-healthy")
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


def node_problems(gpus: int, efa: int, nvml=None, efa_devices: list[str] | None = None) -> list[str]:
    """What keeps this node from training: fewer GPUs than expected answering NVML (a GPU fallen off the bus
    is missing from the count or fails its query), fewer EFA devices than expected."""
    problems = []
    if gpus:
        if nvml is None:
            from trainer.observe.system_metrics import nvml as load_nvml  # pynvml only where GPUs are expected

            nvml = load_nvml()
        if nvml is None:
            problems.append(f"no NVIDIA driver answers (NVML), {gpus} GPUs expected")
        else:
            count = nvml.nvmlDeviceGetCount()
            if count < gpus:
                problems.append(f"{count} GPUs answer NVML, {gpus} expected")
            for index in range(min(count, gpus)):
                try:
                    nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
                except Exception as err:  # noqa: BLE001 - any NVML error: the GPU does not answer
                    problems.append(f"GPU {index} does not answer NVML ({err})")
    if efa:
        found = sorted(glob.glob(EFA_DEVICES)) if efa_devices is None else efa_devices
        if len(found) < efa:
            problems.append(f"{len(found)} EFA devices ({EFA_DEVICES}), {efa} expected: is the EFA device plugin "
                            "running on this node, and does the pod request vpc.amazonaws.com/efa?")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.node_health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs that must answer NVML")
    parser.add_argument("--efa", type=int, default=0, help="EFA devices that must exist")
    parser.add_argument("--hold", action="store_true", help="then mark ready and wait (a warm spare's placeholder)")
    args = parser.parse_args(argv)
    problems = node_problems(args.gpus, args.efa)
    for problem in problems:
        print(f"node health: {problem}", file=sys.stderr)
    if problems:
        return NODE_UNHEALTHY_EXIT_CODE
    if args.hold:
        READY_FILE.write_text("ok\n")
        while True:
            time.sleep(3600)
    return 0
