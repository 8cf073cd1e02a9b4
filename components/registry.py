"""The registered champion as the steps see it: the train step tells the training job which model to evaluate
against (<run dir>/eval/champion.json), the evaluate step's gate compares with it (components.evaluate.promotion)."""

from __future__ import annotations

import logging
from typing import Any

from mlflow.exceptions import MlflowException

from components.mlflow_server import is_outage
from trainer.run.run_dir import RunDir, write_json

log = logging.getLogger(__name__)

CHAMPION = "champion"


def champion_version(client, model_name: str):
    """The version with the champion alias, or None (no such model or alias yet)."""
    try:
        return client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def record_champion(client, model_name: str, run_dir) -> dict[str, Any] | None:
    """Write which champion the training's ranks evaluate the candidate against at the end (its export's URI),
    or remove an earlier launch's answer when there is none or the registry cannot be reached now (the gate then
    compares by the champion's recorded loss, or defers)."""
    path = RunDir(run_dir).champion
    try:
        version = champion_version(client, model_name)
    except Exception as err:  # noqa: BLE001 - an outage: the gate decides without it; anything else is raised
        if not is_outage(err):
            raise
        log.warning("MLflow unreachable: the training will not evaluate the champion of %s (%s)", model_name, err)
        version = None
    if version is None:
        path.unlink(missing_ok=True)
        return None
    champion = {"name": model_name, "version": str(version.version), "source": version.source}
    write_json(path, champion)
    log.info("the training evaluates champion %s v%s from %s at its end", model_name, version.version, version.source)
    return champion
