"""What each save cost the training loop, as the interval planner (trainer.planning.auto) and the
``checkpoint_stall`` records (the worst rank's, trainer.checkpoint.commit) count it.

Everything the loop waited for in the checkpoint manager since the last FSx save began (node-memory copies,
polls that finished a write or waited for a commit) is charged to the next save's stall, with the wait for
the previous save, the barrier and the hand-off (sync: the whole write).
"""

from __future__ import annotations

from typing import Any


class SaveCosts:
    def __init__(self) -> None:
        self.saves_started = 0  # FSx saves started by this process
        self.by_step: dict[int, dict[str, float]] = {}  # step -> stall (less the previous save), background, commit
        self._loop_wait_since_save = 0.0
        self._memory_seconds_since_save = 0.0
        self._memory_copies_since_save = 0
        self.memory_copy_seconds: list[float] = []  # the loop's wait for each node-memory copy of this launch

    def memory_copy(self, seconds: float) -> None:
        if len(self.memory_copy_seconds) < 64:  # the planner's probe reads the first few
            self.memory_copy_seconds.append(seconds)
        self._memory_seconds_since_save += seconds
        self._memory_copies_since_save += 1

    def loop_waited(self, seconds: float) -> None:
        """A step's time in the manager that started no FSx save."""
        self._loop_wait_since_save += seconds

    def fsx_save_started(self, step: int, loop_wait: float, previous_save_seconds: float) -> dict[str, Any]:
        """This save's stall (`loop_wait`: the step's time in the manager, up to the hand-off); the fields of
        its checkpoint_stall event."""
        loop_wait += self._loop_wait_since_save
        fields = {"loop_wait_seconds": loop_wait, "previous_save_seconds": previous_save_seconds,
                  "memory_seconds": self._memory_seconds_since_save, "memory_copies": self._memory_copies_since_save}
        # The FSx tier's own cost: less the node-memory copies and any wait for the previous save to end.
        self.by_step.setdefault(step, {})["stall"] = loop_wait - previous_save_seconds - self._memory_seconds_since_save
        self._loop_wait_since_save = self._memory_seconds_since_save = 0.0
        self._memory_copies_since_save = 0
        self.saves_started += 1
        return fields

    def written(self, step: int, background_seconds: float) -> None:
        self.by_step.setdefault(step, {})["background"] = background_seconds

    def committed(self, step: int, commit_seconds: float) -> None:
        self.by_step.setdefault(step, {})["commit"] = commit_seconds

    def longest_write_seconds(self) -> float | None:
        """The longest a save of this process took from its hand-off to its commit (None: none finished)."""
        writes = [c["background"] + c.get("commit", 0.0) for c in self.by_step.values() if "background" in c]
        return max(writes, default=None)
