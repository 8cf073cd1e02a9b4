"""The trained model as a Hugging Face folder, written by the ranks that hold it: no process gathers the model.

    write_hf_export(model, config, tokenizer, folder, dtype=torch.bfloat16)    # collective, every rank of the job

torch DCP's Hugging Face writer does it, as torchtitan's HF checkpointing does: each rank writes its rows of every
tensor (cast to the export dtype) into safetensors files under ``<folder>/sharded/``
(``HuggingFaceStorageWriter(save_distributed=True)``), then ``consolidate_safetensors_files_on_every_rank`` has
each rank assemble its share of the output files — ``model-0000i-of-0000N.safetensors`` of at most
``max_file_bytes`` each, a tensor at a time (its memory: the largest tensor) — and rank 0 writes
``model.safetensors.index.json``. Rank 0 then adds config.json (architecture LlamaForCausalLM, the export's dtype),
generation_config.json and the tokenizer's files, and the sharded files are removed.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._consolidate_hf_safetensors import (consolidate_safetensors_files,
                                                                      consolidate_safetensors_files_on_every_rank)
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GenerationConfig, LlamaConfig

from trainer.data.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
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


def _exported_state(model: torch.nn.Module, config: LlamaConfig, dtype: torch.dtype) -> dict[str, Any]:
    """Each rank's shards (DTensors) of the model's state dict in the export dtype; a tied head is not stored (HF
    convention: the embedding is the head)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {name: tensor.detach().to(dtype) for name, tensor in state.items()}


def write_hf_export(model: torch.nn.Module, config: LlamaConfig, tokenizer_spec: str, folder: Path, *,
                    dtype: torch.dtype = torch.bfloat16, max_file_bytes: int = 5 * 10**9,
                    threads: int = 2) -> dict[str, Any]:
    """Collective: the HF folder of `model` (FSDP2-sharded, or whole in a single process) at `folder`, written by
    every rank. Returns what was written: files, bytes and seconds (rank 0's view of the whole export)."""
    started = time.perf_counter()
    folder = Path(folder)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        (folder / SHARDED).mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    state = _exported_state(model, config, dtype)
    layout = file_layout({name: (tuple(t.shape), t.element_size()) for name, t in state.items()}, max_file_bytes)
    writer = HuggingFaceStorageWriter(str(folder / SHARDED), fqn_to_index_mapping=layout, save_distributed=True,
                                      thread_count=threads)
    dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
    del state
    if dist.is_initialized():
        consolidate_safetensors_files_on_every_rank(str(folder / SHARDED), str(folder), layout, num_threads=threads)
    else:  # one process (python -m trainer.export): the same files and index, without the ranks' split
        consolidate_safetensors_files(str(folder / SHARDED), str(folder), layout, num_threads=threads)
    if rank == 0:
        shutil.rmtree(folder / SHARDED)
        exported = config.to_dict()
        exported.update(architectures=["LlamaForCausalLM"], dtype=str(dtype).removeprefix("torch."))
        LlamaConfig.from_dict(exported).save_pretrained(str(folder))
        _generation_config(config).save_pretrained(str(folder))
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


def _generation_config(config: LlamaConfig) -> GenerationConfig:
    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                            pad_token_id=getattr(config, "pad_token_id", None))
