"""The promotion gate: a candidate replaces the registered champion only when it is measurably better.

    decision = decide(candidate_loss, champion_loss, threshold)      # pure: unit-tested
    promote_if_better(client, record=..., ...)                        # the registry side

The champion is the model version carrying the alias ``champion`` in the MLflow Model Registry. The gate loads no
weights: the training's ranks evaluated the candidate and the champion on the same held-out windows at the end of
training (trainer.evaluate.evaluator; the record: <run dir>/eval/step-N.json), and exported the candidate to
eval.export_uri. A version's tags keep its own loss and the fingerprint of the windows it was measured on, so a
champion that changed since (another run promoted) is compared by its recorded loss when the windows are the same,
and the decision is deferred when they are not (the run's job evaluates it when run again). A champion whose export
is gone is promoted over or kept according to eval.champion_missing, and the reason says so.

A promoted candidate is registered from its export's URI (the registry records it; the weights never pass through
the tracking server), linked to the LoggedModel of its checkpoint (``model_id``; the LoggedModel's
``mlflow.modelVersions`` tag, as mlflow.register_model sets it), and given the alias.

Concurrent runs: the registry has no compare-and-set on aliases, but it numbers versions atomically. So a
candidate that beats the champion it first saw registers itself (tag ``promotion=pending``) and is decided
only after every earlier pending version has been, against the champion *at that moment*. Decisions are thereby
serialised in version order: two runs can never both take the alias on the strength of the same old champion. A
loser tags its version ``lost``, deletes it, and says so.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from components.registry import CHAMPION, champion_version

log = logging.getLogger(__name__)

PROMOTION_TAG = "promotion"  # pending -> champion | lost | abandoned
WINDOWS_TAG = "eval_windows"  # the held-out windows' fingerprint the version's heldout_loss was measured on


def loss_tag(loss: float) -> str:
    """A version's heldout_loss tag: the loss exactly (repr round-trips a float). Rounded (6 decimals, as before),
    a later candidate with the very same loss beat it whenever the rounding went up: 3.26912784576416 < 3.269128."""
    return repr(float(loss))


@dataclass
class GateDecision:
    promote: bool
    reason: str
    candidate_loss: float
    champion_loss: float | None = None
    champion_version: str | None = None
    threshold: float = 0.0
    new_version: str | None = None
    export_uri: str | None = None

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


def champion_evidence(current, record: dict[str, Any]) -> tuple[float | None, str | None, bool]:
    """The champion's held-out loss on the candidate's windows: the training ranks' evaluation when they evaluated
    this version, else the version's own recorded loss when it was measured on the same windows. Returns (loss,
    why there is none, whether its files are gone)."""
    evaluated = record.get("champion") or {}
    if str(evaluated.get("version")) == str(current.version):
        if evaluated.get("heldout_loss") is not None:
            return float(evaluated["heldout_loss"]), None, False
        return None, evaluated.get("error") or "its evaluation failed", bool(evaluated.get("files_gone"))
    if current.tags.get(WINDOWS_TAG) == record["windows"] and current.tags.get("heldout_loss") is not None:
        return float(current.tags["heldout_loss"]), None, False
    return None, (f"champion v{current.version} was not evaluated on this candidate's held-out windows (registered "
                  "after this training started, from other data): run the pipeline again, whose training is "
                  "complete, so its job only evaluates"), False


def decide_against(current, record: dict[str, Any], threshold: float, champion_missing: str) -> GateDecision:
    """The decision against the champion `current` (a registry version, or None) on the record's evidence."""
    candidate_loss = record["candidate"]["heldout_loss"]
    if current is None:
        return decide(candidate_loss, None, threshold)
    loss, why, files_gone = champion_evidence(current, record)
    if loss is not None:
        return decide(candidate_loss, loss, threshold, current.version)
    if files_gone:
        promote = champion_missing == "promote"
        outcome = "promoted on the candidate's own evaluation" if promote else "the candidate is refused"
        return GateDecision(promote, f"champion v{current.version} cannot be evaluated, its export is gone ({why}): "
                                     f"{outcome} (eval.champion_missing={champion_missing})",
                            candidate_loss, None, current.version, threshold)
    return GateDecision(False, f"deferred: {why}", candidate_loss, None, current.version, threshold)


def promote_if_better(client, *, model_name: str, threshold: float, record: dict[str, Any], run_id: str,
                      model_id: str | None, tags: dict[str, str], champion_missing: str = "promote",
                      wait_seconds: float = 1800.0, poll_seconds: float = 2.0,
                      sleep: Callable[[float], None] = time.sleep,
                      clock: Callable[[], float] = time.monotonic) -> GateDecision:
    """Compare with the champion and, if better, register the candidate from its export's URI and alias it
    (serialised with concurrent candidates; see the module docstring)."""
    current = champion_version(client, model_name)
    decision = decide_against(current, record, threshold, champion_missing)
    log.info("promotion gate for %s: %s — %s", model_name, "candidate" if decision.promote else "keep champion",
             decision.reason)
    if not decision.promote:
        return decision

    try:
        client.create_registered_model(model_name, description="Llama-architecture models trained by resilient-train")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = record["export"]["uri"]
    version = client.create_model_version(
        model_name, source=source, run_id=run_id, model_id=model_id, description=decision.reason,
        tags={**tags, "heldout_loss": loss_tag(record["candidate"]["heldout_loss"]), WINDOWS_TAG: record["windows"],
              **({"model_id": model_id} if model_id else {}), PROMOTION_TAG: "pending"})
    if model_id:
        _link_logged_model(client, model_id, model_name, version.version)
    decision.export_uri = source
    _wait_for_earlier_candidates(client, model_name, int(version.version), wait_seconds, poll_seconds, sleep, clock)

    latest = champion_version(client, model_name)
    if (latest.version if latest else None) != (current.version if current else None):
        log.info("the champion moved to v%s while this candidate was registered: comparing again", latest.version)
        decision = decide_against(latest, record, threshold, champion_missing)
        decision.export_uri = source
    if decision.promote:
        client.set_registered_model_alias(model_name, CHAMPION, version.version)  # before the tag: see the wait
        client.set_model_version_tag(model_name, version.version, PROMOTION_TAG, "champion")
        decision.new_version = version.version
        log.info("registered %s version %s (%s) as %s", model_name, version.version, source, CHAMPION)
        return decision
    client.set_model_version_tag(model_name, version.version, PROMOTION_TAG, "lost")
    client.delete_model_version(model_name, version.version)
    decision.reason = (f"lost to a concurrent promotion: {decision.reason} (candidate v{version.version} "
                       "registered, then deleted)")
    log.info("promotion gate for %s: %s", model_name, decision.reason)
    return decision


def _link_logged_model(client, model_id: str, model_name: str, version: str) -> None:
    """The LoggedModel lists the versions registered from it, as mlflow.register_model records it."""
    model = client.get_logged_model(model_id)
    versions = json.loads(model.tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    if any(v["name"] == model_name and str(v["version"]) == str(version) for v in versions):
        return  # a tracking server links it itself (mlflow/store/tracking/abstract_store.py)
    versions.append({"name": model_name, "version": version})
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(versions)})


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
