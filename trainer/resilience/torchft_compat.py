"""What this project needs of torchft beyond its public interface, in one place (as nvrx_compat is for NVRx).

Checked against torchft 0.2.0: the Manager keeps each quorum (its members, the heal's donor) to itself, so its
client is wrapped to see them (QuorumSpy); torchft logs each quorum and commit at INFO (quiet_torchft); replica
ids are "<ours>:<uuid>" (group_of_replica_id).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

import torch


def group_of_replica_id(replica_id: str) -> int:
    """torchft's replica id is "<ours>:<uuid>", ours being group_<g>."""
    match = re.match(r"group_(\d+)", replica_id)
    assert match, replica_id
    return int(match.group(1))


def quiet_torchft() -> None:
    """torchft logs every quorum and commit at INFO: the run's log keeps its warnings and errors (our own records
    say what changed); the flight recorder's reset is NCCL's only, and gloo's absence of it is no news."""
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("torchft.manager").addFilter(lambda record: "flight recorder" not in record.getMessage())


class QuorumSpy:
    """torchft's ManagerClient, telling us each quorum it returns (the Manager keeps the donor and the members
    to itself)."""

    def __init__(self, client: Any, saw: Callable[[Any], None]):
        self._client, self._saw = client, saw

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self._saw(quorum)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0
