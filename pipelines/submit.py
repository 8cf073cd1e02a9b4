"""Submitting runs and schedules to a Kubeflow Pipelines backend, through the public ``kfp.Client`` only.

    python -m pipelines submit --config my-eks.yaml --host https://kfp.example.com --experiment retrain \\
        --trigger ci --idempotency-key "$GITHUB_RUN_ID" [--dry-run]
    python -m pipelines schedule --config my-eks.yaml --host … --name nightly --cron "0 0 2 * * *" [--disable] [--dry-run]

What the KFP UI then shows: the compiled pipeline is uploaded as a pipeline (named by its pipelineInfo) and one
pipeline version per content digest (sha256 of the compiled package); runs and recurring runs are created from
that version, in the run's experiment. The same code submitted again reuses its version. ``--dry-run`` prints
the exact run or recurring-run body (a kfp-server-api model, as ``kfp.Client`` builds it) without contacting
the server.

- submit is idempotent: the key becomes the run's display name and ``run.run_id``; when the experiment
  already has a run of that name, it is reported and nothing is submitted (a re-run CI job, a retried
  webhook).
- schedule creates the recurring run, or replaces one of the same name whose request differs (KFP has no
  update: the old one is disabled, then deleted, after the new one exists), or disables it. Cron is KFP's
  6-field format with seconds (robfig/cron), evaluated in UTC; it is validated before any call.

Authentication comes from the environment (``KF_PIPELINES_*``, ``--host``, an in-cluster ServiceAccount
token, or ``kfp.Client``'s credentials chain) — never from the repository. Multi-user KFP reviews a bearer
token for the audience ``pipelines.kubeflow.org`` and authorises each call as a verb on ``pipelines``,
``experiments``, ``runs`` or ``jobs`` (recurring runs) in the Profile namespace: manifests/base/rbac/ci.yaml.

Namespaces: multi-user KFP keeps pipelines, experiments, runs and recurring runs in a Profile namespace, and
runs the pipeline's pods there; ``kubernetes.kfp_mode=multi-user`` passes ``kubernetes.namespace`` (or
--namespace) to every call. Standalone KFP has one namespace of its own, and no namespace is passed (the
pipeline is then a shared one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kfp
import kfp_server_api
import requests
import urllib3
import yaml
from kfp import compiler

from pipelines.cron import validate_cron
from pipelines.pipeline import build_pipeline
from trainer.config import Config

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


def _server_message(err: Exception) -> str:
    """KFP's own words on a refused call (which verb on which resource, where), when it sent any."""
    try:
        return str(json.loads(getattr(err, "body", None) or "{}").get("message", ""))[:300]
    except (ValueError, AttributeError):
        return ""


def kfp_failure(err: Exception, host: str | None) -> str:
    """What went wrong talking to KFP, and what to check."""
    where = host or os.environ.get("KF_PIPELINES_ENDPOINT") or "the in-cluster KFP endpoint"
    status = getattr(err, "status", None)
    if status in (401, 403):
        said = _server_message(err)
        return (f"the KFP API at {where} refused the credentials ({status}{f': {said}' if said else ''}): set "
                "KF_PIPELINES_TOKEN to a token minted for the audience pipelines.kubeflow.org (kubectl create token "
                "... --audience=pipelines.kubeflow.org), or grant this identity the verb named "
                "(manifests/base/rbac/ci.yaml)")
    reason = str(getattr(err, "reason", None) or err).splitlines()[0][:300]
    return (f"cannot reach the KFP API at {where}: {reason}. Check --host (or KF_PIPELINES_ENDPOINT), that the "
            "endpoint is reachable from here (kubectl port-forward, VPN, the ingress) and that it serves /apis/v2beta1")


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


@dataclass(frozen=True)
class PipelineContent:
    """A compiled package as KFP keeps it: the pipeline (by name) and one version per content digest."""

    package: Path
    pipeline_name: str
    digest: str

    @property
    def version_name(self) -> str:
        return f"{self.pipeline_name}-{self.digest[:12]}"

    @property
    def description(self) -> str:
        """Also what finds the version again: KFP filters pipeline versions by description, and gives a new
        pipeline's first version the pipeline's own description (pipeline_upload_server.go, uploadPipeline)."""
        return f"content sha256:{self.digest}"


def pipeline_content(package: Path) -> PipelineContent:
    text = package.read_bytes()
    name = yaml.safe_load(text.split(b"\n---", 1)[0])["pipelineInfo"]["name"]
    return PipelineContent(package, name, hashlib.sha256(text).hexdigest())


def _equals(key: str, value: str) -> str:
    return json.dumps({"predicates": [{"key": key, "operation": "EQUALS", "string_value": value}]})


@dataclass(frozen=True)
class PipelineVersion:
    pipeline_id: str
    version_id: str
    uploaded: bool


def ensure_pipeline_version(client, content: PipelineContent, namespace: str | None) -> PipelineVersion:
    """The pipeline version of this content, uploaded once: a re-submission of the same code finds it.

    Multi-user KFP keeps the pipeline in the Profile namespace (authorised there as `pipelines`); standalone KFP
    shares it. Two submissions racing to upload the same content: the second gets 409 and finds the first's.
    """
    for attempt in range(2):
        found = client.list_pipelines(filter=_equals("display_name", content.pipeline_name), page_size=2,
                                      namespace=namespace).pipelines or []
        if len(found) > 1:
            raise SubmitError(f"KFP holds {len(found)} pipelines named {content.pipeline_name!r}"
                              f"{f' in namespace {namespace}' if namespace else ''}: delete the extra one")
        try:
            if not found:
                pipeline = client.upload_pipeline(str(content.package), pipeline_name=content.pipeline_name,
                                                  description=content.description, namespace=namespace)
                versions = client.list_pipeline_versions(pipeline.pipeline_id, page_size=1).pipeline_versions
                return PipelineVersion(pipeline.pipeline_id, versions[0].pipeline_version_id, uploaded=True)
            pipeline_id = found[0].pipeline_id
            versions = client.list_pipeline_versions(pipeline_id, page_size=1,
                                                     filter=_equals("description", content.description))
            if versions.pipeline_versions:
                return PipelineVersion(pipeline_id, versions.pipeline_versions[0].pipeline_version_id, uploaded=False)
            version = client.upload_pipeline_version(str(content.package), content.version_name,
                                                     pipeline_id=pipeline_id, description=content.description)
            return PipelineVersion(pipeline_id, version.pipeline_version_id, uploaded=True)
        except kfp_server_api.ApiException as err:
            if err.status != 409 or attempt:
                raise
    raise AssertionError("unreachable")


def run_request(*, experiment_id: str | None, display_name: str, params: dict[str, Any], version: PipelineVersion,
                service_account: str | None):
    """The body kfp.Client.run_pipeline sends for a run of a pipeline version (tests compare the two on the wire)."""
    return kfp_server_api.V2beta1Run(
        experiment_id=experiment_id, display_name=display_name,
        pipeline_version_reference=kfp_server_api.V2beta1PipelineVersionReference(
            pipeline_id=version.pipeline_id, pipeline_version_id=version.version_id),
        runtime_config=kfp_server_api.V2beta1RuntimeConfig(parameters=params), service_account=service_account)


RECURRING = dict(max_concurrency=1, no_catchup=True)


def _recurring_description(cron: str) -> str:
    return f"resilient-train on cron '{cron}' (UTC)"


def recurring_run_request(*, experiment_id: str | None, display_name: str, cron: str, params: dict[str, Any],
                          version: PipelineVersion, service_account: str | None, enabled: bool = True):
    """The body kfp.Client.create_recurring_run sends (tests compare the two on the wire)."""
    return kfp_server_api.V2beta1RecurringRun(
        experiment_id=experiment_id, display_name=display_name, description=_recurring_description(cron),
        pipeline_version_reference=kfp_server_api.V2beta1PipelineVersionReference(
            pipeline_id=version.pipeline_id, pipeline_version_id=version.version_id),
        runtime_config=kfp_server_api.V2beta1RuntimeConfig(parameters=params),
        mode=kfp_server_api.RecurringRunMode.ENABLE if enabled else kfp_server_api.RecurringRunMode.DISABLE,
        trigger=kfp_server_api.V2beta1Trigger(cron_schedule=kfp_server_api.V2beta1CronSchedule(cron=cron)),
        service_account=service_account, **RECURRING)


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
    return _equals("display_name", name)


def _dry_run(content: PipelineContent, namespace: str | None, request) -> dict[str, Any]:
    return {"action": "dry-run", "namespace": namespace, "pipeline": content.pipeline_name,
            "pipeline_version": content.version_name, "content_sha256": content.digest,
            "request": json.loads(as_json(request))}


def _placeholder_version(content: PipelineContent) -> PipelineVersion:
    return PipelineVersion(f"<id of pipeline {content.pipeline_name}>", f"<id of its version {content.description}>",
                           uploaded=False)


def submit(client, cfg: Config, *, experiment: str, trigger: str, key: str, service_account: str | None,
           dry_run: bool, namespace: str | None = None) -> dict[str, Any]:
    run_id = idempotency_key(key)
    params = pipeline_parameters(cfg, trigger, run_id)
    with tempfile.TemporaryDirectory() as scratch:
        content = pipeline_content(compile_package(cfg, Path(scratch)))
        if dry_run:
            request = run_request(experiment_id=f"<id of experiment {experiment}>", display_name=run_id,
                                  params=params, version=_placeholder_version(content), service_account=service_account)
            return _dry_run(content, namespace, request)
        experiment_id = _experiment_id(client, experiment, create=True, namespace=namespace)
        existing = client.list_runs(experiment_id=experiment_id, filter=_by_display_name(run_id), page_size=1,
                                    namespace=namespace).runs
        if existing:
            return {"action": "exists", "run_id": existing[0].run_id, "display_name": run_id}
        version = ensure_pipeline_version(client, content, namespace)
        response = client.run_pipeline(experiment_id, run_id, params=params, pipeline_id=version.pipeline_id,
                                       version_id=version.version_id, service_account=service_account)
        return {"action": "submitted", "run_id": response.run_id, "display_name": run_id,
                **_version_outcome(content, version)}


def _version_outcome(content: PipelineContent, version: PipelineVersion) -> dict[str, Any]:
    return {"pipeline_id": version.pipeline_id, "pipeline_version_id": version.version_id,
            "pipeline_version": "uploaded" if version.uploaded else "reused", "content_sha256": content.digest}


def schedule(client, cfg: Config, *, experiment: str, name: str, cron: str, service_account: str | None,
             disable: bool, dry_run: bool, namespace: str | None = None) -> dict[str, Any]:
    cron = validate_cron(cron)
    params = pipeline_parameters(cfg, "schedule")
    with tempfile.TemporaryDirectory() as scratch:
        content = pipeline_content(compile_package(cfg, Path(scratch)))
        if dry_run:
            request = recurring_run_request(experiment_id=f"<id of experiment {experiment}>", display_name=name,
                                            cron=cron, params=params, version=_placeholder_version(content),
                                            service_account=service_account, enabled=not disable)
            return _dry_run(content, namespace, request)
        experiment_id = _experiment_id(client, experiment, create=not disable, namespace=namespace)
        existing = []
        if experiment_id is not None:
            existing = client.list_recurring_runs(experiment_id=experiment_id, filter=_by_display_name(name),
                                                  page_size=10, namespace=namespace).recurring_runs or []
        if disable:
            for old in existing:
                client.disable_recurring_run(old.recurring_run_id)
            return {"action": "disabled", "recurring_runs": [old.recurring_run_id for old in existing]}
        version = ensure_pipeline_version(client, content, namespace)
        wanted = json.loads(as_json(recurring_run_request(experiment_id=experiment_id, display_name=name, cron=cron,
                                                          params=params, version=version,
                                                          service_account=service_account)))
        for old in existing:
            current = json.loads(as_json(old))
            if all(current.get(k) == wanted.get(k) for k in ("trigger", "runtime_config", "pipeline_version_reference",
                                                             "service_account", "mode")):
                return {"action": "unchanged", "recurring_run_id": old.recurring_run_id,
                        **_version_outcome(content, version)}
        created = client.create_recurring_run(experiment_id, name, description=_recurring_description(cron),
                                              cron_expression=cron, params=params, pipeline_id=version.pipeline_id,
                                              version_id=version.version_id, service_account=service_account,
                                              **RECURRING)
        for old in existing:  # replaced: stop the old one only once the new one exists
            client.disable_recurring_run(old.recurring_run_id)
            client.delete_recurring_run(old.recurring_run_id)
        return {"action": "replaced" if existing else "created", "recurring_run_id": created.recurring_run_id,
                "replaced": [old.recurring_run_id for old in existing], **_version_outcome(content, version)}
