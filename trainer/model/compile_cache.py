"""Compiled blocks that survive a restart: inductor's on-disk caches in the run folder (training.compile_cache).

torch.compile keeps what it compiled in TORCHINDUCTOR_CACHE_DIR: the FX-graph cache (inductor's generated code),
the AOTAutograd cache (the forward and backward graphs) and Triton's kernels, each entry keyed by the graph and
the torch, Triton and device versions (torch/_inductor/codecache.py, torch/_functorch/_aot_autograd/autograd_cache.py),
and writes each entry by a rename, so processes on many nodes share one folder. Its default is this machine's /tmp:
a replacement node (a new pod) starts with none of it and compiles again. Here it is a folder on FSx, one per torch
version, device and model config, so a stale folder is never read by a changed model or torch (its entries would
miss anyway; keeping them apart lets a folder be deleted whole).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from trainer.run.digest import hasher
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
RUN_FOLDER = "compile-cache"


def cache_key(model_config: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """What the folder is keyed by: the torch and CUDA versions, the device's kind, the model's config."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"torch": torch.__version__, "cuda": torch.version.cuda or "", "device": name, "model": model_config}


def use_compile_cache(setting: str, run_dir: Path, model_config: dict[str, Any], device: torch.device) -> Path | None:
    """Point inductor's caches at the folder for this key (before anything compiles); None when `setting` is off."""
    if setting == "off":
        return None
    root = Path(run_dir) / RUN_FOLDER if setting == "run" else Path(setting)
    key = cache_key(model_config, device)
    digest = hasher("xxh3_128")
    digest.update(json.dumps(key, sort_keys=True, default=str).encode())
    folder = root / digest.hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "key.json").is_file():  # what the folder is for, to a person clearing caches
        write_json(folder / "key.json", key)
    os.environ[CACHE_DIR_ENV] = str(folder)
    log.info("compile cache: %s", folder)
    return folder


def cache_counts() -> dict[str, int]:
    """This process's cache hits and misses so far (inductor's FX graphs, AOTAutograd's graphs)."""
    from torch._dynamo.utils import counters  # dynamo's counters: imported with torch.compile's first use

    return {"fx_graph_hits": counters["inductor"]["fxgraph_cache_hit"],
            "fx_graph_misses": counters["inductor"]["fxgraph_cache_miss"],
            "aot_autograd_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_autograd_misses": counters["aot_autograd"]["autograd_cache_miss"]}
