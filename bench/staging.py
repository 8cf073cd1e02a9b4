"""Copy-mode staging against a plain sequential boto3 download of the same objects, in one run.

    .venv/bin/python bench/staging.py                       # ~1 min: 48 x 4 MiB + 2 x 48 MiB objects
    .venv/bin/python bench/staging.py --objects 16 --mib 1  # quicker

Both read the same objects from the S3-compatible server on loopback, alternating (sequential, copy,
sequential, copy, …) so machine noise hits both; the best of --repeats is compared. Loopback has no
network latency and the server shares the 2 cores with the client, so the run is repeated through a
proxy that delays every request by --latency-ms (S3's time to first byte is typically 10-50 ms): that is
where parallel requests pay off. Both figures are reported; speedup_vs_sequential is the one with latency.
- speedup_vs_sequential = sequential seconds / copy-mode seconds, where copy mode is the stage step's
  download (parallel objects, ranged parts for large ones, size + checksum verification, temp + rename)
  and sequential is one `download_file` per object, one after the other, unverified.
- restage_fraction = an unchanged re-stage (the whole stage step: list, compare with the manifest, token
  cache hit) / the first full stage step (download + tokenization).
Writes bench/results/staging.json.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, write_results  # noqa: E402  (bench/ is the script's folder)

from components.stage.s3_copy import copy_from_s3, list_objects, s3_client, select_objects  # noqa: E402
from components.stage.staging import stage_dataset  # noqa: E402
from pipelines.local_stack import S3Server, free_port  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.observe import logs  # noqa: E402

log = logging.getLogger("bench.staging")


def upload(client, bucket: str, prefix: str, objects: int, mib: int, big_mib: int) -> int:
    client.create_bucket(Bucket=bucket)
    line = b"the quick brown fox jumps over the lazy dog, again and again.\n\n"
    total = 0
    sizes = [mib] * objects + [big_mib] * 2
    for index, size in enumerate(sizes):
        body = (f"document {index}\n\n".encode() + line * (size * 1024 * 1024 // len(line)))
        client.put_object(Bucket=bucket, Key=f"{prefix}/part-{index:04d}.txt", Body=body)
        total += len(body)
    return total


def sequential(client, bucket: str, prefix: str, target: Path) -> float:
    started = time.perf_counter()
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
            for o in page.get("Contents", [])]
    for key in keys:
        path = target / key
        path.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(path))
    return time.perf_counter() - started


class LatencyProxy:
    """A TCP proxy on loopback that holds each request for `latency` seconds before passing it on."""

    def __init__(self, upstream_port: int, latency: float):
        self.port = free_port()
        self.upstream_port, self.latency = upstream_port, latency
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait()

    def _serve(self, ready) -> None:
        async def pipe(reader, writer, delay: bool) -> None:
            try:
                while data := await reader.read(65536):
                    if delay:
                        await asyncio.sleep(self.latency)
                        delay = False  # once per request burst; the response streams at full speed
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def handle(client_reader, client_writer) -> None:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            await asyncio.gather(pipe(client_reader, upstream_writer, True), pipe(upstream_reader, client_writer, False))

        async def main() -> None:
            await asyncio.start_server(handle, "127.0.0.1", self.port)
            ready.set()
            await asyncio.Event().wait()

        self.loop.run_until_complete(main())


def compare_downloads(client, repeats: int, workers: int, scratch: Path, label: str) -> tuple[float, float]:
    seq_times, copy_times = [], []
    for repeat in range(repeats):
        seq_times.append(sequential(client, "bench", "corpus", scratch / f"seq-{repeat}"))
        started = time.perf_counter()  # the listing and key checks count, as they do in a stage
        raw = scratch / f"copy-{repeat}"
        mapped, _ = select_objects(list_objects(client, "bench", "corpus"), "bench", "corpus", raw, "fail")
        copy_from_s3(client, "bench", mapped, raw, {}, max_workers=workers)
        copy_times.append(time.perf_counter() - started)
        shutil.rmtree(scratch / f"seq-{repeat}")
        shutil.rmtree(scratch / f"copy-{repeat}")
        print(f"{label} repeat {repeat}: sequential {seq_times[-1]:.2f} s, copy mode {copy_times[-1]:.2f} s")
    return min(seq_times), min(copy_times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=48)
    parser.add_argument("--mib", type=int, default=4)
    parser.add_argument("--big-mib", type=int, default=48)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="per-request delay of the proxy run")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "staging.json")
    args = parser.parse_args()
    logs.configure(logging.WARNING)
    scratch = Path(tempfile.mkdtemp(prefix="bench-staging-"))
    try:
        with S3Server(log_dir=scratch / "logs") as s3_server:
            client = s3_client(max_workers=args.workers)
            size = upload(client, "bench", "corpus", args.objects, args.mib, args.big_mib)
            loopback = compare_downloads(client, args.repeats, args.workers, scratch, "loopback")
            server = s3_server.port
            proxy = LatencyProxy(server, args.latency_ms / 1000)
            delayed = compare_downloads(s3_client(f"http://127.0.0.1:{proxy.port}", args.workers), args.repeats,
                                        args.workers, scratch, f"+{args.latency_ms:.0f} ms")

            data = load_config(None, ["--data.s3_uri=s3://bench/corpus", f"--data.max_workers={args.workers}"]).data
            started = time.perf_counter()
            stage_dataset(data, scratch / "fsx" / "ds", scratch / "fsx")
            full = time.perf_counter() - started
            restages = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                again = stage_dataset(data, scratch / "fsx" / "ds", scratch / "fsx")
                restages.append(time.perf_counter() - started)
                assert again["downloaded"] == 0, "an unchanged re-stage downloaded objects"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    figures = {"speedup_vs_sequential": delayed[0] / delayed[1], "restage_fraction": min(restages) / full,
               "bytes": size, "objects": args.objects + 2, "workers": args.workers, "cpus": os.cpu_count(),
               "latency_ms": args.latency_ms, "sequential_seconds": delayed[0], "copy_seconds": delayed[1],
               "loopback_speedup_vs_sequential": loopback[0] / loopback[1], "loopback_sequential_seconds": loopback[0],
               "loopback_copy_seconds": loopback[1], "full_stage_seconds": full, "restage_seconds": min(restages)}
    write_results(args.output, figures, "bench/staging.py")
    print(f"{size / 2**20:.0f} MiB in {args.objects + 2} objects, +{args.latency_ms:.0f} ms per request: copy mode "
          f"{figures['copy_seconds']:.2f} s vs sequential {figures['sequential_seconds']:.2f} s = "
          f"{figures['speedup_vs_sequential']:.2f}x (loopback, no latency: "
          f"{figures['loopback_speedup_vs_sequential']:.2f}x); "
          f"unchanged re-stage {figures['restage_seconds']:.2f} s = {figures['restage_fraction']:.1%} of the full "
          f"stage ({figures['full_stage_seconds']:.1f} s)")


if __name__ == "__main__":
    main()
