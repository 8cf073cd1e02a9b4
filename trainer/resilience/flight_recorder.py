"""Collective hangs explain themselves: torch's flight recorder keeps each rank's last collectives, its dump lands
in the run folder, and the recovery's cause names the collective that hung and the ranks that held it up.

    enable(run_dir, attempt)            # the trainer, before its process group: the recorder on, dumps go here
    dump(run_dir, attempt, rank)        # a rank whose collective failed (gloo; NCCL's watchdog dumps on a timeout)
    StallDump(run_dir, attempt, rank, after_seconds).beat()   # and a rank whose loop stopped beating
    hung_collective(run_dir, attempt)   # the recovery: {collective, seq, process_group, waiting, behind, ...}

Where: ``<run_dir>/flight_recorder/<attempt>/rank_<R>``, an attempt being trainer.run.events.current_attempt with
'-' for '/' (one folder per failed attempt; explain_restarts reads that attempt's). The dumps are torch's own
format (torch/csrc/distributed/c10d/FlightRecorder: ``entries`` with ``collective_seq_id``, ``profiling_name``,
``process_group``, ``state``): NCCL's watchdog writes them pickled (TORCH_NCCL_DUMP_ON_TIMEOUT, to
TORCH_FR_DUMP_TEMP_FILE + rank), ours are torch's JSON dump. A pickle is read with an unpickler that builds
plain containers only (no class is ever looked up).

No torch at import: the launcher's node process reads these too.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FOLDER = "flight_recorder"
ENTRIES = 2000  # per process group and rank: ~1 MB of dump; the last steps' collectives of an 8B model
PENDING_STATES = ("scheduled", "started")
SUMMARY = ".summary"  # rank_<R>.summary: the entries analyze reads (reduce_dump), beside the whole dump


def folder_of(run_dir: Path, attempt: str) -> Path:
    return Path(run_dir) / FOLDER / attempt.replace("/", "-")


def enable(run_dir: Path, attempt: str) -> None:
    """The recorder's settings for this process's groups (read when a group is created), and the CUDA allocator's
    expandable segments (read at its first allocation: fewer retries from fragmentation); a user's own win."""
    folder = folder_of(run_dir, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    # torch >= 2.7's names (TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE are their old ones)
    for name, value in (("TORCH_FR_BUFFER_SIZE", str(ENTRIES)), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                        ("TORCH_FR_DUMP_TEMP_FILE", f"{folder}/rank_"),
                        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")):
        os.environ.setdefault(name, value)


def dump(run_dir: Path, attempt: str, rank: int) -> Path | None:
    """This rank's recorder into the attempt's folder, replacing an earlier dump of it (the newest knows most);
    never raises: the failure itself matters more. On CUDA NCCL's recorder (the training's collectives), else
    the generic one (gloo's)."""
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0:
        return None
    try:
        import torch  # only here: the module is read by processes without torch (the launcher)

        c10d = torch._C._distributed_c10d
        nccl = getattr(c10d, "_dump_nccl_trace_json", None) if torch.cuda.is_available() else None
        data = (nccl or c10d._dump_fr_trace_json)()
        data = data if isinstance(data, bytes) else data.encode()
        path = folder_of(run_dir, attempt) / f"rank_{rank}"
        for target, content in ((path, data), (path.with_name(path.name + SUMMARY),
                                               json.dumps(reduce_dump(json.loads(data))).encode())):
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_bytes(content)
            tmp.replace(target)
        return path
    except Exception:  # noqa: BLE001
        log.exception("could not dump the flight recorder")
        return None


class StallDump:
    """Dumps this rank's recorder once its loop has not beaten for `after_seconds` (half the launcher's heartbeat
    timeout: before the launcher ends the process, which then runs no handler of its own), once per stall. A
    rank blocked in a collective is found there: the recovery reads the dumps of every rank that was."""

    def __init__(self, run_dir: Path, attempt: str, rank: int, after_seconds: float):
        import threading  # only here, with the thread it starts

        self.run_dir, self.attempt, self.rank, self.after = run_dir, attempt, rank, after_seconds
        self._last: float | None = None  # armed at the first beat: start-up has its own watchdog
        self._dumped_for: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="flight-recorder-stall", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.after / 4)):
            last = self._last
            if last is not None and last != self._dumped_for and time.monotonic() - last > self.after:
                self._dumped_for = last
                log.warning("no progress for %.0f s: flight recorder dumped to %s", self.after,
                            dump(self.run_dir, self.attempt, self.rank))


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a flight-recorder dump holds only plain data, not {module}.{name}")


def read_dump(path: Path) -> dict[str, Any] | None:
    data = path.read_bytes()
    try:
        return json.loads(data) if data[:1] == b"{" else _PlainUnpickler(io.BytesIO(data)).load()
    except (ValueError, pickle.UnpicklingError, EOFError) as err:
        log.warning("flight recorder: %s is not a dump (%s)", path, err)
        return None


def reduce_dump(found: dict[str, Any]) -> dict[str, Any]:
    """The entries analyze reads of a dump, per group: its newest completed entry, its first pending one and its
    newest (analyze gives the same finding from them): ~1 KB where the dump is ~0.7 MB, so a recovery at 8,192
    ranks reads megabytes, not gigabytes."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for entry in found.get("entries") or []:
        if not entry.get("is_p2p"):
            groups.setdefault(_group_of(entry), []).append(entry)
    kept = []
    for entries in groups.values():
        completed = [e for e in entries if e.get("state") == "completed"]
        pending = [e for e in entries if e.get("state") in PENDING_STATES]
        picked = {id(e): e for e in (completed[-1:] + pending[:1] + entries[-1:])}
        kept += sorted(picked.values(), key=lambda e: int(e.get("collective_seq_id", 0)))
    return {"entries": [{k: v for k, v in e.items() if k != "frames"} for e in kept]}


def hung_collective(run_dir: Path, attempt: str, world_size: int | None = None) -> dict[str, Any] | None:
    """The finding of an attempt's dumps (analyze), or None when it left none. Each rank's summary where it wrote
    one (dump), else its whole dump (NCCL's watchdog writes no summary)."""
    folder = folder_of(run_dir, attempt)
    dumps = {}
    for path in sorted(folder.glob("rank_*")) if folder.is_dir() else []:
        suffix = path.name.removeprefix("rank_")
        if not suffix.isdigit():
            continue
        summary = path.with_name(path.name + SUMMARY)
        found = read_dump(summary if summary.exists() else path)
        if found is not None:
            dumps[int(suffix)] = found
    return analyze(dumps, world_size) if dumps else None


def _group_of(entry: dict[str, Any]) -> str:
    group = entry.get("process_group") or ["?", "?"]
    return str(group[1] or group[0])


def _pending(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A group's collective still in flight on a rank: its oldest not completed where completion is tracked
    (NCCL), else its newest (gloo's entries stay 'scheduled': the newest is where the rank stopped)."""
    collectives = [e for e in entries if not e.get("is_p2p")]
    if not collectives:
        return None
    if any(e.get("state") == "completed" for e in collectives):
        return next((e for e in collectives if e.get("state") in PENDING_STATES), None)
    return collectives[-1]


def _stuck_in(pending: dict[str, dict[str, Any]], tracked: bool) -> dict[str, Any]:
    """Where a rank is stuck, of its groups' pending collectives: the oldest not completed (NCCL), or the one it
    entered last (gloo: the thread that trains blocks in it)."""
    pick = min if tracked else max
    return pick(pending.values(), key=lambda e: int(e.get("time_created_ns") or 0))


def analyze(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> dict[str, Any] | None:
    """The collective that hung. Each rank is stuck in one collective (_stuck_in). Where completion is tracked
    (NCCL) the oldest of them hung; on gloo, of the group the ranks block in, the furthest any rank got (the first
    rank to enter it, where two entered different ones). Of that group: `waiting` the ranks
    inside that collective, `mismatched` ranks at the same number in another collective (a rank that called
    something else: the collectives' order differs), `behind` ranks that never reached it (their newest is
    older: stuck before it, in compute or on another group), `absent` ranks without a dump (dead, or killed
    before they could write)."""
    pending: dict[int, dict[str, dict[str, Any]]] = {}
    newest: dict[int, dict[str, int]] = {}
    stuck: dict[int, dict[str, Any]] = {}
    # The training's collectives run on groups torch names (default_pg, a mesh's mesh_dp_shard, ...); groups made
    # without a description ("undefined": the checkpoint writer's, the peer replica's) run beside them on threads
    # of their own, and a rank is never stuck in them while it trains.
    named = any(_group_of(e) != "undefined" for found in dumps.values() for e in found.get("entries") or [])
    for rank, found in dumps.items():
        groups: dict[str, list[dict[str, Any]]] = {}
        for entry in found.get("entries") or []:
            if not named or _group_of(entry) != "undefined":
                groups.setdefault(_group_of(entry), []).append(entry)
        tracked = any(e.get("state") == "completed" for entries in groups.values() for e in entries)
        newest[rank] = {g: max(int(e.get("collective_seq_id", 0)) for e in entries) for g, entries in groups.items()}
        pending[rank] = {g: p for g, entries in groups.items() if (p := _pending(entries)) is not None}
        if pending[rank]:
            stuck[rank] = _stuck_in(pending[rank], tracked)
    if not stuck:
        return None
    tracked = any(e.get("state") == "completed" for found in dumps.values() for e in found.get("entries") or [])
    created = lambda entry: int(entry.get("time_created_ns") or 0)  # noqa: E731
    if tracked:  # the oldest collective not completed anywhere
        first = min(stuck.values(), key=created)
    else:  # the furthest any rank got in the group the ranks block in: the others never completed it
        group = _group_of(max(stuck.values(), key=created))
        ahead = max(int(p[group]["collective_seq_id"]) for p in pending.values() if group in p)
        first = min((p[group] for p in pending.values() if group in p and int(p[group]["collective_seq_id"]) == ahead),
                    key=created)
    group, seq, name = _group_of(first), int(first["collective_seq_id"]), first.get("profiling_name", "?")
    at_seq = {r: p[group] for r, p in pending.items() if group in p and int(p[group]["collective_seq_id"]) == seq}
    ranks = set(range(world_size)) if world_size else set(dumps)
    return {"collective": name, "seq": seq, "process_group": group,
            "waiting": sorted(r for r, e in at_seq.items() if e.get("profiling_name") == name),
            "mismatched": {str(r): e.get("profiling_name") for r, e in sorted(at_seq.items())
                           if e.get("profiling_name") != name},
            "behind": sorted(r for r, n in newest.items() if n.get(group, -1) < seq and r not in at_seq),
            "absent": sorted(ranks - set(dumps)),
            "input_sizes": first.get("input_sizes"), "timeout_ms": first.get("timeout_ms"),
            "completion_tracked": tracked}


def describe(finding: dict[str, Any]) -> str:
    """One sentence: the collective, and who held it up."""
    parts = [f"the collective left waiting: {finding['collective']} #{finding['seq']} of process group "
             f"{finding['process_group']}, rank(s) {finding['waiting']} in it"]
    if finding["mismatched"]:
        parts.append(", ".join(f"rank {r} entered {name} instead" for r, name in finding["mismatched"].items()))
    if finding["behind"]:
        parts.append(f"rank(s) {finding['behind']} never reached it")
    if finding["absent"]:
        parts.append(f"rank(s) {finding['absent'][:16]} left no dump (dead, or killed first)")
    return "; ".join(parts)
