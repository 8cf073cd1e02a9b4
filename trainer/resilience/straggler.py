"""Straggler detection on every backend: a slow rank is named with NVRx's scores, not just felt as a slow job.

The loop times four sections of each step (``section(name)``): data, forward_backward (with the gradient
norm's all-reduce), optimizer (with the clipping), checkpoint_wait. Every ``resilience.straggler_interval`` steps the ranks
score them with NVRx's own report code and rank 0 names the stragglers:

- on CUDA, NVRx's ``Detector`` (sections on the wall clock, kernels through CUPTI: the GPU scores);
- elsewhere (CPU/gloo, where the Detector cannot start: CUPTI, torch.cuda.synchronize) the sections' times on
  the training thread's CPU clock go to NVRx's ``ReportGenerator``, which all-reduces over the process
  group's device (cpu on gloo).

Either way the result is NVRx's ``Report``: per section, score = the fastest rank's median / this rank's
median ("relative") and the rank's own best median / its median now ("individual"), in (0, 1]. Besides the
four sections, the portable path scores ``step``: the rank's own work in a step (data + forward_backward +
optimizer). A rank whose relative ``step`` score (or GPU score) is below ``resilience.straggler_threshold`` is
slow; its sections' scores say where. It is named a straggler once it is slow in
``resilience.straggler_confirm_reports`` reports in a row spanning ``resilience.straggler_confirm_seconds`` (a
straggler is persistently slower: one window's medians can be a process that shared its cores for a while, and
a burst of contention can cover two windows of a few seconds); before that it is a suspect in the report. One
section alone names nobody: it can differ between healthy
ranks (a garbage collection, an uneven shard), while a slow node is slow in all its work. The individual
scores are reported beside it but name no straggler either: a whole job that slows (a shared file system, a
checkpoint) lowers every rank's individual score and no node is to blame.

Why the CPU clock on CPU ranks: it is what a kernel's duration is on a GPU, the rank's own work. On the wall
clock a section with collectives inside (forward_backward under FSDP) ends together on every rank — the fast
ranks wait inside it for the slow one — and a rank that shares its core with another process looks slow;
a wait costs no CPU time. A section less than MIN_GAP_SECONDS slower than the fastest rank's names nobody
(timer noise on sections of microseconds), and a report is made only over a whole interval of steps (not
over the few steps between a restart and the next report).

Rank 0 writes a ``straggler_report`` event per report (the lowest step score, the stragglers' and the
suspects' ranks) and a ``straggler`` event per straggler when it is named (rank, node, its scores per section,
reports in a row); every rank sets its
Prometheus gauges (its own scores). With
``resilience.on_straggler=replace_node`` a node that is a straggler in ``straggler_patience`` reports in a
row is taken out through the node-replacement path (trainer.launch.node_lifecycle): its ranks record why and end
the node; the job replaces it like a lost one.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch.distributed as dist

from trainer.env import NODE_INDEX_ENV, NODE_RANK_ENV
from trainer.resilience import nvrx_compat
from trainer.resilience.node_exit import in_a_node_of_many, kill_this_node

log = logging.getLogger(__name__)

SECTIONS = ("data", "forward_backward", "optimizer", "checkpoint_wait")
# A rank's own work in a step: these sections' times added up, scored like a section of its own. It is what
# names a straggler (with the GPU score): a slow node is slow in all its work, while one section alone can
# differ between healthy ranks (a garbage collection, an uneven shard). checkpoint_wait is scored and reported
# but is not part of it: its work differs by rank by design (rank 0 commits, applies retention, hands uploads
# over), so it compares roles, not nodes.
STEP = "step"
STEP_SECTIONS = ("data", "forward_backward", "optimizer")
# A rank less than this much slower than the fastest in a section is not a straggler there, whatever the ratio:
# timer noise on sections of microseconds (a batch fetch), not a slow node.
MIN_GAP_SECONDS = 0.0005


def node_name() -> str:
    """The node as a report names it: the host (a pod's name on EKS), with the node index where one host runs
    several nodes (the local multi-node runner)."""
    node = os.environ.get(NODE_INDEX_ENV, os.environ.get(NODE_RANK_ENV))
    return socket.gethostname() + (f"/node-{node}" if node is not None else "")


def findings(report: Any, threshold: float, step: int) -> dict[str, Any]:
    """What rank 0 reports from NVRx's Report: every rank's scores and the stragglers — a relative score of its
    STEP below the threshold, at least MIN_GAP_SECONDS slower than the fastest rank, or a GPU score below it —
    each with that score, its sections' relative scores, the slowest of them, and its individual scores."""
    found = report.identify_stragglers(gpu_rel_threshold=threshold, section_rel_threshold=threshold,
                                       gpu_indiv_threshold=threshold, section_indiv_threshold=threshold)
    finite = lambda scores: {int(r): float(s) for r, s in scores.items() if not math.isnan(s)}  # noqa: E731
    relative = {section: finite(scores) for section, scores in report.section_relative_perf_scores.items()}
    individual = {section: finite(scores) for section, scores in report.section_individual_perf_scores.items()}
    gpu_relative = finite(report.gpu_relative_perf_scores)
    slow: dict[int, float] = {}
    fastest = _fastest_median(report, STEP)
    for straggler in found["straggler_sections_relative"].get(STEP, ()):
        score = relative[STEP][straggler.rank]
        if fastest is None or fastest * (1 / score - 1) >= MIN_GAP_SECONDS:
            slow[straggler.rank] = score
    for straggler in found["straggler_gpus_relative"]:
        slow[straggler.rank] = min(slow.get(straggler.rank, 1.0), gpu_relative[straggler.rank])
    stragglers = []
    for rank, score in sorted(slow.items()):
        sections = {s: relative[s][rank] for s in (*STEP_SECTIONS, "checkpoint_wait") if rank in relative.get(s, {})}
        if rank in gpu_relative:
            sections["gpu"] = gpu_relative[rank]
        worst = min((s for s in sections if s != "checkpoint_wait"), key=sections.get, default=STEP)
        stragglers.append({"straggler_rank": rank, "node": report.rank_to_node.get(rank, "?"), "score": score,
                           "section": worst, "sections": sections,
                           "individual_scores": {s: individual[s][rank] for s in individual if rank in individual[s]}})
    lowest = min(((score, rank) for rank, score in relative.get(STEP, {}).items()), default=None)
    return {"step": step, "threshold": threshold, "relative": relative, "individual": individual,
            "gpu_relative": gpu_relative, "rank_to_node": {int(r): n for r, n in report.rank_to_node.items()},
            "lowest": {"score": lowest[0], "rank": lowest[1]} if lowest else None,
            "stragglers": stragglers}


def _fastest_median(report: Any, section: str) -> float | None:
    """The fastest rank's median time of a section, from this rank's median and its relative score (None when
    this rank has no summary of it)."""
    summary = report.local_section_summaries.get(section)
    score = report.section_relative_perf_scores.get(section, {}).get(report.rank)
    if not summary or score is None or math.isnan(score):
        return None
    return score * summary[nvrx_compat.straggler_package().Statistic.MED]


class StragglerDetector:
    """The loop's sections and one report every `interval` steps (a collective: every rank calls after_step)."""

    def __init__(self, cfg, *, rank: int, world_size: int, device, events, telemetry=None,
                 slowdown: Callable[[], float] = lambda: 1.0):
        """slowdown(): how many times slower this rank runs (a straggler drill): each section is stretched."""
        resilience = cfg.resilience
        self.rank, self.events, self.telemetry, self.slowdown = rank, events, telemetry, slowdown
        self.threshold = resilience.straggler_threshold
        self.replace_nodes = resilience.on_straggler == "replace_node"
        self.patience = resilience.straggler_patience
        self.confirm = resilience.straggler_confirm_reports
        self.confirm_seconds = resilience.straggler_confirm_seconds
        # One rank has no one to compare with.
        self.interval = resilience.straggler_interval if world_size > 1 else 0
        self.node = node_name()
        self._times: dict[str, list[float]] = defaultdict(list)
        self._steps = 0
        self._step_time = 0.0  # this step's own work so far (STEP_SECTIONS)
        self._streaks: dict[str, int] = {}  # node -> reports in a row naming it (rank 0)
        self._streak_since: dict[str, float] = {}  # node -> when the first slow window of its streak began
        self._named: set[str] = set()  # nodes named a straggler in their current streak
        self._window_started = time.monotonic()
        self.current = "none"  # the last report's stragglers, in a few words (the TrainJob's status)
        self._detector = self._generator = None
        # CPU time of this thread on CPU ranks: what a kernel's duration is on a GPU, the rank's own work; wall
        # time would count the waits for peers inside collectives and the time other processes took the core.
        self._clock = time.perf_counter if device.type == "cuda" else time.thread_time
        if self.interval and nvrx_compat.straggler_package() is None:
            log.warning("straggler detection off: NVRx %s has no straggler package", nvrx_compat.nvrx_version())
            self.interval = 0
        elif self.interval and device.type == "cuda":
            self._detector = nvrx_compat.straggler_detector(self.node)
        elif self.interval:
            self._generator = nvrx_compat.straggler_report_generator(self.node)
        self._statistic = nvrx_compat.straggler_package().Statistic if self.interval else None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        assert name in SECTIONS, name
        started = self._clock()
        if self._detector is not None:
            with self._detector.detection_section(name, profile_cuda=name == "forward_backward"):
                yield
                self._stretch(name, started)
            return
        yield
        self._stretch(name, started)
        if self.enabled:
            elapsed = self._clock() - started
            self._times[name].append(elapsed)
            if name in STEP_SECTIONS:
                self._step_time += elapsed

    def _stretch(self, name: str, started: float) -> None:
        """A straggler drill: the section's own work takes `slowdown` times as long — on the CPU clock by
        working (a slower processor), on the wall clock by waiting."""
        factor = self.slowdown()
        if factor <= 1 or name == "checkpoint_wait":  # the drill slows the rank's compute, not its saves
            return
        until = started + factor * (self._clock() - started)
        if self._clock is time.thread_time:
            while time.thread_time() < until:
                pass
        else:
            time.sleep(max(0.0, until - time.perf_counter()))

    def after_step(self, step: int) -> dict[str, Any] | None:
        """Every interval steps: the report (collective), its events and gauges, and the action. Returns what
        every rank learnt (findings), or None between reports."""
        if not self.enabled:
            return None
        self._steps += 1
        if self._detector is None:
            self._times[STEP].append(self._step_time)
        self._step_time = 0.0
        if step % self.interval:
            return None
        steps, self._steps = self._steps, 0
        if steps < self.interval:  # a window cut short by a restart: too few samples for a median, skipped
            self._times.clear()
            self._window_started = time.monotonic()
            if self._detector is not None:
                self._detector.generate_report()  # the Detector's own samples go too (a collective)
            return None
        if self._detector is not None:
            report = self._detector.generate_report()
        else:
            report = self._generator.generate_report(self._summaries(), {})
        self._times.clear()
        found = self._judge(report, step, steps) if self.rank == 0 else None
        self._window_started = time.monotonic()
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
        self.current = ("; ".join(f"rank {s['straggler_rank']} at {s['score']:.2f} ({s['section']})"
                                  for s in found["stragglers"]) or "none")[:64]
        self._observe(found)
        if found.get("replace_node") == self.node:
            self._leave(found)
        return found

    def _summaries(self) -> dict[str, dict]:
        S = self._statistic
        return {name: {S.MIN: min(times), S.MAX: max(times), S.MED: statistics.median(times),
                       S.AVG: statistics.fmean(times), S.STD: statistics.stdev(times) if len(times) > 1 else math.nan,
                       S.NUM: len(times)} for name, times in self._times.items() if times}

    def _judge(self, report: Any, step: int, steps: int) -> dict[str, Any]:
        found = {**findings(report, self.threshold, step), "steps": steps}
        slow = found["stragglers"]
        nodes = {s["node"] for s in slow}
        self._streaks = {node: self._streaks.get(node, 0) + 1 for node in nodes}
        self._streak_since = {node: self._streak_since.get(node, self._window_started) for node in nodes}
        now = time.monotonic()
        # Once both hold they hold for the rest of the streak (both only grow): named stays named.
        named = {node for node in nodes if self._streaks[node] >= self.confirm
                 and now - self._streak_since[node] >= self.confirm_seconds}
        newly_named, self._named = named - self._named, named
        found["stragglers"] = [s for s in slow if s["node"] in named]
        found["suspects"] = [s["straggler_rank"] for s in slow if s["node"] not in named]
        # Compact: the per-rank maps (thousands of ranks, every interval for weeks) stay out of the events;
        # each straggler's own scores are in its straggler event, every rank's in its Prometheus gauges.
        self.events.write("straggler_report", step=step, steps=steps, threshold=self.threshold, ranks=len(
            found["rank_to_node"]), lowest=found["lowest"], stragglers=[s["straggler_rank"] for s in found["stragglers"]],
            suspects=found["suspects"])
        for suspect in (s for s in slow if s["straggler_rank"] in found["suspects"]):
            log.info("straggler suspect: rank %d (node %s) at step %d: its work at %.2f of the fastest rank's "
                     "(threshold %.2f) in %d report(s) in a row over %.0f s; named once slow in %d over %g s",
                     suspect["straggler_rank"], suspect["node"], step, suspect["score"], self.threshold,
                     self._streaks[suspect["node"]], now - self._streak_since[suspect["node"]], self.confirm,
                     self.confirm_seconds)
        for straggler in found["stragglers"]:
            streak = self._streaks[straggler["node"]]
            action = "replace_node" if self.replace_nodes and streak >= self.patience else "report"
            # a control record per streak (when it is named) and per action, not per report
            if straggler["node"] in newly_named or action != "report":
                self.events.write("straggler", step=step, consecutive_reports=streak,
                                  first_of_streak=straggler["node"] in newly_named, action=action,
                                  threshold=self.threshold, **straggler)
            log.warning("straggler: rank %d (node %s) at step %d: its work at %.2f of the fastest rank's (threshold "
                        "%.2f; slowest section %s at %.2f), %d report(s) in a row%s", straggler["straggler_rank"],
                        straggler["node"], step, straggler["score"], self.threshold, straggler["section"],
                        straggler["sections"].get(straggler["section"], straggler["score"]), streak,
                        ": replacing its node" if action == "replace_node" else "")
            if action == "replace_node" and "replace_node" not in found:
                found["replace_node"] = straggler["node"]
        if not found["stragglers"]:
            lowest = found["lowest"]
            log.info("straggler report at step %d: none (lowest relative score %s)", step,
                     f"{lowest['score']:.2f}, rank {lowest['rank']}" if lowest else "n/a")
        return found

    def _observe(self, found: dict[str, Any]) -> None:
        if self.telemetry is None:
            return
        mine = {section: scores[self.rank] for section, scores in found["relative"].items() if self.rank in scores}
        if self.rank in found["gpu_relative"]:
            mine["gpu"] = found["gpu_relative"][self.rank]
        self.telemetry.observe_straggler(mine, any(s["straggler_rank"] == self.rank for s in found["stragglers"]))

    def _leave(self, found: dict[str, Any]) -> None:
        straggler = next(s for s in found["stragglers"] if s["node"] == self.node)
        why = (f"replaced as a straggler: its work at {straggler['score']:.2f} of the fastest rank's (slowest in "
               f"{straggler['section']}) in {self.patience} reports in a row (resilience.on_straggler=replace_node)")
        if not in_a_node_of_many():  # started by hand without the node launcher: nothing to replace it with
            log.error("%s, but this rank is not on a node of a multi-node job: reporting only", why)
            return
        # Recorded only when the node really goes: the record is what explains the restart that follows.
        self.events.write("rank_failed", how="straggler", message=why, step=found["step"], phase="train",
                          secondary=False)
        kill_this_node(why)

    def close(self) -> None:
        if self._detector is not None:
            self._detector.shutdown()
            self._detector = None
