"""Export a checkpoint to Hugging Face format: config.json + model.safetensors + tokenizer files.

    python -m trainer.export <checkpoint folder> <output folder>

The shards are gathered into one process (DCP reshards on load), so any world size exports. The result
loads with ``LlamaForCausalLM.from_pretrained(folder)`` and ``AutoTokenizer.from_pretrained(folder)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

from trainer.checkpoint.format import CheckpointError, verify_checkpoint
from trainer.checkpoint.load import load_model_from_checkpoint
from trainer.data.tokenizer import load_tokenizer
from trainer.observe import logs

log = logging.getLogger(__name__)

EXPORT_INFO = "resilient_train_export.json"


def export_hf(checkpoint: Path, out_dir: Path, *, overwrite: bool = False) -> Path:
    """Write the HF folder next to out_dir, then rename it into place (never a half-written export)."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists: choose another folder, or replace it with --overwrite "
                              "(overwrite=True from Python)")
    verified = verify_checkpoint(checkpoint)
    if not verified.ok:
        raise CheckpointError("; ".join(verified.problems))
    model, manifest = load_model_from_checkpoint(checkpoint, verified)
    staging = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging), safe_serialization=True)
    load_tokenizer(manifest.get("tokenizer", "byte")).save(staging)
    (staging / EXPORT_INFO).write_text(json.dumps(
        {"checkpoint": str(checkpoint), "step": manifest["step"], "run_id": manifest.get("run_id"),
         "config_hash": manifest.get("config_hash")}, indent=2))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    log.info("exported %s (step %d) to %s", checkpoint, manifest["step"], out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    logs.configure()
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a committed step-N checkpoint folder")
    parser.add_argument("output", type=Path, help="folder to create")
    parser.add_argument("--overwrite", action="store_true", help="replace the output folder if it exists")
    args = parser.parse_args(argv)
    try:
        export_hf(args.checkpoint, args.output, overwrite=args.overwrite)
    except (CheckpointError, FileExistsError) as err:
        log.error("%s", err)
        return 1
    print(args.output)
    return 0
