"""This process's resident memory, for what a phase of it costs: the current RSS and the peak since a reset.

Linux keeps a process's peak resident set as VmHWM (/proc/self/status); writing 5 to /proc/self/clear_refs resets
it to the current RSS (proc(5)), so a phase's own peak can be read without a fresh process."""

from __future__ import annotations

from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> int:
    """Reset the peak to now; the current RSS in bytes (0 where /proc is not Linux's)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak is then the process's whole life's, an upper bound
    return _status("VmRSS")


def peak_rss() -> int:
    """The peak resident set in bytes since the last reset (or the process's start)."""
    return _status("VmHWM")
