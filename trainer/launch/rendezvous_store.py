"""The job's rendezvous store, outside every training node, so that the rendezvous survives the loss of any
node, node 0 included (with the store in node 0's launcher, losing node 0 would end every node's rendezvous).

    python -m trainer.rendezvous_store --port 29400 --nodes 8

The launchers' c10d rendezvous points at it with ``is_host=false`` (trainer.launch.command). It serves until every
node reported that it finished training (trainer.launcher adds one to ``FINISHED_KEY``), or until SIGTERM; it
holds no training state, so when it is itself restarted the nodes' next rendezvous starts afresh. Locally the
train step runs it as a process of its own; on EKS it is the runtime's ``rendezvous`` replicated job.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

from trainer.env import RENDEZVOUS_NODES_ENV

FINISHED_KEY = "resilient_train/nodes_finished"
READY_LINE = "rendezvous store listening on port"


def connect(host: str, port: int, timeout_seconds: float = 60.0):
    import torch.distributed as dist  # torch's import (seconds) only when a store is used, not for --help

    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_seconds))


def report_finished(endpoint: str) -> None:
    """This node finished training: one more towards the store's exit (best effort: the store may be gone)."""
    host, _, port = endpoint.rpartition(":")
    try:
        connect(host, int(port), timeout_seconds=10).add(FINISHED_KEY, 1)
    except (RuntimeError, ValueError) as err:
        print(f"trainer.launcher: could not tell the rendezvous store at {endpoint} that this node finished: {err}",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.rendezvous_store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=29400, help="port to listen on (0: any free port, printed)")
    parser.add_argument("--nodes", type=int, default=int(os.environ.get(RENDEZVOUS_NODES_ENV, 0)),
                        help=f"nodes that report finishing before it exits (default: ${RENDEZVOUS_NODES_ENV})")
    parser.add_argument("--die-with-parent", action="store_true",
                        help="exit when the process that started it is gone (the local train step's runner)")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes (or ${RENDEZVOUS_NODES_ENV}) must be a node count >= 1")
    if args.die_with_parent:  # a killed runner must not leave a store behind (seen: one outlived its run)
        from trainer.launch.parent_watch import watch_parent  # noqa: PLC0415 - only for a local store

        watch_parent()
    import torch.distributed as dist  # after the arguments: a usage error answers at once

    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"{READY_LINE} {store.port}", flush=True)
    while store.add(FINISHED_KEY, 0) < args.nodes:
        time.sleep(1.0)
    print(f"all {args.nodes} nodes finished: rendezvous store exits", flush=True)
    return 0
