"""Every tier of the checkpoint, and the nearest valid copy: real 2-rank training (FSDP2, gloo) saves to node
memory (each rank a node of its own, a peer replica on the other), FSx and a real S3 server on loopback;
then a new job on the same node store resumes after the scenario broke some tiers.

One training run (7 steps: memory and replicas hold steps 6 and 7, FSx and S3 hold 6 and 7), then each
scenario starts from copies of exactly that state. A resume must take the newest copy that verifies, in the
order memory → peer → FSx → S3, restore it exactly (the digest of every rank's weights and moments, the
last loss), and skip — with a log line — anything partial or corrupt.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from pipelines.local_stack import S3Server
from trainer.checkpoint.node_store import RankStore
from trainer.env import NODE_STORE_ENV
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir
from tests.metrics import losses_by_step

pytestmark = pytest.mark.integration

HARNESS = Path(__file__).resolve().parents[1] / "tier_harness.py"
BUCKET = "checkpoints"


def run_harness(phase: str, cfg, token_dir: Path, store: Path) -> dict:
    config_path = RunDir(cfg.run_dir).write_config(cfg.to_yaml())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(HARNESS), phase, str(config_path), str(token_dir)],
                          env={**os.environ, NODE_STORE_ENV: str(store)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**json.loads((cfg.run_dir / f"harness-{phase}.json").read_text()), "log": proc.stderr}


@pytest.fixture(scope="module")
def module_s3_server(tmp_path_factory):
    with S3Server(log_dir=tmp_path_factory.mktemp("s3-logs")) as server:
        yield server


@pytest.fixture(scope="module")
def trained(module_s3_server, tmp_path_factory, token_dir, training_config):
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    work = tmp_path_factory.mktemp("tiers")
    cfg = training_config(work, "tiers", "--training.num_steps=7", "--checkpoint.interval_steps=3",
                          "--checkpoint.keep_last=2", f"--checkpoint.s3_uri=s3://{BUCKET}/runs",
                          "--resilience.launcher=torchrun", "--faults.schedule=")
    store = work / "node-memory"
    trained = run_harness("train", cfg, token_dir, store)
    pristine = work / "pristine"
    shutil.copytree(store, pristine / "store")
    shutil.copytree(cfg.checkpoint_dir, pristine / "checkpoints")
    objects = {o["Key"]: s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
               for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    losses = losses_by_step(RunDir(cfg.run_dir).metrics)
    return cfg, store, pristine, objects, trained, losses


def _reset(s3, cfg, store: Path, pristine: Path, objects: dict) -> None:
    for folder, source in ((store, pristine / "store"), (cfg.checkpoint_dir, pristine / "checkpoints")):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(source, folder)
    for item in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        s3.delete_object(Bucket=BUCKET, Key=item["Key"])
    for key, body in objects.items():
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)


def _rank_store(store: Path, rank: int) -> RankStore:
    return RankStore(store, node=rank, rank=rank, world_size=2, replica_of=1 - rank)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _shard(cfg, step: int) -> Path:
    return next((cfg.checkpoint_dir / f"step-{step:06d}").glob("*.distcp"))


def _corrupt_s3(s3, step: int) -> None:
    key = next(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]
               if f"/step-{step:06d}/" in o["Key"] and o["Key"].endswith(".distcp"))
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))


SCENARIOS = {
    # name: (what breaks, expected source, expected step, a log line that must say why)
    "intact": ([], "memory", 7, None),
    "own copy corrupt": (["corrupt own 7 of rank 0"], "peer", 7, "does not match its checksum"),
    "own copy and replica corrupt": (["corrupt own 7 of rank 0", "corrupt replica 7 of rank 0"], "disk", 7,
                                     "does not match its checksum"),
    "node 0 lost": (["wipe node 0"], "peer", 7, "state of step 7 received from rank 1"),
    "both nodes lost": (["wipe node 0", "wipe node 1"], "disk", 7, None),
    "FSx copy corrupt": (["wipe node 0", "wipe node 1", "corrupt FSx 7"], "s3", 7, "skipping checkpoint"),
    "FSx and S3 copies corrupt": (["wipe node 0", "wipe node 1", "corrupt FSx 7", "corrupt S3 7"], "disk", 6,
                                  "does not verify"),
    "FSx empty": (["wipe node 0", "wipe node 1", "delete FSx"], "s3", 7, None),
    "FSx empty, S3 copy corrupt": (["wipe node 0", "wipe node 1", "delete FSx", "corrupt S3 7"], "s3", 6,
                                   "does not verify"),
    "nothing left": (["wipe node 0", "wipe node 1", "delete FSx", "empty S3"], "none", 0, None),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_resume_takes_the_newest_valid_copy_from_the_nearest_tier(trained, token_dir, scenario):
    cfg, store, pristine, objects, saved, losses = trained
    s3 = boto3.client("s3")
    _reset(s3, cfg, store, pristine, objects)
    breaks, source, step, why = SCENARIOS[scenario]
    for action in breaks:
        if action == "corrupt own 7 of rank 0":
            _rank_store(store, 0).own.corrupt_newest()
        elif action == "corrupt replica 7 of rank 0":
            _rank_store(store, 1).replica.corrupt_newest()
        elif action.startswith("wipe node"):
            _rank_store(store, int(action[-1])).wipe()
        elif action == "corrupt FSx 7":
            _flip_byte(_shard(cfg, 7))
        elif action == "delete FSx":
            shutil.rmtree(cfg.checkpoint_dir)
        elif action == "corrupt S3 7":
            _corrupt_s3(s3, 7)
        elif action == "empty S3":
            for item in s3.list_objects_v2(Bucket=BUCKET)["Contents"]:
                s3.delete_object(Bucket=BUCKET, Key=item["Key"])

    resumed = run_harness("resume", cfg, token_dir, store)

    resume = read_events(cfg.run_dir, "resume")[-1]
    assert (resume["source"], resume["step"]) == (source, step), resumed["log"][-3000:]
    assert resumed["step"] == step
    if step == 7:
        assert resumed["digests"] == saved["digests"]  # every rank's weights and moments, exactly
    if step:
        assert resumed["last_loss"] == losses[step]
    if why:
        assert why in resumed["log"]


@pytest.mark.parametrize("breaks, source", [([], "memory"), (["wipe"], "disk"), (["wipe", "delete FSx"], "s3")])
def test_a_rollback_takes_the_newest_copy_not_after_its_step_and_drops_the_later_ones_from_every_tier(
        trained, token_dir, breaks, source):
    cfg, store, pristine, objects, _, losses = trained
    s3 = boto3.client("s3")
    _reset(s3, cfg, store, pristine, objects)
    if "wipe" in breaks:
        _rank_store(store, 0).wipe()
        _rank_store(store, 1).wipe()
    if "delete FSx" in breaks:
        shutil.rmtree(cfg.checkpoint_dir)

    rolled = run_harness("rollback-6", cfg, token_dir, store)

    resume = read_events(cfg.run_dir, "resume")[-1]
    assert (resume["source"], resume["step"], resume["at_most"]) == (source, 6, 6), rolled["log"][-3000:]
    assert rolled["step"] == 6 and rolled["last_loss"] == losses[6]
    assert sorted(p.name for p in cfg.checkpoint_dir.iterdir()) == ["step-000006"]
    assert {o["Key"].split("/")[2] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]} == {"step-000006"}
    for rank in (0, 1):
        assert all(step <= 6 for step in _rank_store(store, rank).own_steps() + _rank_store(store, rank).replica_steps())


def test_a_start_that_finds_no_valid_copy_initialises_as_a_fresh_run(trained, token_dir, training_config,
                                                                     tmp_path):
    """A copy in sight (here a corrupt FSx checkpoint) makes a start build the model on the meta device and
    skip initialising it (trainer.job.trainer); when nothing restores, the weights must still be exactly those of
    a run that never looked (checkpoint.resume=false builds and initialises the model as usual)."""
    _, _, pristine, *_ = trained
    fresh = run_harness("resume", training_config(tmp_path / "fresh", "fresh", "--checkpoint.resume=false",
                                                  "--resilience.launcher=torchrun"), token_dir, tmp_path / "store-a")
    looked = training_config(tmp_path / "looked", "looked", "--resilience.launcher=torchrun")
    shutil.copytree(pristine / "checkpoints" / "step-000007", looked.checkpoint_dir / "step-000007")
    _flip_byte(_shard(looked, 7))
    resumed = run_harness("resume", looked, token_dir, tmp_path / "store-b")
    assert "skipping checkpoint" in resumed["log"]
    assert read_events(looked.run_dir, "resume")[-1]["source"] == "none"
    assert resumed["digests"] == fresh["digests"]


def test_uploads_follow_the_commits_and_keep_the_newest(trained):
    cfg, _, _, objects, _, _ = trained
    steps = sorted({key.split("/")[2] for key in objects})
    assert steps == ["step-000006", "step-000007"]  # keep_last=2: step 3 was uploaded, then deleted
    assert all(f"runs/tiers/{step}/manifest.json" in objects for step in steps)
    uploaded = [e["step"] for e in read_events(cfg.run_dir, "checkpoint_uploaded")]
    assert uploaded == [3, 6, 7]
