"""The trainer's command line: `python -m trainer`, under a launcher or alone.

Runbook (from the repository root, after the stage step has written token shards):

    # 2 CPU ranks (gloo), the local config
    torchrun --standalone --nproc-per-node 2 -m trainer --config local --data-dir work/fsx/datasets/demo \
        --run.run_id=try1

    # one process, no launcher
    python -m trainer --config local --data-dir work/fsx/datasets/demo --run.run_id=try1

Any ``--section.key=value`` after the known flags overrides the config. Rank 0 writes
``<run_dir>/metrics.jsonl`` (one line per step) and ``result.json`` at the end. Exit code 2 names a bad
config field, base model, tokenizer or corpus; exit code 42 means the restart budget gave up on a crash loop
(trainer.resilience.budget).
With resilience.in_process the training runs inside NVRx's in-process restart.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from trainer.config import ConfigError, load_config
from trainer.config.rules import InputError
from trainer.env import CRASH_LOOP_EXIT_CODE
from trainer.job.trainer import Trainer
from trainer.observe import logs
from trainer.config.decisions import parse_decisions
from trainer.resilience.budget import EscalateToLauncher, RestartBudgetExhausted
from trainer.resilience.node_exit import in_a_node_of_many, kill_this_node
from trainer.resilience import flight_recorder
from trainer.resilience.failures import record_failure, record_sigterm
from trainer.resilience.in_process import InProcessAttempt, run_with_in_process_restart
from trainer.resilience.phases import current_phase
from trainer.run.events import current_attempt

log = logging.getLogger("trainer")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config path or bundled name (e.g. local)")
    parser.add_argument("--data-dir", required=True, type=Path, help="folder with token shards (tokens.json)")
    return parser.parse_known_args(argv)


def _gpu_health(trainer: Trainer | None) -> dict | None:
    """NVML's report now, where a GPU is watched: evidence of a hardware fault (None otherwise)."""
    health = trainer.resilience.gpu_health if trainer is not None else None
    if health is None or not health.enabled:
        return None
    try:
        return health.check(trainer.step)
    except Exception:  # noqa: BLE001 - evidence only: the failure being recorded matters more
        log.exception("NVML could not be read for the failure's evidence")
        return None


def act_on(failure: dict, budget) -> None:
    """The decision on a failure's cause (trainer.config.decisions): stop ends the launch; replace_node takes
    this node out through the node-replacement path; restart (and a rollback, decided in the step) lets the
    exception reach the launcher as before."""
    if failure["decision"] == "stop" and budget is not None:
        budget.stop(failure)
    if failure["decision"] == "replace_node":
        why = f"{failure['cause']}: {failure['evidence']}"
        if in_a_node_of_many():
            kill_this_node(why)
        log.error("%s, but this rank is not on a node of a multi-node job: restarting instead", why)


def main(argv: list[str] | None = None) -> int:
    logs.configure()
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, overrides)
        if not cfg.run.run_id:
            raise ConfigError("run.run_id: must be set for training (pass --run.run_id=NAME)")
    except ConfigError as err:
        log.error("%s", err)
        return 2

    rank = int(os.environ.get("RANK", "0"))
    record_sigterm(cfg.run_dir, rank, phase_of=current_phase)

    def train(attempt: InProcessAttempt | None = None) -> None:
        trainer, finished = None, False
        try:
            trainer = Trainer(cfg, args.data_dir, in_process=attempt)
            trainer.train()
            finished = True
        except Exception as err:  # the rank's own record of how it failed (trainer.resilience.failures)
            # its last collectives, for the recovery (named by the rank in the job, as the stall dump names them)
            flight_recorder.dump(cfg.run_dir, current_attempt(), trainer.global_rank if trainer is not None else rank)
            failure = record_failure(cfg.run_dir, rank, err, current_phase(), trainer.step if trainer is not None
                                     else None, parse_decisions(cfg.resilience.decisions), _gpu_health(trainer))
            if failure is not None:
                act_on(failure, trainer.restart_budget if trainer is not None else None)
            raise
        finally:
            if trainer is not None:
                # After a fault the peers may be gone: the save in flight is dropped, not waited for.
                trainer.close(wait_for_checkpoint=finished or attempt is None, peers_alive=finished)

    try:
        if cfg.resilience.in_process:
            run_with_in_process_restart(cfg, train)
        else:
            train()
    except RestartBudgetExhausted:
        return CRASH_LOOP_EXIT_CODE  # no layer restarts this (trainer.resilience.budget); the message is logged
    except InputError as err:  # a base model, tokenizer or corpus that cannot be used: the message names it
        log.error("%s", err)
        return 2
    except EscalateToLauncher:
        return 1  # ft_launcher restarts the processes
    return 0
