"""The trained model as a Hugging Face folder, written by the ranks that hold it: no process gathers the model.

    write_hf_export(model, config, tokenizer, folder, dtype=torch.bfloat16)    # collective, every rank of the job

In two passes, as torchtitan's HF checkpointing does with torch DCP's Hugging Face writer:
1. each rank writes its rows of every tensor, cast to the export dtype, into one safetensors file under
   ``<folder>/sharded/`` with DCP's sharding metadata (each tensor's offset in the full one) — the files DCP's
   ``HuggingFaceStorageWriter(save_distributed=True)`` writes. We write them ourselves, a tensor at a time, because
   that writer serialises a whole file in memory (``safetensors.torch.save`` in torch/distributed/checkpoint/
   filesystem.py) after the planner's own copy: 2 x the rank's rows in the export dtype on top of a cast copy of its
   shard (measured: +1.5 x a 101 M model's fp32 shard at one rank). Here a rank holds one tensor's rows at a time.
2. DCP's ``consolidate_safetensors_files_on_every_rank`` has each rank assemble its share of the output files —
   ``model-0000i-of-0000N.safetensors`` of at most ``max_file_bytes`` each, a tensor at a time (its memory: the
   largest tensor) — and rank 0 writes ``model.safetensors.index.json``.
Rank 0 then adds config.json (the family's architecture, LlamaForCausalLM or Qwen3ForCausalLM say, the export's
dtype), generation_config.json and the tokenizer's files, and the sharded files are removed.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._consolidate_hf_safetensors import (consolidate_safetensors_files,
                                                                      consolidate_safetensors_files_on_every_rank)
from torch.distributed.checkpoint._hf_utils import (CUSTOM_METADATA_KEY, DCP_VERSION_KEY, FORMAT_KEY, FORMAT_VALUE,
                                                    HF_DCP_VERSION, SAVED_OFFSETS_KEY)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GenerationConfig, PretrainedConfig

from trainer.data.tokenizer import load_tokenizer
from trainer.model.families import architecture_of, config_from_dict

log = logging.getLogger(__name__)

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
INDEX_FILE = "model.safetensors.index.json"
SHARDED = "sharded"


def file_layout(shapes: dict[str, tuple[tuple[int, ...], int]], max_file_bytes: int) -> dict[str, int]:
    """Each tensor's output file (1-based), in state-dict order, a new file whenever the next tensor would take the
    current one past max_file_bytes (a tensor larger than that gets a file of its own). shapes: name -> (shape,
    bytes per element)."""
    layout, index, used = {}, 1, 0
    for name, (shape, itemsize) in shapes.items():
        size = itemsize
        for length in shape:
            size *= length
        if used and used + size > max_file_bytes:
            index, used = index + 1, 0
        layout[name] = index
        used += size
    return layout


def _rows(model: torch.nn.Module,
          config: PretrainedConfig) -> dict[str, tuple[torch.Tensor, list[int], tuple[int, ...]]]:
    """Each state-dict entry's local rows on this rank (a view: no copy), their offset in the full tensor and the
    full tensor's shape; a tied head is not stored (HF convention: the embedding is the head)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    rows = {}
    for name, tensor in state.items():
        if hasattr(tensor, "to_local"):  # an FSDP2 shard: where its rows sit, as DCP itself computes it
            [chunk] = tensor.__create_chunk_list__()
            rows[name] = (tensor.to_local(), list(chunk.offsets), tuple(tensor.shape))
        else:
            rows[name] = (tensor, [0] * tensor.dim(), tuple(tensor.shape))
    return rows


def _write_rank_file(path: Path, rows: dict[str, tuple[torch.Tensor, list[int], tuple[int, ...]]],
                     dtype: torch.dtype) -> None:
    """This rank's rows as one safetensors file with DCP's sharding metadata, a tensor at a time."""
    kept = {name: (t, offsets) for name, (t, offsets, _) in rows.items() if t.numel()}
    header: dict[str, Any] = {"__metadata__": {
        CUSTOM_METADATA_KEY: json.dumps({name: {SAVED_OFFSETS_KEY: offsets} for name, (_, offsets) in kept.items()}),
        DCP_VERSION_KEY: str(HF_DCP_VERSION), FORMAT_KEY: FORMAT_VALUE}}
    position = 0
    for name, (tensor, _) in kept.items():
        size = tensor.numel() * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(tensor.shape),
                        "data_offsets": [position, position + size]}
        position += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data 8-byte aligned, as safetensors writes it
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for tensor, _ in kept.values():
            cast = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
            handle.write(cast.view(-1).view(torch.uint8).numpy().data)


def write_hf_export(model: torch.nn.Module, config: PretrainedConfig, tokenizer_spec: str, folder: Path, *,
                    dtype: torch.dtype = torch.bfloat16, max_file_bytes: int = 5 * 10**9,
                    threads: int = 2, end_of_turn_ids: list[int] = ()) -> dict[str, Any]:
    """Collective: the HF folder of `model` (FSDP2-sharded, or whole in a single process) at `folder`, written by
    every rank. Returns what was written: files, bytes and seconds (rank 0's view of the whole export).
    end_of_turn_ids: the tokens the chat template ends an assistant turn with (a fine-tuning's data): generation
    stops at them as at EOS, as an instruct model's generation_config.json says."""
    started = time.perf_counter()
    folder = Path(folder)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        (folder / SHARDED).mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    rows = _rows(model, config)
    layout = file_layout({name: (shape, dtype.itemsize) for name, (_, _, shape) in rows.items()}, max_file_bytes)
    _write_rank_file(folder / SHARDED / f"shard-{rank:05d}.safetensors", rows, dtype)
    del rows
    if dist.is_initialized():
        dist.barrier()  # every rank's rows are on disk before any rank assembles a file from them
    if dist.is_initialized():
        consolidate_safetensors_files_on_every_rank(str(folder / SHARDED), str(folder), layout, num_threads=threads)
    else:  # one process (python -m trainer.export): the same files and index, without the ranks' split
        consolidate_safetensors_files(str(folder / SHARDED), str(folder), layout, num_threads=threads)
    if rank == 0:
        shutil.rmtree(folder / SHARDED)
        exported = config.to_dict()
        exported.update(architectures=[architecture_of(config)], dtype=str(dtype).removeprefix("torch."))
        config_from_dict(exported).save_pretrained(str(folder))
        _generation_config(config, end_of_turn_ids).save_pretrained(str(folder))
        load_tokenizer(tokenizer_spec).save(folder)
    if dist.is_initialized():
        dist.barrier()
    files = sorted(p for p in folder.iterdir() if p.is_file())
    figures = {"files": len(files), "weight_files": len(set(layout.values())),
               "bytes": sum(p.stat().st_size for p in files), "seconds": time.perf_counter() - started,
               "dtype": str(dtype).removeprefix("torch.")}
    log.info("HF export at %s: %d files, %.2f GB (%s), %.1f s", folder, figures["files"], figures["bytes"] / 1e9,
             figures["dtype"], figures["seconds"])
    return figures


def _generation_config(config: PretrainedConfig, end_of_turn_ids: list[int] = ()) -> GenerationConfig:
    eos = config.eos_token_id
    stops = [*([] if eos is None else eos if isinstance(eos, list) else [eos]),
             *(i for i in end_of_turn_ids if i != eos)]
    return GenerationConfig(bos_token_id=config.bos_token_id,
                            eos_token_id=stops[0] if len(stops) == 1 else (stops or None),
                            pad_token_id=getattr(config, "pad_token_id", None))
