"""A decision by cause for every failed attempt: the evidence a rank's failure leaves, the cause it points to,
and what is done about it. Restarting everything until the budget by progress gives up is right for a transient
fault and wrong for the others: a deterministic bug costs three more restarts of every rank, and a GPU with an
uncorrectable memory error fails again on the same node.

    cause, evidence = classify(record, seen_before, gpu)     # the rules, tried in CAUSES' order
    decision = parse_decisions(cfg.resilience.decisions)[cause]

The evidence (trainer.resilience.failures records it with the failure): the exception's type and message, the
frame it was raised in and the step, whether it is what a rank sees when a peer failed, the same failure
recorded before in this launch, and where a GPU is present its NVML health (uncorrectable ECC errors, XIDs that
take a GPU out of service: trainer.resilience.health). A numeric anomaly that comes back on the same batch is
decided in the step itself (trainer.job.numeric_recovery).

CAUSES is the table users read (docs/numeric-faults.md); ``resilience.decisions`` ("cause=decision,...")
overrides its decisions, checked here when the config loads. The restart budget by progress still ends whatever
keeps restarting without progress.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DECISIONS = ("restart", "replace_node", "stop", "rollback")


@dataclass(frozen=True)
class Cause:
    name: str
    evidence: str  # what tells it, as the table's reader sees it
    decision: str  # the default


CAUSES = (
    Cause("hardware", "NVML reports an uncorrectable ECC error, remapped-row failure or an XID that takes the GPU out "
          "of service (63, 64, 94, 95), or the error's text is one of a GPU's hardware faults (uncorrectable ECC "
          "error, fallen off the bus, Xid)", "replace_node"),
    Cause("input", "the rank raised an InputError: the config, the base model, the tokenizer or the data cannot be "
          "used as they are (a mixture changed on a continuation, a schedule it cannot keep, a tokenizer that is not "
          "the base model's); the message names the field", "stop"),
    Cause("lost_peer", "a collective or a connection failed because another rank did (the failure is secondary)",
          "restart"),
    Cause("deterministic", "the same exception type raised in the same frame at the same step (or start-up phase) "
          "as a failure recorded before in this launch", "stop"),
    Cause("out_of_memory", "the rank raised an out-of-memory error (torch's OutOfMemoryError, MemoryError, a device's "
          "'out of memory'), its first time at that step: a restart frees what fragmentation held; the same one "
          "again is deterministic (the kernel's OOM killer leaves no exception: the recovery's evidence names it "
          "from the node's cgroup count)", "restart"),
    Cause("data", "a numeric anomaly that comes back when its step is executed again on the same batch", "rollback"),
    Cause("transient", "anything else: a crash that a restart from the newest checkpoint may not meet again",
          "restart"),
)
BY_NAME = {cause.name: cause for cause in CAUSES}


def parse_decisions(text: str) -> dict[str, str]:
    """'cause=decision,...' over the table's defaults; ValueError naming the bad item."""
    chosen = {cause.name: cause.decision for cause in CAUSES}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, decision = (s.strip() for s in item.partition("="))
        if not sep or name not in BY_NAME:
            raise ValueError(f"{item!r} must look like CAUSE=DECISION with CAUSE one of {list(BY_NAME)}")
        if decision not in DECISIONS:
            raise ValueError(f"{item!r}: the decision must be one of {list(DECISIONS)}")
        if decision == "rollback" and name != "data":
            raise ValueError(f"{item!r}: only data is rolled back (its step and batch are known); restart or stop")
        if name == "data" and decision not in ("rollback", "stop"):
            raise ValueError(f"{item!r}: data is rolled back or stops the run (a restart trains the same batch)")
        chosen[name] = decision
    return chosen


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
