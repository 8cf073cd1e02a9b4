"""What the job reports outside the run folder: the log format (logs.py), Prometheus /metrics
(telemetry.py), each node's system metrics (system_metrics.py), the TrainJob's progress (progress.py)."""
