"""One measured operation of bench/evaluate.py, in a fresh process: its seconds and its peak RSS over what the
process held once its imports were done (VmHWM, reset then: trainer.observe.memory), as one JSON line on stdout.

    python bench/evaluate_probe.py validate <checkpoint>                          # today's or the new check
    python bench/evaluate_probe.py evaluate_today <checkpoint> <tokens> <tracking uri> <model name> <seq_len>
    python bench/evaluate_probe.py export_today <checkpoint> <tracking uri> <server's artifact folder> <model name>
    python bench/evaluate_probe.py gate <evaluation record> <tracking uri> <server's artifact folder> <model name>

PYTHONPATH picks the code: a worktree of the commit before issue 41 for today's operations, this checkout for the
new ones. The measuring code is this file's own, so both are measured the same way.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def _status(field: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith(field + ":"))


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _artifact_bytes(root: str) -> int:
    """What the tracking server's artifact store holds: the bytes that went through it."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def validate(checkpoint: str) -> dict:
    from components.validate.checks import check_checkpoint

    check_checkpoint(Path(checkpoint))
    return {}


def evaluate_today(checkpoint: str, tokens: str, tracking_uri: str, model_name: str, seq_len: str) -> dict:
    """Today's evaluate step: the candidate loaded into this process (fp32, full logits), then the champion
    downloaded through the tracking server and evaluated the same way."""
    from mlflow.tracking import MlflowClient

    from components.evaluate.heldout import evaluate_checkpoint, heldout_loss
    from components.evaluate.promotion import champion_version, load_registered_model

    windows = dict(seq_len=int(seq_len), batch_size=2, max_batches=2)
    result = evaluate_checkpoint(Path(checkpoint), Path(tokens), **windows, prompts=["The"], max_new_tokens=8)
    champion = load_registered_model(champion_version(MlflowClient(tracking_uri), model_name), tracking_uri)
    return {"heldout_loss": result["heldout_loss"],
            "champion_loss": heldout_loss(champion, Path(tokens), **windows)["heldout_loss"]}


def export_today(checkpoint: str, tracking_uri: str, artifacts: str, model_name: str) -> dict:
    """Today's promotion: the HF export written by this process, uploaded through the tracking server's artifact
    proxy (client.log_artifacts), registered from the run's artifacts."""
    from mlflow.tracking import MlflowClient

    from trainer.checkpoint.export import export_hf

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("bench") or client.get_experiment(client.create_experiment("bench"))
    run_id = client.create_run(experiment.experiment_id).info.run_id
    before = _artifact_bytes(artifacts)
    with tempfile.TemporaryDirectory() as scratch:
        folder = export_hf(Path(checkpoint), Path(scratch) / "model", overwrite=True)
        client.log_artifacts(run_id, str(folder), "model")
    try:
        client.create_registered_model(model_name)
    except Exception:  # noqa: BLE001 - exists from an earlier world size
        pass
    version = client.create_model_version(model_name, source=f"{client.get_run(run_id).info.artifact_uri}/model",
                                          run_id=run_id)
    client.set_registered_model_alias(model_name, "champion", version.version)
    return {"bytes_through_tracking_server": _artifact_bytes(artifacts) - before}


def gate(record_path: str, tracking_uri: str, artifacts: str, model_name: str) -> dict:
    """The new evaluate step's registry side: the decision from the training ranks' record, a version registered
    from the export's URI (no weights loaded, none sent)."""
    from mlflow.tracking import MlflowClient

    from components.evaluate.promotion import promote_if_better

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("bench") or client.get_experiment(client.create_experiment("bench"))
    run_id = client.create_run(experiment.experiment_id).info.run_id
    before = _artifact_bytes(artifacts)
    record = json.loads(Path(record_path).read_text())
    decision = promote_if_better(client, model_name=model_name + "-new", threshold=0.0, record=record, run_id=run_id,
                                 model_id=None, tags={})
    return {"promoted": decision.promote, "bytes_through_tracking_server": _artifact_bytes(artifacts) - before}


OPERATIONS = {"validate": validate, "evaluate_today": evaluate_today, "export_today": export_today, "gate": gate}
# What each operation imports, imported before the baseline: the figures are the operation's, not its imports'.
IMPORTS = {"validate": ["components.validate.checks"],
           "evaluate_today": ["mlflow.tracking", "components.evaluate.heldout", "components.evaluate.promotion"],
           "export_today": ["mlflow.tracking", "trainer.checkpoint.export"],
           "gate": ["mlflow.tracking", "components.evaluate.promotion"]}

def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("operation", choices=sorted(OPERATIONS))
    parser.add_argument("arguments", nargs="*")
    args = parser.parse_args()
    import importlib

    for module in IMPORTS[args.operation]:
        importlib.import_module(module)
    held = _reset_peak()
    started = time.perf_counter()
    figures = OPERATIONS[args.operation](*args.arguments)
    print(json.dumps({"seconds": time.perf_counter() - started, "peak_rss_bytes": _status("VmHWM") - held,
                      **figures}))


if __name__ == "__main__":
    main()
