"""Resilience inside a training process: the per-step hooks and recovery records (hooks.py), fault
injection (faults.py), GPU and EFA health (health.py), NVRx in-process restart (in_process.py), and the one
place that knows how NVRx versions differ (nvrx_compat.py)."""
