"""Set-up shared by the benchmarks."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.demo_data import demo_files  # noqa: E402  (the project's root is on sys.path from here)
from trainer.data.shards import tokenize_files  # noqa: E402


def demo_token_dir(scratch: Path, documents: int = 2000) -> Path:
    """The demo corpus, tokenized into scratch/tokens (the trainer's input)."""
    raw = scratch / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name, body in demo_files(documents).items():
        (raw / name).write_bytes(body)
    tokenize_files(sorted(raw.iterdir()), scratch / "tokens", 0.05)
    return scratch / "tokens"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    memory = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), 0) if Path("/proc/meminfo").exists() else 0
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "kernel": platform.release()}


def write_results(path: Path, figures: dict[str, Any], script: str) -> None:
    """The benchmark's figures as JSON, with the command that produced them, when and on what."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**figures, "command": " ".join(["python", script, *sys.argv[1:]]),
                                "measured_at": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine()}, indent=2))
