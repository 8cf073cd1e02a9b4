"""A deliverer for one run's MLflow spool in a long-lived process: the process that drives a local pipeline.

Every step of a pipeline is a process of its own, and a step that delivers its own MLflow records first pays
for importing MLflow's client and opening its store (2.3 s per step here, bench/pipeline_steps.py), six times
a run. While a ``SpoolDeliverer`` holds the spool's deliverer lock, the steps only journal their records
(components.tracking) and this process, which imported MLflow once, delivers them within ``interval``
seconds, in journal order, with the same idempotent delivery; a step that needs an answer from MLflow (a run
id, the pending count) waits for it. The lock is an flock: if this process dies, the steps find it free and
deliver for themselves again, so nothing depends on the deliverer being there. A cluster run has no such
process and its steps deliver as before.
"""

from __future__ import annotations

import fcntl
import logging
import threading

from components.tracking import DELIVERER_LOCK, DELIVERER_UNREACHABLE, Tracker

log = logging.getLogger(__name__)


class SpoolDeliverer:
    """Deliver `tracker`'s spool on a thread of this process while the context is open."""

    def __init__(self, tracker: Tracker, interval: float = 0.1):
        self.tracker = tracker
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_file = None

    def __enter__(self) -> SpoolDeliverer:
        self.tracker.spool.mkdir(parents=True, exist_ok=True)
        self._lock_file = (self.tracker.spool / DELIVERER_LOCK).open("a")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another deliverer (a second driver of the same run) has it: leave it to that one
            self._lock_file.close()
            self._lock_file = None
            return self
        self._thread = threading.Thread(target=self._deliver, name="mlflow-deliverer", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        try:
            self.tracker.flush()  # what the last step journaled after the last round
        finally:
            (self.tracker.spool / DELIVERER_UNREACHABLE).unlink(missing_ok=True)
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def _deliver(self) -> None:
        unreachable = self.tracker.spool / DELIVERER_UNREACHABLE
        try:
            self.tracker.connect()  # MLflow's import and its store, while the first steps start
        except Exception as err:  # noqa: BLE001 - an outage is flush's business below; this only warms up
            log.debug("MLflow not reachable yet: %s", err)
        try:
            while True:
                if self.tracker.flush():
                    unreachable.unlink(missing_ok=True)
                else:  # the steps stop waiting for us and find the server unreachable themselves
                    unreachable.touch()
                if self._stop.wait(self.interval):
                    return
        except Exception:
            # Not an outage (flush keeps those): hand delivery back to the steps rather than have them wait.
            log.exception("the MLflow deliverer of %s stopped; the steps deliver their own records", self.tracker.spool)
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
