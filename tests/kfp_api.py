"""A stand-in for the Kubeflow Pipelines API server (the backend cannot exist here), served over HTTP so that
the real ``kfp.Client`` talks to it unchanged.

What it holds to, from kubeflow/pipelines (backend/src/apiserver):
- every body is a kfp-server-api model: parsed strictly (a field the model lacks, or a wrong type, is a 400);
- multi-user mode authorises each call as (namespace, resource, verb) in the group pipelines.kubeflow.org, with
  the resource and verb of the server's own code (AUTHORIZED_AS below) and the namespace it derives: a run or
  recurring run in its experiment's, a pipeline version in its pipeline's; reads of shared pipelines (no
  namespace) are not authorised, writes to them are, in KFP's own namespace (pipeline_server.go,
  canAccessPipeline). A call the RBAC it is given does not grant is a 403, as a SubjectAccessReview would be;
- a bearer token is required when one is set (auth/authenticator_token_review.go);
- names are unique: a pipeline per namespace, a version per pipeline (409, as the upload server answers).
"""

from __future__ import annotations

import email.parser
import email.policy
import itertools
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlparse

import kfp_server_api
import yaml

KFP_NAMESPACE = "kubeflow"
# (method, path) -> (resource, verb) as the server authorises it. Sources, backend/src/apiserver/server/:
# experiment_server.go (listExperiments: list, createExperiment: create); pipeline_server.go (listPipelines,
# listPipelineVersions: pipelines list); pipeline_upload_server.go (uploadPipeline, uploadPipelineVersion: pipelines
# create); run_server.go (listRuns: list, createRun: create); job_server.go (recurring runs are `jobs`: listJobs,
# createJob, disableJob, deleteJob); resource and verb names from common/const.go.
AUTHORIZED_AS = [
    ("GET", r"/apis/v2beta1/healthz", None),
    ("GET", r"/apis/v2beta1/experiments", ("experiments", "list")),
    ("POST", r"/apis/v2beta1/experiments", ("experiments", "create")),
    ("GET", r"/apis/v2beta1/pipelines", ("pipelines", "list")),
    ("POST", r"/apis/v2beta1/pipelines/upload", ("pipelines", "create")),
    ("POST", r"/apis/v2beta1/pipelines/upload_version", ("pipelines", "create")),
    ("GET", r"/apis/v2beta1/pipelines/(?P<id>[^/]+)/versions", ("pipelines", "list")),
    ("GET", r"/apis/v2beta1/runs", ("runs", "list")),
    ("POST", r"/apis/v2beta1/runs", ("runs", "create")),
    ("GET", r"/apis/v2beta1/recurringruns", ("jobs", "list")),
    ("POST", r"/apis/v2beta1/recurringruns", ("jobs", "create")),
    ("POST", r"/apis/v2beta1/recurringruns/(?P<id>[^/:]+):disable", ("jobs", "disable")),
    ("DELETE", r"/apis/v2beta1/recurringruns/(?P<id>[^/:]+)", ("jobs", "delete")),
]
BODY_MODELS = {"experiments": "V2beta1Experiment", "runs": "V2beta1Run", "recurringruns": "V2beta1RecurringRun"}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _same(sent: Any, parsed: Any) -> bool:
    """Equal, where an int64 field (a string in the generated model) may be sent as a number: the proto3 JSON
    mapping the server decodes with accepts "either numbers or strings" for 64-bit integers."""
    if isinstance(sent, dict) and isinstance(parsed, dict):
        return sent.keys() == parsed.keys() and all(_same(sent[k], parsed[k]) for k in sent)
    if isinstance(sent, list) and isinstance(parsed, list):
        return len(sent) == len(parsed) and all(map(_same, sent, parsed))
    if isinstance(sent, int) and not isinstance(sent, bool) and isinstance(parsed, str):
        return parsed == str(sent)
    return sent == parsed


def strict(body: dict[str, Any], model: str) -> dict[str, Any]:
    """Parse as the generated client's model and refuse what would not survive the round trip."""
    api = kfp_server_api.ApiClient()
    parsed = api.deserialize(SimpleNamespace(data=json.dumps(body)), model)
    if not _same(body, api.sanitize_for_serialization(parsed)):
        raise ApiError(400, f"body is not a valid {model}: {json.dumps(body)[:300]}")
    return body


def matches(item: dict[str, Any], filter_json: str | None) -> bool:
    if not filter_json:
        return True
    for predicate in json.loads(filter_json)["predicates"]:
        assert predicate["operation"] in ("EQUALS", 1), predicate  # protobuf JSON: the enum's name or number
        if item.get(predicate["key"]) != predicate.get("string_value", predicate.get("stringValue")):
            return False
    return True


class FakeKfpApi:
    """Serves on 127.0.0.1; ``allowed`` (namespace, resource, verb) is the RBAC of the caller, None = all."""

    def __init__(self, *, multi_user: bool, token: str | None = None,
                 allowed: set[tuple[str, str, str]] | None = None):
        self.multi_user, self.token, self.allowed = multi_user, token, allowed
        self.experiments, self.pipelines, self.versions = {}, {}, {}
        self.runs, self.recurring = {}, {}
        self.authorized: list[tuple[str, str, str]] = []
        self.denied: list[tuple[str, str, str]] = []
        self.bodies: list[tuple[str, str, dict[str, Any]]] = []
        self.uploads: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeKfpApi":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}"

    # -- authorisation --------------------------------------------------------------------------------------
    def _authorize(self, namespace: str | None, resource: str, verb: str) -> None:
        if not self.multi_user:
            return
        if resource == "pipelines" and not namespace:
            if verb in ("get", "list"):
                return
            namespace = KFP_NAMESPACE
        if not namespace:
            raise ApiError(400, f"a {resource} call needs a namespace in multi-user mode")
        attributes = (namespace, resource, verb)
        if self.allowed is not None and attributes not in self.allowed:
            self.denied.append(attributes)
            raise ApiError(403, f"User cannot {verb} {resource} in namespace {namespace} (pipelines.kubeflow.org)")
        self.authorized.append(attributes)

    def _experiment_namespace(self, experiment_id: str | None) -> str | None:
        if experiment_id is None:
            return None
        if experiment_id not in self.experiments:
            raise ApiError(404, f"experiment {experiment_id} not found")
        return self.experiments[experiment_id].get("namespace")

    # -- dispatch -----------------------------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict[str, str], headers, raw: bytes) -> tuple[int, Any]:
        if self.token is not None and not path.endswith("/healthz") and \
                headers.get("Authorization") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthenticated: the bearer token is missing or not for this audience")
        for route_method, pattern, authorized_as in AUTHORIZED_AS:
            found = re.fullmatch(pattern, path)
            if route_method == method and found:
                break
        else:
            raise ApiError(404, f"no route {method} {path}")
        if authorized_as is None:
            return 200, {"multi_user": self.multi_user}
        resource, verb = authorized_as
        collection, body = path.rsplit("/", 1)[-1], None
        if method == "POST" and collection in BODY_MODELS:
            body = strict(json.loads(raw), BODY_MODELS[collection])
            self.bodies.append((method, collection, body))
        return getattr(self, f"_{resource}_{verb}")(query, body, raw, headers, **found.groupdict())

    def _experiments_list(self, query, body, raw, headers):
        namespace = query.get("namespace")
        self._authorize(namespace, "experiments", "list")
        found = [e for e in self.experiments.values() if e.get("namespace") == namespace
                 and matches(e, query.get("filter"))]
        return 200, {"experiments": found, "total_size": len(found)}

    def _experiments_create(self, query, body, raw, headers):
        self._authorize(body.get("namespace"), "experiments", "create")
        experiment = {**body, "experiment_id": self._id("exp")}
        self.experiments[experiment["experiment_id"]] = experiment
        return 200, experiment

    def _pipelines_list(self, query, body, raw, headers, id=None):
        if id is not None:  # the versions of one pipeline
            pipeline = self.pipelines[id]
            self._authorize(pipeline.get("namespace"), "pipelines", "list")
            found = [v for v in self.versions.values() if v["pipeline_id"] == id and matches(v, query.get("filter"))]
            found = found[:int(query.get("page_size", 10))]
            return 200, {"pipeline_versions": found, "total_size": len(found)}
        namespace = query.get("namespace")
        self._authorize(namespace, "pipelines", "list")
        found = [p for p in self.pipelines.values() if p.get("namespace") == namespace
                 and matches(p, query.get("filter"))]
        return 200, {"pipelines": found, "total_size": len(found)}

    def _uploaded(self, raw: bytes, headers) -> dict[str, Any]:
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            f"Content-Type: {headers['Content-Type']}\r\n\r\n".encode() + raw)
        files = {part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
                 for part in message.iter_parts()}
        assert set(files) == {"uploadfile"}, f"the upload form holds {sorted(files)}, not uploadfile"
        spec = yaml.safe_load(files["uploadfile"].split(b"\n---", 1)[0])
        assert spec["pipelineInfo"]["name"] and spec["schemaVersion"], "the upload is not a compiled pipeline"
        self.uploads.append(spec)
        return spec

    def _pipelines_create(self, query, body, raw, headers):
        path_is_version = "pipelineid" in query
        spec = self._uploaded(raw, headers)
        name, description = query["name"], query.get("description", "")
        if path_is_version:
            pipeline = self.pipelines[query["pipelineid"]]
            self._authorize(pipeline.get("namespace"), "pipelines", "create")
            return 200, self._new_version(pipeline, name, description, spec)
        namespace = query.get("namespace")
        self._authorize(namespace, "pipelines", "create")
        if any(p["display_name"] == name and p.get("namespace") == namespace for p in self.pipelines.values()):
            raise ApiError(409, "Failed to create a pipeline and a pipeline version")
        pipeline = {"pipeline_id": self._id("pipeline"), "name": name, "display_name": name,
                    "description": description, **({"namespace": namespace} if namespace else {})}
        self.pipelines[pipeline["pipeline_id"]] = pipeline
        self._new_version(pipeline, name, description, spec)  # the server names the first version after the pipeline
        return 200, pipeline

    def _new_version(self, pipeline, name: str, description: str, spec) -> dict[str, Any]:
        if any(v["pipeline_id"] == pipeline["pipeline_id"] and v["name"] == name for v in self.versions.values()):
            raise ApiError(409, "Failed to create a pipeline version")
        version = {"pipeline_id": pipeline["pipeline_id"], "pipeline_version_id": self._id("version"), "name": name,
                   "display_name": name, "description": description, "pipeline_spec": spec}
        self.versions[version["pipeline_version_id"]] = version
        return version

    def _listed(self, store, query, resource, key):
        experiment_id = query.get("experiment_id")
        namespace = self._experiment_namespace(experiment_id) if experiment_id else query.get("namespace")
        self._authorize(namespace, resource, "list")
        found = [item for item in store.values() if (experiment_id is None or item["experiment_id"] == experiment_id)
                 and matches(item, query.get("filter"))]
        return 200, {key: found[:int(query.get("page_size", 10))], "total_size": len(found)}

    def _created(self, store, body, resource, id_key):
        self._authorize(self._experiment_namespace(body.get("experiment_id")), resource, "create")
        reference = body.get("pipeline_version_reference") or {}
        if reference.get("pipeline_version_id") not in self.versions:
            raise ApiError(400, f"no pipeline version {reference}")
        item = {**body, id_key: self._id(id_key.split("_id")[0])}
        store[item[id_key]] = item
        return 200, item

    def _runs_list(self, query, body, raw, headers):
        return self._listed(self.runs, query, "runs", "runs")

    def _runs_create(self, query, body, raw, headers):
        return self._created(self.runs, body, "runs", "run_id")

    def _jobs_list(self, query, body, raw, headers):
        return self._listed(self.recurring, query, "jobs", "recurringRuns")  # the proto's json_name, as the client reads it

    def _jobs_create(self, query, body, raw, headers):
        return self._created(self.recurring, body, "jobs", "recurring_run_id")

    def _job(self, id: str, verb: str) -> dict[str, Any]:
        job = self.recurring[id]
        self._authorize(self._experiment_namespace(job["experiment_id"]), "jobs", verb)
        return job

    def _jobs_disable(self, query, body, raw, headers, id):
        self._job(id, "disable")["mode"] = "DISABLE"
        return 200, {}

    def _jobs_delete(self, query, body, raw, headers, id):
        self._job(id, "delete")
        del self.recurring[id]
        return 200, {}

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self):
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    with fake._lock:
                        status, payload = fake.handle(self.command, url.path, query, self.headers, raw)
                except ApiError as err:
                    status, payload = err.status, {"error": str(err), "code": err.status, "message": str(err)}
                except Exception as err:  # a request this stand-in cannot serve: the test sees why
                    status, payload = 500, {"error": f"{type(err).__name__}: {err}", "code": 500}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _serve

            def log_message(self, *args):
                pass

        return Handler
