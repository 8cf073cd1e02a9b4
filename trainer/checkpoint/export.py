"""Export a checkpoint to Hugging Face format by hand: config.json, sharded safetensors with
model.safetensors.index.json, the tokenizer's files.

    python -m trainer.export <checkpoint folder> <output folder> [--dtype bfloat16] [--max-file-gb 5]

The pipeline needs none of this: the training's ranks export the final checkpoint themselves, each writing its rows
(trainer.evaluate.evaluator, trainer.checkpoint.hf_export). This tool is for a checkpoint after the fact: it loads
the checkpoint into this one process (DCP reshards on load, so any world size exports) and writes it the same way.
The result loads with ``AutoModelForCausalLM.from_pretrained(folder)`` and ``AutoTokenizer.from_pretrained(folder)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

from trainer.checkpoint.format import CheckpointError, verify_checkpoint
from trainer.checkpoint.hf_export import EXPORT_DTYPES, write_hf_export
from trainer.checkpoint.load import load_model_from_checkpoint
from trainer.observe import logs

log = logging.getLogger(__name__)

EXPORT_INFO = "resilient_train_export.json"


def export_hf(checkpoint: Path, out_dir: Path, *, overwrite: bool = False, dtype: str = "bfloat16",
              max_file_gb: float = 5.0) -> Path:
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
    write_hf_export(model, model.config, manifest.get("tokenizer", "byte"), staging, dtype=EXPORT_DTYPES[dtype],
                    max_file_bytes=int(max_file_gb * 1e9))
    (staging / EXPORT_INFO).write_text(json.dumps(
        {"checkpoint": str(checkpoint), "step": manifest["step"], "run_id": manifest.get("run_id"),
         "config_hash": manifest.get("config_hash"), "dtype": dtype}, indent=2))
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
    parser.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="bfloat16", help="the weights' dtype")
    parser.add_argument("--max-file-gb", type=float, default=5.0, help="largest safetensors file, in GB")
    args = parser.parse_args(argv)
    try:
        export_hf(args.checkpoint, args.output, overwrite=args.overwrite, dtype=args.dtype,
                  max_file_gb=args.max_file_gb)
    except (CheckpointError, FileExistsError) as err:
        log.error("%s", err)
        return 1
    print(args.output)
    return 0
