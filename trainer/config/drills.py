"""What a drill schedule and the start-up timeouts say, parsed and checked with the config (no process is
touched here: trainer.resilience.faults fires the faults, trainer.resilience.phases watches the phases).

    faults.schedule = "sigkill@120:rank=1, hang@200, exception@t=30, kill_before_rename@40, exception@150:repeat"
    faults.schedule = "partition@40:node=1:seconds=30, flap@80:node=0:times=3, partition_store@120:seconds=5"
    resilience.startup_timeouts = "rendezvous=60,restore_fsx=600"

Loop faults fire after a step; numeric drills act inside one (a poisoned batch, a flipped gradient bit); network drills are enacted by the local runner from outside the nodes
(localcluster/network.py) once the run has trained their step; save drills act at one sub-step of a save; start-up hangs hang a rank in one
start-up phase. A schedule item that could never fire is refused when the schedule is parsed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

STARTUP_PHASES = ("rendezvous", "process_group", "model_build", "restore", "restore_memory", "restore_s3",
                  "restore_fsx", "restore_base", "first_step")
# Generous: each bounds one phase of the slowest legitimate start (a 1,000-GPU NCCL set-up, an 8B model's
# checkpoint from FSx or S3); tests and drills pass short ones.
DEFAULT_STARTUP_TIMEOUTS = {"rendezvous": 900.0, "process_group": 600.0, "model_build": 1200.0,
                            "restore": 600.0, "restore_memory": 300.0, "restore_s3": 7200.0, "restore_fsx": 3600.0,
                            "restore_base": 1800.0, "first_step": 1200.0}
# The drills: fault type -> the phases it hangs in.
STARTUP_HANGS = {"hang_in_rendezvous": ("rendezvous",), "hang_in_process_group": ("process_group",),
                 "hang_in_model_build": ("model_build",),
                 "hang_in_restore": ("restore_memory", "restore_s3", "restore_fsx", "restore_base"),
                 "hang_in_first_step": ("first_step",)}
LOOP_FAULTS = ("exception", "hang", "hang_in_collective", "sigkill", "exit", "slow_rank", "node_loss",
               "corrupt_memory", "straggler", "group_loss", "bug")
# Save drill -> the sub-step of CheckpointManager.save it acts at (the manager calls save_point(point, step)).
SAVE_KILLS = {"kill_during_shard_write": "shard_write", "kill_before_manifest": "before_manifest",
              "kill_before_rename": "before_rename", "kill_before_parent_fsync": "before_parent_fsync",
              "kill_during_retention": "retention"}
SAVE_FAULTS = {**SAVE_KILLS, "checkpoint_writer_crash": "write"}
# Sub-steps only rank 0 performs (the commit runs on rank 0's commit thread): a drill there on another rank
# could never fire.
RANK_0_SAVE_POINTS = ("before_manifest", "before_rename", "before_parent_fsync", "retention")
# Act inside the step (trainer.resilience.numerics): a poisoned batch (nan, spike: each time it is trained), one
# wrong gradient value (sdc: once), one flipped bit of one replica group's parameters (bitflip: once).
NUMERIC_FAULTS = ("nan", "spike", "sdc", "bitflip")
# Enacted by the local runner from outside the nodes' network namespaces (local.node_network=netns), not by a rank.
NETWORK_FAULTS = ("partition", "flap", "partition_store")
FAULT_TYPES = LOOP_FAULTS + tuple(SAVE_FAULTS) + tuple(STARTUP_HANGS) + NETWORK_FAULTS + NUMERIC_FAULTS
REPEATABLE = ("exception", "hang", "sigkill", "exit")  # a crash loop: what recurs at the same step

_ITEM = re.compile(r"^(?P<type>[a-z_]+)@(?:(?P<step>\d+)|t=(?P<seconds>\d+(?:\.\d+)?)s?)(?::rank=(?P<rank>\d+))?"
                   r"(?::group=(?P<group>\d+))?(?::rank=(?P<rank_after>\d+))?(?P<permanent>:permanent)?(?P<repeat>:repeat)?"
                   r"(?::node=(?P<node>\d+))?(?::seconds=(?P<down>\d+(?:\.\d+)?))?(?::times=(?P<times>\d+))?$")
NETWORK_GRAMMAR = ("partition@STEP:node=K[:seconds=S], flap@STEP:node=K:times=N (N >= 1) or "
                   "partition_store@STEP:seconds=S")



@dataclass(frozen=True)
class Fault:
    type: str
    step: int | None  # fires after this optimizer step completes
    seconds: float | None  # or once this many seconds of training have passed in the run
    rank: int
    repeat: bool = False  # fires on every attempt that is about to train `step` (a crash loop)
    group: int | None = None  # group_loss: the replica group lost (fired by its first rank)
    permanent: bool = False  # group_loss: no replacement comes (the job goes on with fewer groups)
    node: int | None = None  # partition, flap: the node whose link goes down
    down_seconds: float | None = None  # partition (None: for good), partition_store: how long the link stays down
    times: int | None = None  # flap: how many times the link goes down and up

    @property
    def key(self) -> str:
        when = f"{self.step}" if self.step is not None else f"t={self.seconds}"
        if self.type in NETWORK_FAULTS:
            return (f"{self.type}@{when}" + (f":node={self.node}" if self.node is not None else "")
                    + (f":seconds={self.down_seconds:g}" if self.down_seconds is not None else "")
                    + (f":times={self.times}" if self.times is not None else ""))
        if self.type == "bitflip":
            return f"{self.type}@{when}:group={self.group}:rank={self.rank}"
        if self.group is not None:
            return f"{self.type}@{when}:group={self.group}" + (":permanent" if self.permanent else "")
        return f"{self.type}@{when}:rank={self.rank}" + (":repeat" if self.repeat and self.type != "bug" else "")


def parse_schedule(text: str) -> list[Fault]:
    """The schedule's faults; ValueError naming the bad item."""
    faults = []
    for raw in (item.strip() for item in text.split(",")):
        if not raw:
            continue
        match = _ITEM.match(raw)
        if not match:
            raise ValueError(f"{raw!r} must look like TYPE@STEP, TYPE@t=SECONDS, optionally followed by :rank=R "
                             "(e.g. sigkill@120:rank=1)")
        if match["type"] not in FAULT_TYPES:
            raise ValueError(f"{match['type']!r} in {raw!r} is not one of {list(FAULT_TYPES)}")
        kind, rank = match["type"], int(match["rank"] or match["rank_after"] or 0)
        network = {"node": match["node"], "seconds": match["down"], "times": match["times"]}
        if kind in NETWORK_FAULTS:
            given = {name for name, value in network.items() if value is not None}
            allowed, needed = {"partition": ({"node", "seconds"}, {"node"}), "flap": ({"node", "times"}, {"node", "times"}),
                               "partition_store": ({"seconds"}, {"seconds"})}[kind]
            if (match["seconds"] or match["rank"] or match["group"] or match["permanent"] or match["repeat"]
                    or not needed <= given <= allowed or (match["times"] and int(match["times"]) < 1)):
                raise ValueError(f"{raw!r}: a network drill is {NETWORK_GRAMMAR}")
            faults.append(Fault(kind, int(match["step"]), None, 0, node=int(network["node"]) if network["node"] else None,
                                down_seconds=float(network["seconds"]) if network["seconds"] else None,
                                times=int(network["times"]) if network["times"] else None))
            continue
        if any(value is not None for value in network.values()):
            raise ValueError(f"{raw!r}: only the network drills take :node=, :seconds= and :times= ({NETWORK_GRAMMAR})")
        if kind == "bitflip" and (match["group"] is None or match["seconds"] or match["repeat"] or match["permanent"]):
            raise ValueError(f"{raw!r}: a bit flip is bitflip@STEP:group=G[:rank=R] (one bit of one parameter of rank R "
                             "of replica group G, once)")
        if kind != "bitflip" and ((kind == "group_loss") != (match["group"] is not None)
                                  or (match["permanent"] and kind != "group_loss")):
            raise ValueError(f"{raw!r}: a replica group's loss is group_loss@STEP:group=G[:permanent]; "
                             ":group= is taken only by group_loss and bitflip, :permanent only by group_loss")
        if kind == "group_loss" and (match["rank"] or match["rank_after"] or match["seconds"] or match["repeat"]):
            raise ValueError(f"{raw!r}: group_loss takes group_loss@STEP:group=G[:permanent] (no rank, time or repeat)")
        if kind == "bug" and (match["seconds"] or match["repeat"]):
            raise ValueError(f"{raw!r}: a bug is bug@STEP[:rank=R]: it raises the same exception at the same line on "
                             "every attempt that is about to train step STEP")
        if kind in NUMERIC_FAULTS and kind != "bitflip" and (match["seconds"] or match["repeat"] or match["group"]
                                                             or (kind == "sdc" and not match["rank"])):
            raise ValueError(f"{raw!r}: a numeric drill is nan@STEP[:rank=R], spike@STEP[:rank=R] or sdc@STEP:rank=R "
                             "(it acts on a step's batch or gradient)")
        if kind in SAVE_FAULTS and match["seconds"]:
            raise ValueError(f"{raw!r}: a save drill fires at a step's save, so it takes TYPE@STEP")
        if kind in STARTUP_HANGS and match["seconds"]:
            raise ValueError(f"{raw!r}: a start-up hang fires in the first start after step STEP (0: the first "
                             "start), so it takes TYPE@STEP")
        if kind in SAVE_FAULTS and SAVE_FAULTS[kind] in RANK_0_SAVE_POINTS and rank != 0:
            raise ValueError(f"{raw!r} could never fire: only rank 0 commits checkpoints (its {SAVE_FAULTS[kind]} "
                             "sub-step runs nowhere else); drop ':rank=...'")
        if match["repeat"] and (kind not in REPEATABLE or match["seconds"]):
            raise ValueError(f"{raw!r}: ':repeat' (a crash loop at one step) takes TYPE@STEP with TYPE one of "
                             f"{list(REPEATABLE)}")
        faults.append(Fault(kind, int(match["step"]) if match["step"] else None,
                            float(match["seconds"]) if match["seconds"] else None, rank,
                            bool(match["repeat"]) or kind == "bug",
                            int(match["group"]) if match["group"] is not None else None, bool(match["permanent"])))
    return faults


def unfirable(faults: list[Fault], *, world_size: int, checkpoints: bool, replica_groups: int = 1,
              num_nodes: int = 1) -> str | None:
    """Why a parsed schedule item could never fire in any run of this job, if one could not (the config refuses
    it). A step past training.num_steps is not refused: shortening a run should not mean editing its drills;
    the trainer says which will not fire (FaultInjector)."""
    for fault in faults:
        if fault.node is not None and fault.node >= num_nodes:
            return f"{fault.key} could never fire: node {fault.node} does not exist (training.num_nodes={num_nodes})"
        if fault.group is not None and replica_groups == 1:
            return f"{fault.key} could never fire: the job has one replica group (training.replica_groups=1)"
        if fault.group is not None and fault.group >= replica_groups:
            return (f"{fault.key} could never fire: group {fault.group} does not exist (training.replica_groups="
                    f"{replica_groups})")
        if fault.rank >= world_size:
            return f"{fault.key} could never fire: rank {fault.rank} does not exist (the job has {world_size} ranks)"
        if fault.type in SAVE_FAULTS and not checkpoints:
            return f"{fault.key} could never fire: checkpoint.enabled is false, so no save happens"
    return None


def random_schedule(num_steps: int, mtbf_steps: float, types: list[str], world_size: int, seed: int) -> list[Fault]:
    """Exponential inter-arrival steps (mean mtbf_steps), types and ranks drawn from a seeded RNG."""
    rng = random.Random(seed)
    faults, step = [], 0.0
    while True:
        step += rng.expovariate(1.0 / mtbf_steps)
        if step >= num_steps:
            return faults
        kind, rank = rng.choice(types), rng.randrange(world_size)
        if SAVE_FAULTS.get(kind) in RANK_0_SAVE_POINTS:
            rank = 0  # only rank 0 commits
        faults.append(Fault(kind, max(1, int(step)), None, rank))


def parse_startup_timeouts(text: str, defaults: dict[str, float] = DEFAULT_STARTUP_TIMEOUTS) -> dict[str, float]:
    """'phase=seconds,...' over the defaults; ValueError naming the bad item."""
    timeouts = dict(defaults)
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in STARTUP_PHASES:
            raise ValueError(f"{item!r} must look like PHASE=SECONDS with PHASE one of {list(STARTUP_PHASES)}")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number of seconds") from None
        if not seconds > 0:
            raise ValueError(f"{item!r}: the timeout must be > 0 seconds")
        timeouts[name.strip()] = seconds
    return timeouts
