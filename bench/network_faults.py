"""Each network drill once, with nodes in network namespaces (root only; ~4 min): what a cut costs.

    .venv/bin/python bench/network_faults.py

The shape of tests/integration/test_network_faults.py: 2 nodes x 1 rank, the tiny model, heartbeat 10 s, the store
watch 4 s, no replacement delay. For each drill, from the run's own records:
- ``detect_seconds``: the cut -> the first sign any layer acted on it: the cut-off node's launcher exiting (its
  store watch), a rank's failure record, or the restarted processes' start (ft_launcher's heartbeat leaves no
  record of its own), whichever came first; null when no layer had to act (the cut was shorter than every timeout);
- ``training_again_seconds``: the cut -> the first step after it trained by every rank (the recovery's first
  step when there was one, else the first metrics line after the link came back);
- ``cut_off_node``: what the cut-off node's launcher printed about itself until it stopped.
Writes bench/results/network_faults.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from common import ROOT, demo_token_dir, write_results  # noqa: E402  (bench/ is the script's folder)

from components.train.local import run_local_training  # noqa: E402
from localcluster.network import netns_problem  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.run.events import read_events  # noqa: E402
from trainer.run.run_dir import RunDir, read_jsonl  # noqa: E402

SHAPE = ["--training.num_steps=30", "--training.seq_len=256", "--training.batch_size=4", "--training.warmup_steps=2",
         "--checkpoint.interval_steps=3", "--training.nproc_per_node=1", "--training.num_nodes=2",
         "--checkpoint.peer_replica_wait=true", "--local.node_replacement_delay_seconds=0",
         "--local.node_network=netns", "--resilience.heartbeat_timeout=10", "--resilience.store_timeout_seconds=4",
         "--resilience.straggler_interval=0"]
DRILLS = {"partition": "partition@4:node=1", "partition-comes-back": "partition@4:node=1:seconds=15",
          "short-partition": "partition@4:node=1:seconds=2", "flap": "flap@4:node=1:times=3",
          "partition-store": "partition_store@4:seconds=2"}


def measure(work: Path, tokens: Path, name: str, schedule: str) -> dict:
    cfg = load_config("local", [f"--run.work_dir={work / name}", f"--run.run_id={name}",
                                f"--checkpoint.memory_dir={work / name}/node-memory", *SHAPE,
                                f"--faults.schedule={schedule}"])
    run_local_training(cfg, tokens)
    events = read_events(cfg.run_dir)
    cuts = [e for e in events if e["event"] == "fault" and e.get("rank") is None]
    first_cut = cuts[0]["time"]
    recoveries = [e for e in events if e["event"] == "recovery"]
    acted = [e["time"] for e in events if e["event"] in ("node_lost", "rank_failed", "hang") and e["time"] > first_cut]
    # A restart leaves no record of its detection when ft_launcher's heartbeat caught it: its new processes' start.
    acted += [r["fault_time"] + r["detect_and_teardown_seconds"] for r in recoveries if r.get("detect_and_teardown_seconds")]
    lines = read_jsonl(RunDir(cfg.run_dir).metrics)
    if recoveries:
        back = recoveries[-1]["time"]
    else:
        restored = max(e["time"] for e in events if e["event"] == "link_restored")
        back = min(r["time"] for r in lines if r["time"] > restored)
    log = RunDir(cfg.run_dir).train_log.read_text().splitlines()
    node = cuts[0].get("node")
    said = [line.split("trainer.launcher: ", 1)[1] for line in log
            if node is not None and line.startswith(f"[node-{node}] trainer.launcher:") and "NVIDIA" not in line]
    return {"schedule": schedule, "cuts": len(cuts), "recoveries": len(recoveries),
            "recovery_mechanisms": [r["mechanism"] for r in recoveries],
            "reload_sources": [r["reload_source"] for r in recoveries],
            "absorbed": len([e for e in events if e["event"] == "fault_absorbed"]),
            "detect_seconds": round(min(acted) - first_cut, 1) if acted else None,
            "training_again_seconds": round(back - first_cut, 1), "cut_off_node": said}


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    problem = netns_problem()
    if problem:
        sys.exit(f"bench/network_faults.py: {problem}")
    with tempfile.TemporaryDirectory() as scratch:
        tokens = demo_token_dir(Path(scratch), documents=300)
        figures = {name: measure(Path(scratch) / "work", tokens, name, schedule) for name, schedule in DRILLS.items()}
    for name, row in figures.items():
        print(f"{name:22s} detect {row['detect_seconds']!s:>5} s  training again {row['training_again_seconds']:>5} s  "
              f"recoveries {row['recoveries']} ({', '.join(row['recovery_mechanisms']) or '-'}), absorbed "
              f"{row['absorbed']}")
        for line in row["cut_off_node"]:
            print(f"{'':24s}{line}")
    write_results(ROOT / "bench" / "results" / "network_faults.json", {"drills": figures}, "bench/network_faults.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())

