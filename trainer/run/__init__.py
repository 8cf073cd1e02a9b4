"""The run folder, the contract every layer reads: its file names (run_dir.py), the events each rank appends
(events.py), the lease that fences a superseded launch (lease.py), and the one tail reader (tail.py).
Nothing here imports torch."""
