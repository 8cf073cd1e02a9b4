"""The decision-by-cause table: each cause of a failed attempt, what tells it, and what is done by default;
``resilience.decisions`` overrides the decisions. The rules that read the evidence are
trainer.resilience.decisions (this is the table alone, for the config to check a user's overrides against).
"""

from __future__ import annotations

from dataclasses import dataclass

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
