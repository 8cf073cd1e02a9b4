"""One rule over the job's timeouts (trainer.config.timeouts): what releases a blocked rank ends before what
declares it hung, and a cut-off node is declared lost and replaced before the survivors stop waiting for it.
The configs we ship and the TrainJobs they render must keep it — read back from the rendered commands, since
those numbers, not the config's, are what a cluster runs."""

import json
from pathlib import Path

import pytest

from components.train.trainjob import build_trainjob
from trainer.config import ConfigError, load_config
from trainer.config.timeouts import timeout_ladder
from trainer.launch.lighthouse import LIGHTHOUSE_ARGS_ENV


def _flag(command: list[str], prefix: str) -> float | None:
    for arg in command:
        if prefix in arg:
            return float(arg.split(prefix, 1)[1].split(",")[0])
    return None


def _rendered_timeouts(cfg) -> dict[str, float]:
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    command = job["spec"]["trainer"]["command"]
    found = {"heartbeat": _flag(command, "--ft-rank-heartbeat-timeout="), "store": _flag(command, "--store-timeout="),
             "join": _flag(command, "join_timeout=")}
    for patch in job["spec"].get("podTemplateOverrides", []) + job["spec"].get("runtimePatches", []):
        text = json.dumps(patch)
        if LIGHTHOUSE_ARGS_ENV in text:
            args = json.loads(next(e["value"] for e in _walk_env(patch) if e["name"] == LIGHTHOUSE_ARGS_ENV))
            found["lighthouse_join"] = float(args[args.index("--join_timeout_ms") + 1]) / 1000
            found["lighthouse_heartbeat"] = float(args[args.index("--heartbeat_timeout_ms") + 1]) / 1000
    return found


def _walk_env(node):
    if isinstance(node, dict):
        if "env" in node:
            yield from node["env"]
        for value in node.values():
            yield from _walk_env(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk_env(value)


# The prod config's base model as the stage step leaves it on FSx (its config.json sizes the timeouts).
STAGED = f"--model.init_from={Path(__file__).resolve().parents[1] / 'data' / 'llama-3.1-8b'}"


@pytest.mark.parametrize("config, overrides", [
    ("pipelines/configs/eks-prod.yaml", [STAGED]),
    ("pipelines/configs/eks-dev.yaml", []),
    ("pipelines/configs/eks-prod.yaml", [STAGED, "--training.replica_groups=2"]),  # the lighthouse's rung
])
def test_the_shipped_configs_and_their_trainjobs_keep_the_timeouts_in_order(tmp_path, config, overrides):
    cfg = load_config(config, ["--run.run_id=t", f"--data.fsx_root={tmp_path}", *overrides])
    rendered = _rendered_timeouts(cfg)
    heartbeat = rendered["heartbeat"]
    assert heartbeat == cfg.resilience.heartbeat_timeout
    if cfg.training.num_nodes > 1:  # a cut-off node exits, and is replaced, before the survivors give up on it
        assert rendered["store"] == cfg.resilience.store_timeout_seconds
        assert rendered["store"] < rendered["join"] == int(cfg.resilience.replacement_timeout_seconds)
    else:
        assert rendered["store"] is None  # one node: no store to be cut off from
    if cfg.training.replica_groups > 1:  # torchft's waits end before ft_launcher takes the rank for hung
        assert rendered["lighthouse_join"] < heartbeat and rendered["lighthouse_heartbeat"] < heartbeat
        assert 2 * cfg.resilience.replica_timeout_seconds < heartbeat
        assert cfg.resilience.quorum_timeout_seconds < heartbeat
    ladder = [seconds for _, seconds in timeout_ladder(cfg)]
    assert ladder[-1] == max(ladder)  # the survivors' wait for a replacement is the longest


def test_the_local_config_keeps_the_rule():
    cfg = load_config("local", ["--training.num_nodes=2"])
    names = [name for name, _ in timeout_ladder(cfg)]
    assert names == ["resilience.heartbeat_timeout", "resilience.store_timeout_seconds",
                     "resilience.replacement_timeout_seconds"]


@pytest.mark.parametrize("overrides, message", [
    (["--training.num_nodes=2", "--resilience.replacement_timeout_seconds=30", "--resilience.store_timeout_seconds=30"],
     "resilience.store_timeout_seconds: must be below resilience.replacement_timeout_seconds=30"),
    (["--training.num_nodes=2", "--training.replica_groups=2", "--resilience.heartbeat_timeout=20"],
     "resilience.quorum_timeout_seconds: must be below resilience.heartbeat_timeout=20"),
    (["--resilience.in_process=true", "--resilience.collective_timeout=30"],
     r"resilience.collective_timeout: must be in \(0, resilience.soft_timeout=20"),
])
def test_a_timeout_out_of_order_is_refused_naming_it(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("local", overrides)
