"""The promotion gate: a candidate replaces the registered champion only when it is measurably better.

    decision = decide(candidate_loss, champion_loss, threshold)      # pure: unit-tested
    promote_if_better(client, ...)                                    # the registry side

The champion is the model version carrying the alias ``champion`` in the MLflow Model Registry. It is
evaluated again on the candidate's held-out windows (the same data, the same code), so a changed dataset
never compares two numbers measured on different data. A promoted candidate is exported in Hugging Face
format (config.json, safetensors, tokenizer), logged as the evaluate step's ``model`` artifact, registered
as a new version and given the alias; the previous champion stays as an older version.

Concurrent runs: the registry has no compare-and-set on aliases, but it numbers versions atomically. So a
candidate that beats the champion it first saw registers itself (tag ``promotion=pending``) and is decided
only after every earlier pending version has been, against the champion *at that moment* (re-evaluated if
it moved). Decisions are thereby serialised in version order: two runs can never both take the alias on
the strength of the same old champion. A loser tags its version ``lost``, deletes it, and says so.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import mlflow
from mlflow.exceptions import MlflowException
from transformers import LlamaForCausalLM

log = logging.getLogger(__name__)

CHAMPION = "champion"
PROMOTION_TAG = "promotion"  # pending -> champion | lost | abandoned


@dataclass
class GateDecision:
    promote: bool
    reason: str
    candidate_loss: float
    champion_loss: float | None = None
    champion_version: str | None = None
    threshold: float = 0.0
    new_version: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(candidate_loss: float, champion_loss: float | None, threshold: float,
           champion_version: str | None = None) -> GateDecision:
    """Promote when there is no champion, or the candidate's held-out loss beats it by the relative threshold."""
    if champion_loss is None:
        return GateDecision(True, "no champion registered yet", candidate_loss, None, None, threshold)
    bar = champion_loss * (1.0 - threshold)
    if candidate_loss < bar:
        return GateDecision(True, f"held-out loss {candidate_loss:.4f} < {bar:.4f} (champion v{champion_version} "
                                  f"{champion_loss:.4f}, threshold {threshold:.1%})",
                            candidate_loss, champion_loss, champion_version, threshold)
    return GateDecision(False, f"held-out loss {candidate_loss:.4f} does not beat {bar:.4f} (champion "
                               f"v{champion_version} {champion_loss:.4f}, threshold {threshold:.1%})",
                        candidate_loss, champion_loss, champion_version, threshold)


def champion_version(client, model_name: str):
    """The version with the champion alias, or None (no such model or alias yet)."""
    try:
        return client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def load_registered_model(version, tracking_uri: str):
    """Download a registered version's HF folder and load it (CPU, eval mode); the download is removed
    once the weights are in memory (a large model's files should not pile up in the pod's /tmp)."""
    with tempfile.TemporaryDirectory(prefix="champion-") as target:
        local = mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=target,
                                                    tracking_uri=tracking_uri)
        # safetensors only: a pickled weights file in the registry would run code on load.
        model = LlamaForCausalLM.from_pretrained(local, use_safetensors=True)
    model.eval()
    return model


def promote_if_better(client, *, tracking_uri: str, model_name: str, threshold: float, candidate_loss: float, run_id: str,
                      export: Callable[[Path], Path], evaluate_champion: Callable[[Any], float],
                      tags: dict[str, str], wait_seconds: float = 1800.0, poll_seconds: float = 2.0,
                      sleep: Callable[[float], None] = time.sleep,
                      clock: Callable[[], float] = time.monotonic) -> GateDecision:
    """Compare with the champion and, if better, export, log, register and alias the candidate (serialised
    with concurrent candidates; see the module docstring)."""
    current = champion_version(client, model_name)
    champion_loss = None
    if current is not None:
        champion_loss = evaluate_champion(load_registered_model(current, tracking_uri))
    decision = decide(candidate_loss, champion_loss, threshold, current.version if current else None)
    log.info("promotion gate for %s: %s — %s", model_name, "candidate" if decision.promote else "keep champion",
             decision.reason)
    if not decision.promote:
        return decision

    with tempfile.TemporaryDirectory(prefix="hf-export-") as scratch:
        folder = export(Path(scratch) / "model")
        client.log_artifacts(run_id, str(folder), "model")
    try:
        client.create_registered_model(model_name, description="Llama-architecture models trained by resilient-train")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    artifact_uri = client.get_run(run_id).info.artifact_uri
    version = client.create_model_version(model_name, source=f"{artifact_uri}/model", run_id=run_id,
                                          tags={**tags, "heldout_loss": f"{candidate_loss:.6f}",
                                                PROMOTION_TAG: "pending"},
                                          description=decision.reason)
    _wait_for_earlier_candidates(client, model_name, int(version.version), wait_seconds, poll_seconds, sleep, clock)

    latest = champion_version(client, model_name)
    if (latest.version if latest else None) != (current.version if current else None):
        log.info("the champion moved to v%s while this candidate was registered: comparing again", latest.version)
        decision = decide(candidate_loss, evaluate_champion(load_registered_model(latest, tracking_uri)), threshold,
                          latest.version)
    if decision.promote:
        client.set_registered_model_alias(model_name, CHAMPION, version.version)  # before the tag: see the wait
        client.set_model_version_tag(model_name, version.version, PROMOTION_TAG, "champion")
        decision.new_version = version.version
        log.info("registered %s version %s as %s", model_name, version.version, CHAMPION)
        return decision
    client.set_model_version_tag(model_name, version.version, PROMOTION_TAG, "lost")
    client.delete_model_version(model_name, version.version)
    decision.reason = (f"lost to a concurrent promotion: {decision.reason} (candidate v{version.version} "
                       "registered, then deleted)")
    log.info("promotion gate for %s: %s", model_name, decision.reason)
    return decision


def _wait_for_earlier_candidates(client, model_name: str, version: int, wait_seconds: float, poll_seconds: float,
                                 sleep: Callable[[float], None], clock: Callable[[], float]) -> None:
    """Until no version older than ours is pending; one pending longer than wait_seconds (its run died
    mid-gate) is tagged abandoned and no longer waited for."""
    deadline = clock() + wait_seconds
    while True:
        earlier = [v for v in client.search_model_versions(f"name = '{model_name}'")
                   if int(v.version) < version and v.tags.get(PROMOTION_TAG) == "pending"]
        if not earlier:
            return
        if clock() >= deadline:
            for stale in earlier:
                log.warning("candidate %s v%s has been pending for over %.0f s: treating it as abandoned",
                            model_name, stale.version, wait_seconds)
                client.set_model_version_tag(model_name, stale.version, PROMOTION_TAG, "abandoned")
            return
        log.info("waiting for earlier candidate(s) %s of %s to be decided", [v.version for v in earlier], model_name)
        sleep(poll_seconds)
