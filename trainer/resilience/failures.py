"""Why a restart happened, in one sentence, from the ranks' own records.

When a rank fails it records how, in events/failures.jsonl (``rank_failed``), before it goes: the exception
(type, message, start-up phase or training, step) — a peer's loss seen as a broken connection or a collective
timeout is marked secondary —, a SIGTERM from the launcher tearing the job down (secondary), a replacement as
a straggler. A start-up hang is the watchdog's ``hang`` record (trainer.resilience.phases), a drill the
injector's ``fault``. A rank killed outright (SIGKILL, the OOM killer, a lost node) records nothing.

``explain_restarts`` groups those records since the last recovery by attempt (every event carries its
attempt: trainer.run.events.current_attempt) and says, per failed attempt, which rank failed first and how; the
others' secondary errors are counted, not repeated. It reads failures.jsonl from where the last recovery's
explanation stopped (its ``failures_offset``, folded into trainer.run.history), so one fault's records are read
once however long the run; the drill faults come from the folded control records. The launcher's log (four tracebacks of "Connection
reset by peer") is not read: it cannot say which came first.
"""

from __future__ import annotations

import logging
import re
import signal
import traceback
from pathlib import Path
from typing import Any

from trainer.config.decisions import parse_decisions
from trainer.config.rules import InputError
from trainer.config.decisions import classify, fingerprint
from trainer.resilience.flight_recorder import describe, hung_collective
from trainer.run.events import EventLog
from trainer.run.history import ControlState, control_state, handled_keys, launched_at_from_environment
from trainer.run.run_dir import RunDir, read_json
from trainer.run.tail import read_last_records, read_new_lines

log = logging.getLogger(__name__)

# What a rank sees when another rank, not it, failed: its connection to the peer breaks, or a collective waits
# past its timeout for a peer that is gone (gloo and NCCL wordings; torch's Dist*Error types). With replica
# groups, torchft's quorum call goes to the manager server that its group's rank 0 hosts: when that rank dies,
# the others' call fails with a gRPC status (tonic's wording: 'status: Unknown, message: "transport error"',
# Unavailable, Cancelled, DeadlineExceeded).
_LOST_PEER = re.compile(r"connection (reset|closed|refused)|broken pipe|socket closed|peer|timed out|timeout|"
                        r"nccl.*(remote|abort|error)|recv.*fail|read.*fail|transport error|"
                        r"status: (unavailable|cancelled|deadlineexceeded)", re.IGNORECASE)
_LOST_PEER_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "ConnectionResetError",
                    "BrokenPipeError")
# Fault drills as a sentence says how the rank failed.
_DRILLS = {"exception": "raised InjectedFault", "sigkill": "was killed by SIGKILL", "exit": "exited with code 137 "
           "(as the OOM killer leaves it)", "hang": "hung (no heartbeat)", "hang_in_collective": "hung in a collective",
           "node_loss": "lost its node", "corrupt_memory": "was killed by SIGKILL with its node memory corrupted",
           "group_loss": "was lost with its whole replica group",
           # the runner's network drills (localcluster/network_drills.py): the record names a node, not a rank
           "partition": "was cut off from the job's network", "flap": "lost its link (one of a flap's cuts)",
           "partition_store": "the rendezvous store was cut off from every node"}
MESSAGE_CHARS = 300
INPUT_MESSAGE_CHARS = 2000  # an input the run cannot use: its message says what to change, at its end; and it stops
TRACEBACK_FRAMES, TRACEBACK_CHARS = 5, 2000  # the traceback's end: where it was raised, and how it got there
SILENT_RANKS_LISTED = 64  # at 8,192 ranks a whole job can be silent: the list is cut, the count is not


def is_lost_peer(error: BaseException) -> bool:
    """Whether an exception is what a rank sees when another rank failed (secondary), not a failure of its own."""
    return type(error).__name__ in _LOST_PEER_TYPES or bool(_LOST_PEER.search(str(error)))


def record_failure(run_dir: Path, rank: int, error: BaseException, phase: str, step: int | None,
                   decisions: dict[str, str] | None = None, gpu: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A rank's own record of the exception it fails with, with its evidence, cause and decision
    (trainer.config.decisions); the record, or None when none was written (never raises: the failure itself
    matters more). A trainer whose run folder belongs to another launch (trainer.run.lease) records nothing
    there. decisions: resilience.decisions parsed; gpu: NVML's health report now (None without NVML)."""
    if type(error).__name__ in ("LeaseLost", "RunFolderBusy"):
        return None
    try:
        frames = traceback.extract_tb(error.__traceback__)
        frame = ({"file": _short_path(frames[-1].filename), "line": frames[-1].lineno, "function": frames[-1].name}
                 if frames else None)
        record = {"how": "exception", "error_type": type(error).__name__,
                  "message": " ".join(str(error).split())[:INPUT_MESSAGE_CHARS if isinstance(error, InputError)
                                                          else MESSAGE_CHARS], "phase": phase, "step": step,
                  "secondary": is_lost_peer(error), "input_error": isinstance(error, InputError), "frame": frame,
                  "traceback": "".join(traceback.format_list(frames[-TRACEBACK_FRAMES:]))[-TRACEBACK_CHARS:]}
        record["fingerprint"] = fingerprint(record["error_type"], frame, step, phase)
        # A peer's error is judged as such whatever came before it: only a rank's own error looks for its twin
        # (thousands of ranks see a peer's error at once; one or a few fail of their own).
        seen = not record["secondary"] and _seen_before(run_dir, record["fingerprint"])
        cause, evidence = classify(record, seen, gpu)
        decision = (decisions or parse_decisions(""))[cause]
        return EventLog(run_dir, rank).write("rank_failed", **record, cause=cause, evidence=evidence,
                                             decision=decision)
    except Exception:  # noqa: BLE001 - a full disk must not hide the original error
        log.exception("could not record this rank's failure")
        return None


def _seen_before(run_dir: Path, fingerprint_: str) -> bool:
    """The same failure recorded earlier in this launch (since its start and the last give-up)."""
    since = max(launched_at_from_environment() or 0.0, _last_give_up(run_dir))
    return bool(read_last_records(RunDir(run_dir).failures_log, lambda r: r.get("fingerprint") == fingerprint_
                                  and r.get("time", 0) >= since, 1, since=since))


def _last_give_up(run_dir: Path) -> float:
    gave_up = read_json(RunDir(run_dir).gave_up)
    return gave_up["time"] if gave_up else 0.0


def _short_path(path: str) -> str:
    """A frame's file from the project's root (or site-packages) on: the same on every node and image."""
    if "/site-packages/" in path:
        return path.split("/site-packages/", 1)[1]
    for room in ("trainer", "components", "pipelines"):
        if f"/{room}/" in path:
            return f"{room}/" + path.split(f"/{room}/", 1)[1]
    return path


def record_sigterm(run_dir: Path, rank: int, phase_of) -> None:
    """On SIGTERM (the launcher stopping the job's workers after another failed), record it, then die of it as
    before. Runs when the main thread next runs Python: a rank blocked inside a collective is killed without."""
    def on_sigterm(signum, frame) -> None:
        try:
            EventLog(run_dir, rank).write("rank_failed", how="signal", signal="SIGTERM", message="stopped by SIGTERM",
                                          phase=phase_of(), step=None, secondary=True)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def _how(record: dict[str, Any]) -> str:
    if record["event"] == "fault":
        where = f" in start-up phase {record['phase']}" if record.get("phase") else f" after step {record['step']}"
        who = f"node {record['node']} " if record.get("rank") is None and record.get("node") is not None else ""
        return f"{who}{_DRILLS.get(record['fault_type'], 'hung')}{where} (drill {record['key']})"
    if record["event"] == "hang":
        return (f"hung in start-up phase {record['phase']} (no progress for {record['seconds']:.0f} s, timeout "
                f"{record['timeout_seconds']:.0f} s)")
    if record.get("how") == "exception":
        where = "in training" if record.get("phase") in (None, "train") else f"in start-up phase {record['phase']}"
        step = f" at step {record['step']}" if record.get("step") is not None else ""
        return f"raised {record['error_type']} {where}{step}: {record['message']}"
    return record.get("message", record.get("how", "failed"))


def handled_fault_keys(events: list[dict[str, Any]]) -> set[str]:
    """The faults already accounted for, of these events (trainer.run.history.handled_keys: named by a
    recovery, or absorbed without a restart)."""
    return set().union(*(handled_keys(event) for event in events))


def explain_restarts(run_dir: Path, before: float, world_size: int,
                     history: ControlState | None = None) -> list[dict[str, Any]]:
    """Why each restart since the last recovery happened, oldest first — one per failed attempt (start of the
    ranks) that left records before `before` (usually one; more when restarts failed in start-up in a row).
    Each: {cause: the sentence, first_failed_rank, first_failure: how, secondary_errors: count, silent_ranks,
    silent_rank_count, failures_offset: where the next explanation starts}. history: the control records as
    this start folded them (default: folded now)."""
    history = history if history is not None else control_state(run_dir)
    failures, offset = read_new_lines(RunDir(run_dir).failures_log, history.failures_offset)
    faults = [f for f in history.unhandled_faults if f["time"] < before]
    records = sorted([e for e in failures if e["time"] < before] + faults, key=lambda e: e["time"])
    attempts: dict[str, list[dict[str, Any]]] = {}
    held: list[dict[str, Any]] = []  # the runner's faults (a network drill): of the attempt whose ranks failed next
    for record in records:  # in time order, so the attempts are too
        if record["event"] == "fault" and record.get("rank") is None:
            held.append(record)
            continue
        attempts.setdefault(record.get("attempt", "?"), []).extend([*held, record])
        held = []
    if held:
        attempts.setdefault("runner", []).extend(held)
    found = [_with_hung_collective(_explain(records, world_size), run_dir, attempt, world_size)
             for attempt, records in attempts.items()] or [_explain([], world_size)]
    return [{**explanation, "failures_offset": offset} for explanation in found]


def _with_hung_collective(explanation: dict[str, Any], run_dir: Path, attempt: str,
                          world_size: int) -> dict[str, Any]:
    """The attempt's flight-recorder dumps, when its ranks left any: the collective that hung, and on which ranks
    (trainer.resilience.flight_recorder), in the cause's sentence and as a field."""
    finding = hung_collective(run_dir, attempt, world_size)
    disagree = finding is not None and (finding["mismatched"] or finding["behind"] or finding["absent"])
    if finding is None or not (disagree or finding["completion_tracked"]):
        return explanation  # gloo, every rank in the same collective: no sign that it hung
    return {**explanation, "cause": f"{explanation['cause']}; {describe(finding)}", "hung_collective": finding}


def _explain(records: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """One failed attempt's sentence from its ranks' records."""
    primary = [e for e in records if not e.get("secondary")]
    secondary = [e for e in records if e.get("secondary")]
    silent = sorted(set(range(world_size)) - {e["rank"] for e in records}) if records else []
    first = primary[0] if primary else None
    if first is not None:
        rank, how = first["rank"], _how(first)
    elif silent:
        rank, how = silent[0], ("ended without a record of its own: killed by a signal (SIGKILL, the OOM killer) "
                                "or its node was lost")
    elif secondary:
        rank, how = secondary[0]["rank"], f"was the first to fail, with a peer's error: {_how(secondary[0])}"
    else:
        rank, how = None, "no rank recorded a failure (the whole job was stopped or its machine lost)"
    others = [e for e in secondary if e is not first and e["rank"] != rank]
    others_text = ""
    if others:
        kinds = sorted({"lost peer" if e.get("how") == "exception" else "stopped by the launcher" for e in others})
        others_text = (f"; {len({e['rank'] for e in others})} other rank(s) failed after it "
                       f"({', '.join(kinds)})")
    cause = (f"rank {rank} failed first: {how}" if rank is not None else how) + others_text
    silent = silent if first is not None else silent[1:]
    return {"cause": cause, "first_failed_rank": rank, "first_failure": how, "secondary_errors": len(others),
            "silent_ranks": silent[:SILENT_RANKS_LISTED], "silent_rank_count": len(silent),
            **_decision(records, rank)}


def _decision(records: list[dict[str, Any]], rank: int | None) -> dict[str, Any]:
    """The decision taken on the first failed rank's cause (its own record's: trainer.config.decisions);
    a rank that left none (killed by a signal, a drill, a hang) was restarted as a transient fault."""
    own = next((e for e in records if e.get("rank") == rank and e.get("decision")), None)
    if own is not None:
        return {"decision": own["decision"], "decided_cause": own["cause"], "evidence": own["evidence"]}
    return {"decision": "restart", "decided_cause": "transient",
            "evidence": "no exception of its own to judge (a signal, a lost node, a hang or a drill)"}
