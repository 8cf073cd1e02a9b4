"""The node-memory tier's folders: whose they are and when they go, without torch (trainer.launcher imports this
before it starts the node's fork server, whose imports then overlap its own). The data in them:
trainer.checkpoint.node_store."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

META = "meta.json"


def owner_name(kind: str, proc: psutil.Process) -> str:
    """A folder name that identifies its owning process for good: pid and start time (pids are reused)."""
    return f"{kind}-{proc.pid}-{int(proc.create_time() * 100)}"


def remove_dead_owners(root: Path) -> list[Path]:
    """Remove the launch-*/process-* folders under root whose owning process is gone; returns them."""
    removed = []
    for folder in [*Path(root).glob("launch-*"), *Path(root).glob("process-*")]:
        kind, _, rest = folder.name.partition("-")
        try:
            alive = owner_name(kind, psutil.Process(int(rest.split("-")[0]))) == folder.name
        except (ValueError, IndexError, psutil.NoSuchProcess, psutil.AccessDenied):
            alive = False
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        log.info("freed the node memory of %d process(es) that are gone: %s", len(removed),
                 ", ".join(f.name for f in removed))
    return removed


def holds_a_copy(folder: str | Path | None) -> bool:
    """Whether a store folder holds any committed copy (own or replica) — a look at the listing, nothing read."""
    return bool(folder) and next(Path(folder).glob(f"node-*/*/slot-*/{META}"), None) is not None
