"""Resilience inside a training process: the per-step hooks and recovery records (hooks.py), the restart
budget (budget.py), fault injection (faults.py; the schedule's grammar is trainer.config.drills), why a restart
happened (failures.py), the start-up watchdog (phases.py), stragglers (straggler.py), GPU and EFA health
(health.py), NVRx in-process restart (in_process.py), a worker taking its node down (node_exit.py), when a
worker started (worker_clock.py), and the one place that knows how NVRx versions differ (nvrx_compat.py)."""
