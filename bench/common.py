"""Set-up shared by the benchmarks."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.demo_data import demo_files  # noqa: E402  (the project's root is on sys.path from here)
from trainer.data import tokenize_files  # noqa: E402


def demo_token_dir(scratch: Path, documents: int = 2000) -> Path:
    """The demo corpus, tokenized into scratch/tokens (the trainer's input)."""
    raw = scratch / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name, body in demo_files(documents).items():
        (raw / name).write_bytes(body)
    tokenize_files(sorted(raw.iterdir()), scratch / "tokens", 0.05)
    return scratch / "tokens"


def write_results(path: Path, figures: dict[str, Any], script: str) -> None:
    """The benchmark's figures as JSON, with the command that produced them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**figures, "command": " ".join(["python", script, *sys.argv[1:]])}, indent=2))
