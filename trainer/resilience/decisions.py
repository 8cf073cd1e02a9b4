"""A decision by cause for every failed attempt: the evidence a rank's failure leaves, the cause it points to,
and what is done about it. Restarting everything until the budget by progress gives up is right for a transient
fault and wrong for the others: a deterministic bug costs three more restarts of every rank, and a GPU with an
uncorrectable memory error fails again on the same node.

The evidence (trainer.resilience.failures records it with the failure): the exception's type and message, the
frame it was raised in and the step, whether it is what a rank sees when a peer failed, the same failure
recorded before in this launch, and where a GPU is present its NVML health (uncorrectable ECC errors, XIDs that
take a GPU out of service: trainer.resilience.health). A numeric anomaly that comes back on the same batch is
decided in the step itself (trainer.job.numeric_recovery).

The table is trainer.config.decisions (CAUSES, in the order the rules are tried); ``resilience.decisions``
("cause=decision,...") overrides the decisions. The restart budget by progress still ends whatever keeps
restarting without progress.
"""

from __future__ import annotations

import re
from typing import Any

# A GPU's own hardware faults as CUDA and NCCL word them.
_HARDWARE_TEXT = re.compile(r"uncorrectable ECC error|fallen off the bus|\bXid\b|ECC error encountered",
                            re.IGNORECASE)
# The exception drill stands for a transient crash, also when it repeats (a crash loop from a flaky node, which
# the budget by progress ends); the bug drill (InjectedBug) is a real deterministic failure to the rules.
TRANSIENT_DRILL = "InjectedFault"
_OOM_TYPES = ("OutOfMemoryError", "MemoryError")


def fingerprint(error_type: str, frame: dict[str, Any] | None, step: int | None, phase: str) -> str:
    """What makes two failures the same one: type, the frame it was raised in, the step (or start-up phase)."""
    where = f"{frame['file']}:{frame['line']}" if frame else "?"
    return f"{error_type}@{where}@{'step ' + str(step) if step is not None else phase}"


def classify(record: dict[str, Any], seen_before: bool, gpu: dict[str, Any] | None) -> tuple[str, str]:
    """(cause, the evidence in words) of a rank's failure record (trainer.resilience.failures.record_failure).
    seen_before: the same fingerprint was recorded earlier in this launch; gpu: NVML's report now (None without
    NVML)."""
    if gpu is not None and (gpu.get("node_bad") or gpu.get("ecc_dbe_volatile")):
        return "hardware", (f"NVML: {gpu.get('ecc_dbe_volatile') or 0} uncorrectable ECC error(s), XIDs "
                            f"{gpu.get('node_bad_xids') or []}")
    if _HARDWARE_TEXT.search(record.get("message", "")):
        return "hardware", f"the error names a GPU hardware fault: {record['message'][:120]}"
    if record.get("input_error"):
        return "input", f"{record.get('error_type')}: an input this run cannot use, the same on every restart"
    if record.get("secondary"):
        return "lost_peer", "a peer's failure seen through a collective or a connection"
    if record.get("error_type") == TRANSIENT_DRILL:
        return "transient", "an exception drill: a transient crash"
    if seen_before:
        return "deterministic", f"{record['fingerprint']}, a second time in this launch"
    if record.get("error_type") in _OOM_TYPES or "out of memory" in record.get("message", "").lower():
        return "out_of_memory", f"{record.get('error_type')}: {record.get('message', '')[:120]}"
    return "transient", "its first occurrence, and no sign of hardware or of a peer's failure"
