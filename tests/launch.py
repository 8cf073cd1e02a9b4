"""Starting the training launcher by hand, as a user does without the pipeline (the integration tests' helper)."""

import os
import subprocess
import uuid

from components.train.local import JOB_TOKEN_ENV, launch_command
from trainer.run.run_dir import RunDir


def start_launcher(cfg, token_dir, **env) -> tuple[subprocess.Popen, str]:
    """The launcher in a session of its own, logging to train.log; rank 0 takes the run folder's lease itself.
    Returns the process and the job's launch token (what stop_job and job_processes look for)."""
    run_dir = RunDir(cfg.run_dir)
    config_path = run_dir.write_config(cfg.to_yaml())
    token = uuid.uuid4().hex
    log = run_dir.train_log.open("a")
    proc = subprocess.Popen(launch_command(cfg, config_path, token_dir), stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, JOB_TOKEN_ENV: token, **env}, start_new_session=True)
    return proc, token
