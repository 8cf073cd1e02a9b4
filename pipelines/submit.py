"""Submitting runs and schedules to a Kubeflow Pipelines backend.

    python -m pipelines submit --config my-eks.yaml --host https://kfp.example.com --experiment retrain \\
        --trigger ci --idempotency-key "$GITHUB_RUN_ID-$GITHUB_RUN_ATTEMPT" [--dry-run]
    python -m pipelines schedule --config my-eks.yaml --host … --name nightly --cron "0 0 2 * * *" [--disable] [--dry-run]

The request bodies are kfp-server-api models (``V2beta1Run``, ``V2beta1RecurringRun``), built here the way
``kfp.Client`` builds them; ``--dry-run`` prints the exact body as JSON without contacting the server.

- submit is idempotent: the key becomes the run's display name and ``run.run_id``; when the experiment
  already has a run of that name, it is reported and nothing is submitted (a re-run CI job, a retried
  webhook).
- schedule creates the recurring run, or replaces one of the same name whose request differs (KFP has no
  update: the old one is disabled, then deleted, after the new one exists), or disables it. Cron is KFP's
  6-field format with seconds (robfig/cron), evaluated in UTC; it is validated before any call.

Authentication comes from the environment (``KF_PIPELINES_*``, ``--host``, an in-cluster ServiceAccount
token, or ``kfp.Client``'s credentials chain) — never from the repository.

Namespaces: multi-user KFP keeps experiments, runs and recurring runs in a Profile namespace, and runs the
pipeline's pods there; ``kubernetes.kfp_mode=multi-user`` passes ``kubernetes.namespace`` (or --namespace)
to every call. Standalone KFP has one namespace of its own, and no namespace is passed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import kfp
import kfp_server_api
import requests
import urllib3
from kfp import compiler
from kfp.client.client import _extract_pipeline_yaml  # the parser kfp.Client itself uses (private, pinned kfp)

from pipelines.pipeline import build_pipeline
from trainer.config import Config

_CRON_FIELDS = [("second", 0, 59), ("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12),
                ("day of week", 0, 6)]
_NAMES = {4: ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"],
          5: ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"]}
_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


class SubmitError(ValueError):
    """A bad submission argument (cron, key, config); the message names it."""


class KfpUnavailable(RuntimeError):
    """The KFP API could not be reached or refused the credentials; the message says which host and what to check."""


def validate_name(name: str) -> str:
    if not name.strip():
        raise SubmitError("--name must not be empty: the recurring run is found again by this name")
    return name


def connect(host: str | None, namespace: str | None):
    """A kfp.Client (its constructor already calls the API's healthz), with failures as one clear line.

    Credentials from the environment only: KF_PIPELINES_TOKEN (a bearer token) or kfp.Client's own chain.
    """
    # urllib3 logs each retry of the healthz call and kfp warns about server versions: one line says it all.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module="kfp")
            return kfp.Client(host=host, namespace=namespace,
                              existing_token=os.environ.get("KF_PIPELINES_TOKEN") or None)
    except Exception as err:  # urllib3, requests, kfp_server_api and kfp all raise their own types here
        raise KfpUnavailable(kfp_failure(err, host)) from err


def is_unavailable(err: Exception) -> bool:
    """A failure to reach or to be let into the KFP API (not a bad request)."""
    if isinstance(err, (urllib3.exceptions.HTTPError, requests.exceptions.ConnectionError, ConnectionError)):
        return True
    return isinstance(err, kfp_server_api.ApiException) and err.status in (401, 403, 502, 503, 504)


def kfp_failure(err: Exception, host: str | None) -> str:
    """What went wrong talking to KFP, and what to check."""
    where = host or os.environ.get("KF_PIPELINES_ENDPOINT") or "the in-cluster KFP endpoint"
    status = getattr(err, "status", None)
    if status in (401, 403):
        return (f"the KFP API at {where} refused the credentials ({status}): set KF_PIPELINES_TOKEN to a valid "
                "token, or check the ServiceAccount / Profile access of this identity")
    reason = str(getattr(err, "reason", None) or err).splitlines()[0][:300]
    return (f"cannot reach the KFP API at {where}: {reason}. Check --host (or KF_PIPELINES_ENDPOINT), that the "
            "endpoint is reachable from here (kubectl port-forward, VPN, the ingress) and that it serves /apis/v2beta1")


def validate_cron(expression: str) -> str:
    """KFP's 6-field cron (seconds first) or a robfig descriptor; raises SubmitError naming the bad field."""
    expression = expression.strip()
    if expression in _DESCRIPTORS or re.fullmatch(r"@every \d+(ns|us|ms|s|m|h)(\d+(ns|us|ms|s|m|h))*", expression):
        return expression
    fields = expression.split()
    if len(fields) != 6:
        raise SubmitError(f"--cron {expression!r}: KFP takes 6 fields, seconds first "
                          f"(second minute hour day-of-month month day-of-week, e.g. '0 0 2 * * *'); got {len(fields)}")
    for index, (field, (name, low, high)) in enumerate(zip(fields, _CRON_FIELDS)):
        if field == "?" and index in (3, 5):
            continue
        for part in field.split(","):
            base, _, step = part.partition("/")
            if step and not (step.isdigit() and int(step) > 0):
                raise SubmitError(f"--cron {expression!r}: {name} step {step!r} must be a positive number")
            if base == "*":
                continue
            bounds = base.split("-")
            if len(bounds) > 2 or not all(bounds):
                raise SubmitError(f"--cron {expression!r}: {name} field {part!r} is not a value, range or */step")
            for bound in bounds:
                value = _NAMES.get(index, []).index(bound.upper()) + (1 if index == 4 else 0) \
                    if bound.upper() in _NAMES.get(index, []) else (int(bound) if bound.isdigit() else None)
                if value is None or not low <= value <= high:
                    raise SubmitError(f"--cron {expression!r}: {name} {bound!r} is outside {low}-{high}")
    return expression


def pipeline_parameters(cfg: Config, trigger: str, run_id: str | None = None) -> dict[str, Any]:
    overrides = [f"run.trigger={trigger}"] + ([f"run.run_id={run_id}"] if run_id else [])
    return {"config_json": cfg.to_json(), "overrides": overrides}


def idempotency_key(key: str) -> str:
    """The key as a run id: lowercase letters, digits and '-', at most 63 characters."""
    value = re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-")[:63].strip("-")
    if not value:
        raise SubmitError(f"--idempotency-key {key!r}: needs letters or digits (e.g. the CI run id)")
    return value


def compile_package(cfg: Config, directory: Path) -> Path:
    path = Path(directory) / "pipeline.yaml"
    compiler.Compiler().compile(build_pipeline(cfg), str(path))
    return path


def _pipeline_spec(package: Path) -> dict[str, Any]:
    return _extract_pipeline_yaml(str(package)).to_dict()


def run_request(package: Path, *, experiment_id: str | None, display_name: str, params: dict[str, Any],
                service_account: str | None):
    return kfp_server_api.V2beta1Run(
        experiment_id=experiment_id, display_name=display_name, pipeline_spec=_pipeline_spec(package),
        runtime_config=kfp_server_api.V2beta1RuntimeConfig(parameters=params), service_account=service_account)


def recurring_run_request(package: Path, *, experiment_id: str | None, display_name: str, cron: str,
                          params: dict[str, Any], service_account: str | None, enabled: bool = True):
    return kfp_server_api.V2beta1RecurringRun(
        experiment_id=experiment_id, display_name=display_name, pipeline_spec=_pipeline_spec(package),
        runtime_config=kfp_server_api.V2beta1RuntimeConfig(parameters=params),
        mode=kfp_server_api.RecurringRunMode.ENABLE if enabled else kfp_server_api.RecurringRunMode.DISABLE,
        description=f"resilient-train on cron '{cron}' (UTC)", no_catchup=True, max_concurrency="1",  # int64: a string in the API model
        trigger=kfp_server_api.V2beta1Trigger(cron_schedule=kfp_server_api.V2beta1CronSchedule(cron=cron)),
        service_account=service_account)


def as_json(request) -> str:
    """The body exactly as the generated API client serializes it onto the wire."""
    return json.dumps(kfp_server_api.ApiClient().sanitize_for_serialization(request), indent=2, sort_keys=True)


def kfp_namespace(cfg: Config, override: str | None = None) -> str | None:
    """The namespace to pass to KFP: --namespace, else the Profile namespace in multi-user mode, else none."""
    if override:
        return override
    return cfg.kubernetes.namespace if cfg.kubernetes.kfp_mode == "multi-user" else None


def _experiment_id(client, name: str, create: bool, namespace: str | None) -> str | None:
    try:
        return client.get_experiment(experiment_name=name, namespace=namespace).experiment_id
    except ValueError:  # kfp.Client raises ValueError for a missing experiment
        if not create:
            return None
        return client.create_experiment(name, namespace=namespace).experiment_id


def _by_display_name(name: str) -> str:
    return json.dumps({"predicates": [{"key": "display_name", "operation": "EQUALS", "string_value": name}]})


def submit(client, cfg: Config, *, experiment: str, trigger: str, key: str, service_account: str | None,
           dry_run: bool, namespace: str | None = None) -> dict[str, Any]:
    run_id = idempotency_key(key)
    params = pipeline_parameters(cfg, trigger, run_id)
    with tempfile.TemporaryDirectory() as scratch:
        package = compile_package(cfg, Path(scratch))
        if dry_run:
            request = run_request(package, experiment_id=f"<id of experiment {experiment}>", display_name=run_id,
                                  params=params, service_account=service_account)
            return {"action": "dry-run", "namespace": namespace, "request": json.loads(as_json(request))}
        experiment_id = _experiment_id(client, experiment, create=True, namespace=namespace)
        existing = client.list_runs(experiment_id=experiment_id, filter=_by_display_name(run_id), page_size=1,
                                    namespace=namespace).runs
        if existing:
            return {"action": "exists", "run_id": existing[0].run_id, "display_name": run_id}
        request = run_request(package, experiment_id=experiment_id, display_name=run_id, params=params,
                              service_account=service_account)
        response = client._run_api.run_service_create_run(run=request)  # the body printed by --dry-run, as is
        return {"action": "submitted", "run_id": response.run_id, "display_name": run_id}


def schedule(client, cfg: Config, *, experiment: str, name: str, cron: str, service_account: str | None,
             disable: bool, dry_run: bool, namespace: str | None = None) -> dict[str, Any]:
    cron = validate_cron(cron)
    params = pipeline_parameters(cfg, "schedule")
    with tempfile.TemporaryDirectory() as scratch:
        package = compile_package(cfg, Path(scratch))
        if dry_run:
            request = recurring_run_request(package, experiment_id=f"<id of experiment {experiment}>",
                                            display_name=name, cron=cron, params=params,
                                            service_account=service_account, enabled=not disable)
            return {"action": "dry-run", "namespace": namespace, "request": json.loads(as_json(request))}
        experiment_id = _experiment_id(client, experiment, create=not disable, namespace=namespace)
        existing = []
        if experiment_id is not None:
            existing = client.list_recurring_runs(experiment_id=experiment_id, filter=_by_display_name(name),
                                                  page_size=10, namespace=namespace).recurring_runs or []
        if disable:
            for old in existing:
                client.disable_recurring_run(old.recurring_run_id)
            return {"action": "disabled", "recurring_runs": [old.recurring_run_id for old in existing]}
        request = recurring_run_request(package, experiment_id=experiment_id, display_name=name, cron=cron,
                                        params=params, service_account=service_account)
        wanted = json.loads(as_json(request))
        for old in existing:
            current = json.loads(as_json(old))
            if all(current.get(k) == wanted.get(k) for k in ("trigger", "runtime_config", "pipeline_spec",
                                                             "service_account")) and current.get("mode") == "ENABLE":
                return {"action": "unchanged", "recurring_run_id": old.recurring_run_id}
        created = client._recurring_run_api.recurring_run_service_create_recurring_run(recurring_run=request)
        for old in existing:  # replaced: stop the old one only once the new one exists
            client.disable_recurring_run(old.recurring_run_id)
            client.delete_recurring_run(old.recurring_run_id)
        return {"action": "replaced" if existing else "created", "recurring_run_id": created.recurring_run_id,
                "replaced": [old.recurring_run_id for old in existing]}
