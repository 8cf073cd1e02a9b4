"""torchft's Lighthouse: the one process every replica group's manager asks for each step's quorum.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 5000 --heartbeat_timeout_ms 2000 --bind 0.0.0.0:29510

It runs beside the groups, never inside one, so it outlives any group's loss: locally a process of the runner
(localcluster/nodes.py starts it again if it dies), on EKS a replicated job of its own with a Service
(manifests/base/runtime). It holds no training state: a restarted lighthouse forms the next quorum from the
groups' heartbeats, and the managers retry their quorum request meanwhile (resilience.lighthouse_retries).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from trainer.config import Config

LIGHTHOUSE_PORT = 29510  # torchft's default
LIGHTHOUSE_JOB = "lighthouse"


def lighthouse_binary() -> str:
    """The torchft wheel's console script, beside this interpreter (a venv) or on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.is_file() else shutil.which("torchft_lighthouse")
    if found is None:
        raise FileNotFoundError("torchft_lighthouse is not installed (pip install torchft): training.replica_groups "
                                ">= 2 needs torchft's lighthouse")
    return found


def lighthouse_command(cfg: Config, bind: str, binary: str | None = None) -> list[str]:
    """The lighthouse's command line: any one group makes a quorum (the groups left train on while one restarts;
    resilience.min_replica_groups is the runner's rule for a group that cannot come back); a group silent for
    lighthouse_heartbeat_timeout_seconds is dead; stragglers are waited for lighthouse_join_timeout_seconds."""
    r = cfg.resilience
    return [binary or lighthouse_binary(), "--min_replicas", "1",
            "--join_timeout_ms", str(int(r.lighthouse_join_timeout_seconds * 1000)),
            "--heartbeat_timeout_ms", str(int(r.lighthouse_heartbeat_timeout_seconds * 1000)),
            "--bind", bind]


def lighthouse_address_of(job_name: str) -> str:
    """The TrainJob's lighthouse pod, as JobSet names and serves it (see rendezvous_endpoint_of)."""
    return f"http://{job_name}-{LIGHTHOUSE_JOB}-0-0.{job_name}:{LIGHTHOUSE_PORT}"


LIGHTHOUSE_ARGS_ENV = "RESILIENT_TRAIN_LIGHTHOUSE_ARGS"  # the TrainJob's patch of the lighthouse container


def main(argv: list[str] | None = None) -> int:
    """The runtime's `lighthouse` pod: torchft's lighthouse with the arguments the TrainJob put in its
    environment (lighthouse_command's, JSON), or done at once when the job has one replica group."""
    raw = os.environ.get(LIGHTHOUSE_ARGS_ENV, "")
    if not raw:
        print("trainer.lighthouse: this job has one replica group (no lighthouse arguments): nothing to serve",
              flush=True)
        return 0
    args = json.loads(raw)
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        print(f"trainer.lighthouse: {LIGHTHOUSE_ARGS_ENV} must be a JSON list of strings, got {raw!r}", file=sys.stderr)
        return 2
    binary = lighthouse_binary()
    os.execv(binary, [binary, *args])
    return 1  # not reached
