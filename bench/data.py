"""Tokenization benchmark: throughput per core and peak memory of trainer/data/shards.py::tokenize_files, side by side.

    .venv/bin/python bench/data.py                    # 40 MB and 160 MB JSONL corpora, byte and BPE, ~5 min
    .venv/bin/python bench/data.py --megabytes 8      # a quick check of the harness

Each measurement runs in a fresh process (so its peak RSS is its own: `ru_maxrss`, and the largest sum over
the process and its worker pool, sampled every 50 ms) on the same corpus files, in one invocation:
- previous: the implementation before streaming (commit 697ccd4: every document in memory, the HF byte
  tokenizer), as the baseline;
- byte: the streaming tokenizer with 1 worker and with one per core;
- bpe: a BPE tokenizer.json (trained here with the tokenizers library, 8,192 tokens) through tokenize_files,
  against the library's own `encode_batch` over the same documents already in memory (its batch throughput:
  the goal for ours).
MB/s counts the corpus's bytes on disk; per core divides by the workers used (the library's batch uses every
core). Peak RSS at 1 × and 4 × the corpus shows whether memory depends on the corpus size.
Writes bench/results/data.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, write_results  # noqa: E402  (bench/ is the script's folder)

from pipelines.demo_data import generate_documents  # noqa: E402
from trainer.observe import logs  # noqa: E402

log = logging.getLogger("bench.data")


def write_corpus(folder: Path, megabytes: float, files: int = 4) -> list[Path]:
    """JSONL files of demo documents (distinct seeds, so no two documents repeat), `megabytes` in all."""
    folder.mkdir(parents=True, exist_ok=True)
    target = megabytes * 1e6 / files
    paths = []
    for index in range(files):
        path = folder / f"part-{index:03d}.jsonl"
        written, seed = 0, index * 1_000_000
        with path.open("w", encoding="utf-8") as handle:
            while written < target:
                lines = "".join(json.dumps({"text": text}) + "\n" for text in generate_documents(2000, seed=seed))
                handle.write(lines)
                written += len(lines.encode())
                seed += 1
        paths.append(path)
    return paths


def _previous(files: list[Path], out: Path, val_fraction: float, tokenizer: str) -> None:
    """trainer/data/shards.py::tokenize_files as of commit 697ccd4 (the tokenizing part): every document held."""
    import numpy as np

    from trainer.data.documents import read_documents
    from trainer.data.shards import is_held_out
    from trainer.data.tokenizer import load_tokenizer

    loaded = load_tokenizer(tokenizer)
    texts = {"train": [], "val": []}
    for document in read_documents(files):
        texts["val" if is_held_out(document, val_fraction) else "train"].append(document)
    out.mkdir(parents=True, exist_ok=True)
    for split, docs in texts.items():
        with (out / f"{split}.bin").open("wb") as handle:
            for start in range(0, len(docs), 4096):
                for ids in loaded.encode_documents(docs[start:start + 4096]):
                    np.asarray(ids, dtype=np.uint16).tofile(handle)


def _library_batch(files: list[Path], tokenizer: str) -> float:
    """Seconds for the tokenizers library's encode_batch over every document, already in memory."""
    from trainer.data.documents import read_documents
    from trainer.data.tokenizer import load_tokenizer

    documents = list(read_documents(files))
    loaded = load_tokenizer(tokenizer)
    started = time.perf_counter()
    for start in range(0, len(documents), 4096):
        loaded.tokenizer.encode_batch(documents[start:start + 4096], add_special_tokens=False)
    return time.perf_counter() - started


class _TreeRss:
    """The largest total RSS of this process and its descendants (the worker pool, its forkserver), sampled
    every 50 ms on a thread."""

    def __init__(self):
        import psutil  # only the measuring process samples

        self.peak, self._stop = 0, threading.Event()
        self._me = psutil.Process()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil  # as above

        while not self._stop.wait(0.05):
            total = 0
            for process in [self._me, *self._me.children(recursive=True)]:
                try:
                    total += process.memory_info().rss
                except psutil.Error:  # a worker that just exited
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20


def measure(kind: str, corpus: Path, tokenizer: str, workers: int, out: Path) -> dict:
    """One measurement, in this process (run through a fresh interpreter by main)."""
    from trainer.data.shards import tokenize_files

    files = sorted(corpus.glob("*.jsonl"))
    tree = _TreeRss() if workers > 1 else None  # sampling costs CPU: only where ru_maxrss misses the workers
    started = time.perf_counter()
    if kind == "previous":
        _previous(files, out, 0.05, tokenizer)
        seconds = time.perf_counter() - started
    elif kind == "library":
        seconds = _library_batch(files, tokenizer)
    else:
        tokenize_files(files, out, 0.05, tokenizer, workers=workers)
        seconds = time.perf_counter() - started
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the check below reads
    digest = hashlib.sha256()
    for name in ("train.bin", "val.bin"):
        if (out / name).is_file():
            with (out / name).open("rb") as handle:
                while block := handle.read(8 << 20):
                    digest.update(block)
    return {"seconds": seconds, "bytes": sum(p.stat().st_size for p in files), "peak_rss_mb": peak_rss_mb,
            "peak_rss_tree_mb": tree.stop() if tree is not None else peak_rss_mb,
            "shards_sha256": digest.hexdigest() if kind != "library" else None}


def _run(kind: str, corpus: Path, tokenizer: str, workers: int, scratch: Path) -> dict:
    out = scratch / f"out-{kind}-{workers}-{corpus.name}"
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([sys.executable, __file__, "--measure", kind, "--corpus", str(corpus), "--tokenizer", tokenizer,
                           "--workers", str(workers), "--out", str(out)], check=True, cwd=ROOT, capture_output=True,
                          text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    result["mb_per_second"] = result["bytes"] / 1e6 / result["seconds"]
    used = workers if kind in ("byte", "bpe") else (os.cpu_count() if kind == "library" else 1)
    result["mb_per_second_per_core"] = result["mb_per_second"] / used
    log.info("%s %s workers=%d: %.1f MB/s (%.1f per core), peak RSS %.0f MB (with its workers %.0f MB)", kind,
             corpus.name, workers, result["mb_per_second"], result["mb_per_second_per_core"], result["peak_rss_mb"],
             result["peak_rss_tree_mb"])
    return result


def _train_bpe(files: list[Path], folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(files[0])], trainers.BpeTrainer(vocab_size=8192, special_tokens=["<s>", "</s>"],
                                                         show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=40, help="the smaller corpus; the larger is 4 ×")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "data.json")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", default="byte", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.corpus, args.tokenizer, args.workers, args.out)))
        return 0

    logs.configure()
    cores = os.cpu_count() or 1
    scratch = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        small = scratch / "corpus-1x"
        large = scratch / "corpus-4x"
        write_corpus(small, args.megabytes)
        write_corpus(large, 4 * args.megabytes)
        bpe = str(_train_bpe(sorted(small.glob("*.jsonl")), scratch / "bpe"))
        runs = {
            "previous_1x": _run("previous", small, "byte", 1, scratch),
            "previous_4x": _run("previous", large, "byte", 1, scratch),
            "byte_1_worker_1x": _run("byte", small, "byte", 1, scratch),
            "byte_1_worker_4x": _run("byte", large, "byte", 1, scratch),
            f"byte_{cores}_workers_4x": _run("byte", large, "byte", cores, scratch),
            "bpe_library_batch_1x": _run("library", small, bpe, cores, scratch),
            "bpe_1_worker_1x": _run("bpe", small, bpe, 1, scratch),
            f"bpe_{cores}_workers_1x": _run("bpe", small, bpe, cores, scratch),
        }
        same = runs["previous_4x"]["shards_sha256"] == runs["byte_1_worker_4x"]["shards_sha256"] \
            == runs[f"byte_{cores}_workers_4x"]["shards_sha256"]
        figures = {
            "corpus_megabytes": [args.megabytes, 4 * args.megabytes], "cores": cores, "runs": runs,
            "shards_identical_to_previous": same,
            "byte_mb_per_second_per_core": runs["byte_1_worker_4x"]["mb_per_second_per_core"],
            "byte_speedup_over_previous": runs["byte_1_worker_4x"]["mb_per_second"] / runs["previous_4x"]["mb_per_second"],
            "byte_parallel_speedup": runs[f"byte_{cores}_workers_4x"]["mb_per_second"] / runs["byte_1_worker_4x"]["mb_per_second"],
            "byte_peak_rss_4x_over_1x": runs["byte_1_worker_4x"]["peak_rss_mb"] / runs["byte_1_worker_1x"]["peak_rss_mb"],
            "byte_workers_peak_rss_tree_mb": runs[f"byte_{cores}_workers_4x"]["peak_rss_tree_mb"],
            "previous_peak_rss_4x_over_1x": runs["previous_4x"]["peak_rss_mb"] / runs["previous_1x"]["peak_rss_mb"],
            "bpe_over_library_batch": max(runs["bpe_1_worker_1x"]["mb_per_second"],
                                          runs[f"bpe_{cores}_workers_1x"]["mb_per_second"])
            / runs["bpe_library_batch_1x"]["mb_per_second"],
        }
        write_results(args.output, figures, "bench/data.py")
        print(json.dumps({k: v for k, v in figures.items() if k != "runs"}, indent=1))
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
