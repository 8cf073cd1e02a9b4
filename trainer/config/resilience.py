"""The sections of recovery: the restart layers, straggler detection, start-up watchdogs, and fault drills."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.config.drills import FAULT_TYPES, NETWORK_FAULTS, parse_schedule, parse_startup_timeouts
from trainer.config.decisions import parse_decisions
from trainer.config.rules import ConfigError, require


@dataclass
class ResilienceConfig:
    """Recovery layers: ft_launcher (in-job restart) and a bounded relaunch of the whole job."""

    in_process: bool = False
    """Layer 1: NVRx in-process restart (inprocess.Wrapper) — a Python exception or hang is recovered without
    ending the processes: the process group is rebuilt and state reloaded. Process deaths go to layer 2."""

    in_process_max_restarts: int = 2
    """In-process restarts in a row that make no progress (see max_restarts_without_progress) before a fault
    escalates to the launcher (layer 2), whose process restart may clear what an in-process one cannot.
    In-process restarts after which training progressed are not counted."""

    collective_timeout: float = 5.0
    """gloo collective timeout (seconds) under in-process restart: on gloo only this timeout releases a
    rank blocked in a collective whose peer failed, so it must stay below soft_timeout."""

    soft_timeout: float = 20.0
    """In-process: seconds without progress (one ping per step) before a rank is declared hung."""

    launcher: Literal["ft_launcher", "torchrun"] = "ft_launcher"
    """ft_launcher restarts the workers after a crash, SIGKILL, OOM-style exit or hang (missed heartbeats)
    while keeping the launcher and rendezvous; torchrun has no hang detection (baseline)."""

    max_restarts_without_progress: int = 3
    """The restart budget, for every layer (in-process, ft_launcher, the job relaunch, the TrainJob on EKS):
    give up after this many recoveries in a row that did not advance the state a recovery reads (each
    resumed from the same step as the attempt before it, or died before resuming) — a crash loop. A recovery
    after which training progressed costs nothing, so a long job survives any number of faults that it
    recovers from. Giving up exits with code 42 (trainer.resilience.budget.CRASH_LOOP_EXIT_CODE), which no
    layer restarts, and writes the reason to <run_dir>/gave_up.json."""

    max_restarts: int = -1
    """ft_launcher's own restart count per launch: -1 (default) leaves in-job restarts to the progress rule
    above; N >= 0 also caps them at N per launch (0 turns in-job restart off, as benchmarks comparing the
    layers do), after which the job relaunch takes over."""

    warm_start: bool = True
    """Start every worker, and every restarted one, as a fork of a node-local server that has already imported
    torch, transformers and the trainer (trainer.warm_start): a restart skips the imports (~4 s here)."""

    initial_heartbeat_timeout: float = 0.0
    """ft_launcher's --ft-initial-rank-heartbeat-timeout: seconds from a worker's connection to its rank monitor
    to its first heartbeat. 0 derives it from the model's checkpoint size, kubernetes.fsx_throughput_mbps and
    the GPU count (at least 120 s; see trainer.launch.command.initial_heartbeat_timeout). ft_launcher starts this
    clock only when the worker connects, which it does at its first heartbeat (trainer.resilience.hooks.
    Heartbeat): the start-up before it is bounded phase by phase by resilience.startup_timeouts."""

    heartbeat_timeout: float = 60.0
    """Seconds without a heartbeat (one per step) after which ft_launcher declares a rank hung and restarts."""

    rendezvous_timeout: float = 600.0
    """Seconds a one-node TrainJob's c10d rendezvous waits for its node (rdzv-conf join_timeout); multi-node
    jobs use resilience.replacement_timeout_seconds."""

    replacement_timeout_seconds: float = 600.0
    """Multi-node jobs: how long the surviving nodes wait in the rendezvous for a lost node's replacement
    before they give up with exit code 43 and the whole job restarts (from FSx). It is the rendezvous's
    join_timeout of every round, so it also bounds the first one (the nodes of a gang start together)."""

    store_timeout_seconds: float = 60.0
    """Multi-node jobs: seconds a node's launcher goes without reaching the rendezvous store (once it has reached it)
    before it declares itself cut off from the job's network: it stops its workers and exits 46, and the node is
    replaced (the cut-off node's detector; docs/network-faults.md). 0: never (a cut-off node then waits until the
    others give up on it). Above any store outage that should cost nothing (a store pod's restart)."""

    node_health_check_endpoint: str = ""
    """NVRx >= 0.5: a node health check service (Unix socket, e.g. /var/run/nvhcd.sock) ft_launcher asks
    before each rendezvous; empty = none (older NVRx ignores it, saying so)."""

    gpu_health_interval_steps: int = 100
    """Check the GPU through NVML (ECC, retired/remapped memory, critical XIDs) every this many steps;
    0 turns it off. A no-op on machines without NVIDIA drivers."""

    startup_timeouts: str = ""
    """Timeouts of the start-up phases, 'phase=seconds,...' over the defaults: rendezvous=900, process_group=600,
    model_build=1200, restore=600, restore_memory=300, restore_s3=7200, restore_fsx=3600, restore_base=1800,
    first_step=1200, the reads (restore_fsx, restore_base) raised to 1.5 x what the model's size takes at
    kubernetes.fsx_throughput_mbps (trainer.resilience.phases). A rank past one records a `hang` naming the phase
    and exits, so the restart follows at once instead of at the end of the initial heartbeat timeout."""

    straggler_interval: int = 50
    """Every this many steps the ranks compare their section times (data, forward_backward, optimizer,
    checkpoint_wait) and score each rank as NVRx's straggler Report does; 0 turns detection off."""

    straggler_threshold: float = 0.75
    """A rank whose relative score in a section (its median time against the fastest rank's; on GPU also
    NVRx's kernel score) is below this is a straggler. NVRx's default."""

    on_straggler: Literal["report", "replace_node"] = "report"
    """report: a `straggler` event, the MLflow table, the Prometheus gauge, console and summary lines.
    replace_node: also take the straggler's node out through the node-replacement path (multi-node jobs)
    once it has been a straggler in resilience.straggler_patience reports in a row."""

    straggler_confirm_reports: int = 2
    """Reports in a row a rank must be below the threshold in before it is named a straggler: a straggler is
    persistently slower, and one window's medians are not yet that (a process sharing the rank's cores for a
    while, a neighbour's job on the host). Below it in fewer, the rank is a suspect in the report (its
    `suspects`), named by nobody. 1 names it in the first report."""

    straggler_confirm_seconds: float = 60.0
    """...and the seconds of training those reports must span, from the start of the first slow window: a
    burst of contention on a shared machine (a neighbour's job, a network hiccup's catch-up) lasts seconds and can
    cover two short windows, a slow node stays slow. With reports minutes apart (straggler_interval steps of
    seconds each) this adds nothing; it holds back a job whose windows last seconds. 0: reports alone."""

    straggler_patience: int = 3
    """Reports in a row naming the same node (counted from its first slow one) before
    on_straggler=replace_node replaces it; at least straggler_confirm_reports."""

    decisions: str = ""
    """What is done about a failed attempt, by its cause, 'cause=decision,...' over the defaults: hardware=
    replace_node, lost_peer=restart, deterministic=stop (the same exception in the same frame at the same step a
    second time in a launch), data=rollback, transient=restart. Decisions: restart, replace_node, stop,
    rollback (data only); docs/numeric-faults.md has the table (trainer.config.decisions)."""

    numeric_checks: bool = True
    """Check every step's loss and gradient norm before the optimizer applies them (they are all-reduced anyway:
    no extra synchronisation): a non-finite value or a spike is an anomaly. Its optimizer step is skipped and
    the step re-executed on the same batch: clean, it was transient (suspected silent data corruption) and
    training goes on; again, it is the data or divergence, and training rolls back and skips a data window
    (docs/numeric-faults.md). false: whatever the step computes is applied, NaN included."""

    spike_zscore: float = 6.0
    """A loss or gradient norm this many robust standard deviations (1.4826 x the median absolute deviation)
    above the median of the last resilience.spike_window accepted steps is a spike. 0: spikes are not checked
    (non-finite values still are)."""

    spike_window: int = 100
    """The accepted steps a spike is measured against."""

    spike_after_steps: int = 100
    """Spikes are checked from this step on, once the window is full: early in training the loss falls too fast
    to be a baseline."""

    rollback_steps: int = 100
    """A reproducible anomaly at step S: training goes back to the newest state at or before step S -
    rollback_steps (PaLM, section 5.1, restarted ~100 steps before a spike: a cause in the optimizer's state is
    not trained again from that same state), and the window of samples it skips starts this many global batches
    before S's: what of it that state has not trained yet is never trained. Node memory holds the newest step or
    two, so a rollback of 2 or more steps reads the FSx checkpoint at or before its target (one checkpoint load,
    and up to rollback_steps + checkpoint.interval_steps steps trained again; none older: training goes on from
    where it is, the anomalous step not applied). 0 and 1 go back to the state just before S."""

    skip_steps: int = 200
    """...and ends this many global batches after S's first sample, S's own batch included (PaLM skipped
    200-500 batches in all)."""

    min_replica_groups: int = 0
    """With training.replica_groups = R >= 2: the fewest groups the job goes on with when a group cannot come
    back (its restart budget gave up, no spare is left); 0 means R, every group: such a loss then stops the job
    (the job relaunch restarts every group from the tiers). A group that fails and comes back never stops the
    others: they commit without it meanwhile, whatever this says (docs/replica-groups.md)."""

    replica_timeout_seconds: float = 10.0
    """Replica groups: torchft's timeout for the all-reduce across groups, the commit vote and a heal's transfer.
    A group that dies mid-step costs the others at most this (on NCCL; gloo sees a dead peer's socket close)."""

    quorum_timeout_seconds: float = 30.0
    """Replica groups: how long a group waits for the lighthouse to form a quorum (and to connect to it)."""

    lighthouse_join_timeout_seconds: float = 5.0
    """Replica groups: how long the lighthouse waits for groups that heartbeat but have not asked to join
    before it forms a quorum without them (a group that restarts joins the next one)."""

    lighthouse_heartbeat_timeout_seconds: float = 2.0
    """Replica groups: a group whose manager sent no heartbeat for this long is dead to the lighthouse: the
    detection time of a group's loss by the groups left."""

    replica_check_interval: int = 100
    """Replica groups: every this many steps the groups compare checksums of their parameters (HSDP keeps them
    equal; a difference is a `replica_divergence` event and an error in the log); 0 turns it off."""

    sdc_check_every: int = 100
    """Replica groups: every this many steps each rank's parameter shard is fingerprinted and compared with its
    peers' in the other groups (silent data corruption: trainer.resilience.sdc); 0 turns it off."""

    sdc_strikes: int = 2
    """Replica groups: a node named by this many fingerprint findings is replaced."""

    lighthouse_retries: int = 10
    """Replica groups: quorum requests retried when the lighthouse cannot be reached (it restarts: locally the
    runner starts it again, on EKS its pod), before the group fails."""

    job_restarts: int = -1
    """Relaunches of the whole local training job after its launcher failed: -1 (default) relaunches while the
    progress rule allows (and while relaunches start training at all); N >= 0 caps them at N (0: none).
    On EKS the JobSet's failure policy restarts the TrainJob's pods (see docs/restart-budget.md)."""

    def __post_init__(self) -> None:
        require(self.max_restarts_without_progress >= 1, "resilience.max_restarts_without_progress", "must be >= 1")
        require(self.max_restarts >= -1, "resilience.max_restarts", "must be >= 0, or -1 for no count of its own")
        require(self.job_restarts >= -1, "resilience.job_restarts", "must be >= 0, or -1 for no count of its own")
        require(self.initial_heartbeat_timeout >= 0, "resilience.initial_heartbeat_timeout",
                 "must be >= 0 (0 derives it from the checkpoint size)")
        require(self.rendezvous_timeout > 0, "resilience.rendezvous_timeout", "must be > 0")
        require(self.replacement_timeout_seconds > 0, "resilience.replacement_timeout_seconds", "must be > 0")
        require(self.heartbeat_timeout > 0, "resilience.heartbeat_timeout", "must be > 0")
        require(self.in_process_max_restarts >= 1, "resilience.in_process_max_restarts", "must be >= 1")
        require(0 < self.collective_timeout < self.soft_timeout, "resilience.collective_timeout",
                 f"must be in (0, resilience.soft_timeout={self.soft_timeout})")
        require(self.min_replica_groups >= 0, "resilience.min_replica_groups", "must be >= 0 (0: every group)")
        for name in ("replica_timeout_seconds", "quorum_timeout_seconds", "lighthouse_join_timeout_seconds",
                     "lighthouse_heartbeat_timeout_seconds"):
            require(getattr(self, name) > 0, f"resilience.{name}", "must be > 0")
        require(self.sdc_check_every >= 0, "resilience.sdc_check_every", "must be >= 0 (0: off)")
        require(self.sdc_strikes >= 1, "resilience.sdc_strikes", "must be >= 1")
        require(self.lighthouse_retries >= 0, "resilience.lighthouse_retries", "must be >= 0")
        require(self.replica_check_interval >= 0, "resilience.replica_check_interval", "must be >= 0 (0: off)")
        try:
            parse_startup_timeouts(self.startup_timeouts)
        except ValueError as err:
            raise ConfigError(f"resilience.startup_timeouts: {err}") from err
        try:
            parse_decisions(self.decisions)
        except ValueError as err:
            raise ConfigError(f"resilience.decisions: {err}") from err
        require(self.spike_zscore >= 0, "resilience.spike_zscore", "must be >= 0 (0: spikes are not checked)")
        require(self.spike_window >= 8, "resilience.spike_window", "must be >= 8 (a median needs a few steps)")
        require(self.spike_after_steps >= 0, "resilience.spike_after_steps", "must be >= 0")
        require(self.rollback_steps >= 0, "resilience.rollback_steps", "must be >= 0")
        require(self.skip_steps >= 1, "resilience.skip_steps", "must be >= 1 (the anomaly's own batch is skipped)")
        require(self.straggler_interval >= 0, "resilience.straggler_interval", "must be >= 0 (0: off)")
        require(0 < self.straggler_threshold <= 1, "resilience.straggler_threshold", "must be in (0, 1]")
        require(self.straggler_confirm_reports >= 1, "resilience.straggler_confirm_reports", "must be >= 1")
        require(self.straggler_confirm_seconds >= 0, "resilience.straggler_confirm_seconds", "must be >= 0 (0: reports alone)")
        require(self.straggler_patience >= self.straggler_confirm_reports, "resilience.straggler_patience",
                f"must be >= resilience.straggler_confirm_reports ({self.straggler_confirm_reports}): a node is "
                "replaced only once it is named a straggler")


    def min_groups(self, groups: int) -> int:
        """The fewest replica groups a step commits with, of `groups`."""
        return self.min_replica_groups or groups


@dataclass
class FaultsConfig:
    """Fault injection for drills, tests and benchmarks; off unless a schedule is given. Always logged."""

    schedule: str = ""
    """Comma-separated faults, TYPE@STEP or TYPE@t=SECONDS with an optional :rank=R, e.g.
    'sigkill@120:rank=1, hang@200'. Types: exception, hang, hang_in_collective, sigkill, exit (OOM-like,
    code 137), slow_rank (one pause), straggler (persistently slower: faults.straggler_factor),
    hang_in_rendezvous / hang_in_process_group / hang_in_model_build / hang_in_restore / hang_in_first_step (a
    hang in that start-up phase of the first start after step STEP; 0: the first start), checkpoint_writer_crash, node_loss (SIGKILL with the rank's node memory wiped; in a
    multi-node job its whole node: launcher, workers, node memory), group_loss@STEP:group=G[:permanent] (with
    training.replica_groups >= 2: every node of replica group G at once; :permanent, no replacement comes),
    corrupt_memory (SIGKILL with its newest memory copy corrupted), and the save drills kill_during_shard_write,
    kill_before_manifest, kill_before_rename, kill_before_parent_fsync, kill_during_retention (SIGKILL at that
    sub-step of the first save of step >= STEP), and the numeric drills nan@STEP[:rank=R] / spike@STEP[:rank=R]
    (the loss of the batch step STEP trains in a run without skips made non-finite / 8x larger, each time that
    batch is trained) and sdc@STEP:rank=R (one bit of one value of rank R's gradient flipped, once). Each other
    fault fires once per run, so a replayed step does not fire it again."""

    mtbf_steps: float = 0.0
    """Add a seeded random schedule with this mean number of steps between faults (0: none)."""

    random_types: str = "exception,sigkill"
    """Fault types the random schedule draws from (comma-separated)."""

    seed: int = 0
    """Seed of the random schedule (fault steps, types and ranks)."""

    slow_seconds: float = 5.0
    """How long a slow_rank fault stalls its rank."""

    straggler_factor: float = 1.5
    """A straggler fault makes its rank this many times slower in every step from its step on, until the
    rank's node is replaced (a new launcher): each section's time is stretched by this factor."""

    def __post_init__(self) -> None:
        require(self.mtbf_steps >= 0, "faults.mtbf_steps", "must be >= 0")
        require(self.slow_seconds >= 0, "faults.slow_seconds", "must be >= 0")
        require(self.straggler_factor > 1, "faults.straggler_factor", "must be > 1 (1.5: 50 % slower)")
        rank_fired = [kind for kind in FAULT_TYPES if kind not in NETWORK_FAULTS]  # a random fault is a rank's
        for name in (t.strip() for t in self.random_types.split(",") if t.strip()):
            require(name in rank_fired, "faults.random_types", f"{name!r} is not one of {rank_fired}")
        try:
            parse_schedule(self.schedule)
        except ValueError as err:
            raise ConfigError(f"faults.schedule: {err}") from err
