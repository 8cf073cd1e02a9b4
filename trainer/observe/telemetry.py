"""The trainer's optional Prometheus endpoint (``training.prometheus_port``; 0 = off).

Each training process serves ``/metrics`` on ``prometheus_port + LOCAL_RANK``: step, loss, tokens/s,
the loop's checkpoint stall, recoveries by mechanism and the straggler scores — what the EKS dashboards (PodMonitor) scrape.
The server and the metric objects are per process, so an in-process restart keeps serving the same
series instead of failing to bind the port again.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prometheus_client import Counter, Gauge, start_http_server

log = logging.getLogger(__name__)

_metrics: dict[str, Any] = {}
_served_port: int | None = None


def _registry() -> dict[str, Any]:
    if not _metrics:
        labels = ["run_id", "rank"]
        _metrics.update(
            step=Gauge("resilient_train_step", "Optimizer steps completed", labels),
            loss=Gauge("resilient_train_loss", "Training loss of the last step", labels),
            tokens=Gauge("resilient_train_tokens_per_second", "Tokens per second of the last step (all ranks)", labels),
            step_seconds=Gauge("resilient_train_step_seconds", "Wall seconds of the last step", labels),
            stall=Gauge("resilient_train_checkpoint_stall_seconds", "Seconds the loop was blocked by the last save",
                        labels),
            recoveries=Counter("resilient_train_recoveries", "Recoveries from faults, by mechanism",
                               [*labels, "mechanism"]),
            straggler_score=Gauge("resilient_train_straggler_score", "This rank's relative straggler score per "
                                  "section in the last report (1: as fast as the fastest rank)", [*labels, "section"]),
            straggler=Gauge("resilient_train_straggler", "1 if the last straggler report named this rank", labels),
        )
    return _metrics


class Telemetry:
    """No-op unless a port is configured; the training loop calls observe_step once per step."""

    def __init__(self, port: int, run_id: str, rank: int):
        self.enabled = port > 0
        self.labels = {"run_id": run_id, "rank": str(rank)}
        if not self.enabled:
            return
        global _served_port
        serve_on = port + int(os.environ.get("LOCAL_RANK", "0"))
        if _served_port is None:
            start_http_server(serve_on)
            _served_port = serve_on
            log.info("Prometheus metrics on :%d/metrics", serve_on)
        self.metrics = _registry()

    def observe_step(self, metrics: dict[str, float], checkpoint_stall: float | None) -> None:
        if not self.enabled:
            return
        m = self.metrics
        m["step"].labels(**self.labels).set(metrics["step"])
        m["loss"].labels(**self.labels).set(metrics["loss"])
        m["tokens"].labels(**self.labels).set(metrics["tokens_per_second"])
        m["step_seconds"].labels(**self.labels).set(metrics["step_seconds"])
        if checkpoint_stall is not None:
            m["stall"].labels(**self.labels).set(checkpoint_stall)

    def observe_recovery(self, mechanism: str) -> None:
        if self.enabled:
            self.metrics["recoveries"].labels(**self.labels, mechanism=mechanism).inc()

    def observe_straggler(self, scores: dict[str, float], is_straggler: bool) -> None:
        if self.enabled:
            for section, score in scores.items():
                self.metrics["straggler_score"].labels(**self.labels, section=section).set(score)
            self.metrics["straggler"].labels(**self.labels).set(int(is_straggler))
