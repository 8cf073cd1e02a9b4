"""Start-up phases of a training process, each with a timeout: no silent hang before the first step.

    watchdog = PhaseWatchdog(timeouts, on_hang=...)   # a thread; one per process
    with watchdog.phase("model_build"):
        build()                                        # hangs past its timeout: on_hang(phase, seconds), exit

Phases, in order: ``rendezvous`` (joining the job's store and the peers: init_process_group), ``process_group``
(the first collectives; NCCL builds its communicators here), ``model_build`` (model, shards, optimizer, data),
``restore`` (choosing the copy to resume from: listings, the ranks' agreement) with, inside it as phases of
their own, the tiers it reads — ``restore_memory`` (node memory and the peer replica), ``restore_s3`` (an S3
copy back onto FSx), ``restore_fsx`` (reading the FSx checkpoint), ``restore_base`` (a first start's read of the
base model, model.init_from: each rank its shard) —, and ``first_step`` (to its end). The reads' timeouts grow
with the model (``startup_timeouts``).

Without it a hang there is seen late or never: ft_launcher's rank monitor starts its initial-heartbeat clock
only when the worker connects (NVRx 0.4.1 and >= 0.6 alike), and then says only "no heartbeat". With it the
hung rank records the phase (a ``hang`` event) and exits with HANG_EXIT_CODE at once, which the launcher
restarts like any crash.

The ``hang_in_<phase>`` drills (``hang_in_restore`` for any restore tier) make a rank hang in that phase of
the first start-up after step STEP was trained (0: the first start), once per run.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from trainer.config.drills import DEFAULT_STARTUP_TIMEOUTS, parse_startup_timeouts
from trainer.env import HANG_EXIT_CODE
from trainer.planning.model_size import model_shape, throughput_seconds

log = logging.getLogger(__name__)

SAFETY_FACTOR = 1.5  # over what a read of the model's size takes at the file system's throughput
_phase = ["start"]  # the process's phase: the last start-up phase entered, "train" once start-up is over


def current_phase() -> str:
    """Where this process is: a start-up phase, or "train" (a failure's record names it)."""
    return _phase[0]


class PhaseWatchdog:
    """A thread that watches the phase the process is in; past the phase's timeout it calls on_hang(phase,
    seconds, timeout), which records the hang and ends the process (it does not return)."""

    def __init__(self, timeouts: dict[str, float], on_hang: Callable[[str, float, float], None],
                 hang_in: Callable[[str], bool] = lambda phase: False, poll_seconds: float = 0.5):
        """hang_in(phase): whether a drill makes this rank hang in the phase (it then sleeps there)."""
        self.timeouts = timeouts
        self._on_hang = on_hang
        self._hang_in = hang_in
        self._poll = poll_seconds
        self._current: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="startup-watchdog", daemon=True)
        self._thread.start()

    @property
    def current_phase(self) -> str | None:
        current = self._current
        return current[0] if current else None

    def enter(self, phase: str) -> None:
        assert phase in self.timeouts, phase
        self._current = (phase, time.monotonic())
        _phase[0] = phase
        if self._hang_in(phase):
            log.warning("drill: hanging in start-up phase %s", phase)
            while True:  # a real hang: no progress, no exception (the watchdog ends it)
                time.sleep(0.1)

    def leave(self) -> None:
        self._current = None

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """A phase inside another (a restore tier inside restore): the outer one goes on afterwards, its clock
        started again (the inner phase's time is the inner phase's)."""
        outer = self.current_phase
        self.enter(phase)
        try:
            yield
        finally:
            if outer is None:
                self.leave()
            else:
                self._current = (outer, time.monotonic())
                _phase[0] = outer

    def close(self) -> None:
        self._stop.set()
        self._current = None
        _phase[0] = "train"

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            current = self._current
            if current is None:
                continue
            phase, started = current
            elapsed = time.monotonic() - started
            if elapsed > self.timeouts[phase] and self._current is current:
                self._on_hang(phase, elapsed, self.timeouts[phase])
                return


def exit_hung(events, rank: int, phase: str, elapsed: float, timeout: float, step: int | None) -> None:
    """The on_hang of a training process: a `hang` event (the phase, this rank), then exit at once."""
    log.error("rank %d hung in start-up phase %s: no progress for %.0f s (timeout %.0f s: "
              "resilience.startup_timeouts); exiting so the launcher restarts now", rank, phase, elapsed, timeout)
    try:
        events.write("hang", phase=phase, seconds=elapsed, timeout_seconds=timeout, step=step, pid=os.getpid())
    finally:
        logging.shutdown()
        os._exit(HANG_EXIT_CODE)


def startup_timeouts(cfg, data_dir) -> dict[str, float]:
    """Each phase's timeout: resilience.startup_timeouts over the defaults, where a read's default is raised to
    SAFETY_FACTOR x what it takes at kubernetes.fsx_throughput_mbps for this model (trainer.planning.model_size):
    restore_fsx reads the training state (fp32 weights and AdamW's moments), restore_base the base model's
    weights, once for the job (a rank its shard)."""
    shape = model_shape(cfg, data_dir)
    throughput = cfg.kubernetes.fsx_throughput_mbps
    derived = dict(DEFAULT_STARTUP_TIMEOUTS)
    for phase, nbytes in (("restore_fsx", shape.state_bytes), ("restore_base", 1.1 * shape.weights_bytes)):
        derived[phase] = max(derived[phase], round(SAFETY_FACTOR * throughput_seconds(nbytes, throughput)))
    return parse_startup_timeouts(cfg.resilience.startup_timeouts, derived)
