"""Is this node fit to join the job? Its GPUs answer through NVML and its EFA devices exist.

    python -m trainer.node_health --gpus 8 --efa 32            # exit 0, or 44 with one line per problem
    python -m trainer.node_health --gpus 8 --efa 32 --hold     # a warm spare: check, mark ready, wait

trainer.launcher runs the check before a node's launcher joins the rendezvous (``--check-node=GPUS,EFA``), so a
replacement on a broken machine fails at once (exit code 44: the pod is replaced, counted against its index's
backoff) instead of joining and failing the first collective. The warm spares' placeholder pods
(manifests/components/warm-spares) run it with --hold: a spare reports ready only on a healthy node.
"""

from __future__ import annotations

import argparse
import glob
import sys
import time
from pathlib import Path

from trainer.env import NODE_UNHEALTHY_EXIT_CODE

EFA_DEVICES = "/dev/infiniband/uverbs*"  # one per EFA interface the device plugin gives the container
READY_FILE = Path("/tmp/node-healthy")


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
