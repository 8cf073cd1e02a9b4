"""Command line: run the pipeline locally, or compile it for a KFP backend.

    python -m pipelines run --config local                          # the whole pipeline on this machine
    python -m pipelines run --config local --training.num_steps=50  # with overrides
    python -m pipelines run --config local -v                       # every task's output streamed here too
    python -m pipelines stage --config local                        # the stage step alone (pre-warm FSx)
    python -m pipelines compile --config local -o pipeline.yaml     # KFP IR YAML
    python -m pipelines mlflow-sync work/fsx/runs/RUN_ID             # deliver records spooled in an outage
    python -m pipelines compare --last 5 --format markdown          # runs side by side, from MLflow
    python -m pipelines plan --nodes 8 --step-seconds 4 --checkpoint-stall-seconds 0.5   # checkpoint intervals
    python -m pipelines submit --config my-eks.yaml --idempotency-key KEY [--dry-run]    # a run on KFP
    python -m pipelines schedule --config my-eks.yaml --name nightly --cron "0 0 2 * * *" [--dry-run]

``run`` starts the embedded stack (S3 server on loopback, MLflow sqlite store, a folder as the FSx
mount), runs every step through KFP's local runner, writes ``summary.json`` in the run folder and prints
its path as the last line. The console shows one line per step and a training progress bar; everything the
runner and the tasks print is in ``<run folder>/logs/pipeline.log`` (``-v`` streams it here as well).
Exit code 0 when the pipeline succeeded, 1 when a step failed, 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

from kfp import compiler

from components.context import tracker
from components.mlflow_server import TrackingUnavailable
from pipelines import submit as kfp_submit
from pipelines.cron import CronError
from pipelines.compare import compare_runs, comparison_plot, render
from pipelines.summary import print_summary
from pipelines.local_run import STAGE_ERRORS, run_locally, stage_locally
from pipelines.pipeline import build_pipeline
from pipelines.plan import __doc__ as plan_doc
from pipelines.plan import add_arguments as add_plan_arguments
from pipelines.plan import plan_command
from trainer.config import Config, ConfigError, load_config
from trainer.config.rules import InputError
from trainer.observe import logs
from trainer.planning.goodput import PlanError
from trainer.run.run_dir import RunDir


def stage_command(cfg: Config) -> int:
    """The stage step alone (pre-warming FSx, or trying a dataset): 0 staged, 2 the inputs are unusable (a bad base
    model, tokenizer or corpus: the message names the field or file), 1 another failure."""
    try:
        staged, manifest = stage_locally(cfg)
    except STAGE_ERRORS as err:
        print(f"error: stage failed: {err}", file=sys.stderr)
        return 2 if isinstance(err, InputError) else 1
    for model in staged["models"]:
        print(f"staged {model['s3_uri']} ({model['kind']}) into {model['dir']}: {model['object_count']} objects, "
              f"{model['bytes']} bytes, {model['downloaded']} downloaded"
              + (f", {model['parameters'] / 1e6:.1f} M parameters, content hash {model['content_hash']}"
                 if model["kind"] == "model" else ""))
    print(f"staged {staged['s3_uri']} ({staged['mode']} mode) into {staged['data_dir']}: {staged['objects']} "
          f"objects, {staged['bytes']} bytes, {staged['downloaded']} downloaded, {staged['skipped']} key(s) skipped, "
          f"{staged['unknown_files']} file(s) of no document format skipped, "
          f"{staged['train_tokens']} train / {staged['val_tokens']} held-out tokens")
    print(manifest)  # last line: the manifest's path, for scripts
    return 0


def _submit_or_schedule(args: argparse.Namespace, cfg: Config) -> int:
    """Every argument is checked before a client exists: a bad cron never waits on a network."""
    try:
        if args.command == "submit":
            kfp_submit.idempotency_key(args.idempotency_key)
        else:
            kfp_submit.validate_cron(args.cron)
            kfp_submit.validate_name(args.name)
    except (kfp_submit.SubmitError, CronError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    namespace = kfp_submit.kfp_namespace(cfg, args.namespace)
    common = dict(experiment=args.experiment or cfg.run.experiment, namespace=namespace,
                  service_account=args.service_account or cfg.kubernetes.pipeline_service_account, dry_run=args.dry_run)
    try:
        # kfp.Client prints its UI links; stdout carries only the outcome's JSON.
        with contextlib.redirect_stdout(sys.stderr):
            client = None if args.dry_run else kfp_submit.connect(args.host, namespace)
            if args.command == "submit":
                outcome = kfp_submit.submit(client, cfg, trigger=args.trigger, key=args.idempotency_key, **common)
            else:
                outcome = kfp_submit.schedule(client, cfg, name=args.name, cron=args.cron, disable=args.disable,
                                              **common)
    except (kfp_submit.SubmitError, CronError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except kfp_submit.KfpUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # the API calls after connecting can fail the same ways
        if not kfp_submit.is_unavailable(err):
            raise
        print(f"error: {kfp_submit.kfp_failure(err, args.host)}", file=sys.stderr)
        return 1
    print(json.dumps(outcome, indent=2))
    return 0


def mlflow_sync(run_dir: Path, overrides: list[str]) -> int:
    """Deliver a run's spooled MLflow records; 0 once everything is in MLflow, 1 while records are still
    spooled (server down) or refused. --retry-rejected first sends the refused ones again."""
    retry = "--retry-rejected" in overrides
    overrides = [o for o in overrides if o != "--retry-rejected"]
    config_path = RunDir(run_dir).config
    if not config_path.is_file():
        print(f"error: {config_path} not found: pass the run folder (work/fsx/runs/RUN_ID)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(str(config_path), overrides)  # e.g. --mlflow.tracking_uri=… if the server moved
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    mlflow = tracker(cfg)
    before = mlflow.pending()
    reachable = mlflow.flush()
    if reachable and retry:
        try:
            mlflow.retry_rejected()
        except TrackingUnavailable:
            reachable = False
    left, refused = mlflow.pending(), mlflow.rejected()
    print(f"{max(0, before - left)} spooled record(s) delivered to {cfg.tracking_uri}, {left} left"
          + ("" if reachable else " (tracking server unreachable: run this again later)"))
    if refused:
        print(f"{refused} record(s) refused by the tracking server, listed with its answers in "
              f"{mlflow.rejected_path}: fix the cause, then run this again with --retry-rejected")
    return 0 if reachable and not left and not refused else 1


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="local",
                        help="YAML config path or bundled name (default: local); "
                             "add --section.key=value to override any field")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the whole pipeline locally (kfp.local)")
    _add_config_arguments(run)
    run.add_argument("-v", "--verbose", action="store_true",
                     help="stream every task's full output here too (it always goes to <run folder>/logs/pipeline.log)")
    stage = commands.add_parser("stage", help="run the stage step alone: S3 -> the FSx path, tokenized")
    _add_config_arguments(stage)
    compile_ = commands.add_parser("compile", help="compile the pipeline to KFP IR YAML")
    _add_config_arguments(compile_)
    compile_.add_argument("-o", "--output", required=True, type=Path, help="where to write the YAML")
    compare = commands.add_parser("compare", help="compare pipeline runs recorded in MLflow")
    _add_config_arguments(compare)
    compare.add_argument("--experiment", help="MLflow experiment (default: the config's run.experiment)")
    compare.add_argument("--tracking-uri", help="MLflow tracking URI (default: the config's)")
    compare.add_argument("--last", type=int, default=10, help="the N most recent runs (default 10)")
    compare.add_argument("--filter", default="", help="an extra MLflow search filter, e.g. \"tags.trigger = 'ci'\"")
    compare.add_argument("--format", default="table", choices=["table", "csv", "json", "markdown"])
    compare.add_argument("--plot", type=Path, help="also write a comparison plot (PNG) here")
    plan = commands.add_parser("plan", help="checkpoint interval per tier and goodput per recovery configuration",
                               description=plan_doc,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_arguments(plan)
    add_plan_arguments(plan)
    for name, help_text in (("submit", "submit one run to a KFP backend (idempotent)"),
                            ("schedule", "create, replace or disable a recurring run on a KFP backend")):
        sub = commands.add_parser(name, help=help_text)
        _add_config_arguments(sub)
        sub.add_argument("--host", help="KFP API endpoint (default: kfp.Client's: in-cluster or KF_PIPELINES_ENDPOINT)")
        sub.add_argument("--namespace", help="KFP namespace (default: kubernetes.namespace when "
                                             "kubernetes.kfp_mode=multi-user; none for standalone KFP)")
        sub.add_argument("--experiment", help="KFP experiment (default: the config's run.experiment)")
        sub.add_argument("--service-account", help="ServiceAccount of the run's pods "
                                                   "(default: kubernetes.pipeline_service_account)")
        sub.add_argument("--dry-run", action="store_true", help="print the request body as JSON; send nothing")
        if name == "submit":
            sub.add_argument("--idempotency-key", required=True,
                             help="unique per logical submission, e.g. \"$GITHUB_RUN_ID-$GITHUB_RUN_ATTEMPT\"; a second "
                                  "submit with the same key does nothing")
            sub.add_argument("--trigger", default="manual", choices=["manual", "ci", "schedule"])
        else:
            sub.add_argument("--name", required=True, help="the recurring run's name")
            sub.add_argument("--cron", default="0 0 2 * * *",
                             help="6-field cron with seconds, UTC (default: daily at 02:00:00)")
            sub.add_argument("--disable", action="store_true", help="disable the recurring run of that name")
    sync = commands.add_parser("mlflow-sync", help="deliver MLflow records spooled while the server was down")
    sync.add_argument("run_dir", type=Path, help="the run folder (holds config.yaml and mlflow-spool/)")
    sync.add_argument("--retry-rejected", action="store_true",
                      help="also send the records the server refused again (after fixing the cause)")

    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    logs.configure(logging.INFO)
    unknown = [o for o in overrides if not o.startswith("--") or "=" not in o]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides look like --section.key=value)")
    if args.command == "mlflow-sync":
        return mlflow_sync(args.run_dir, overrides + (["--retry-rejected"] if args.retry_rejected else []))
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    if args.command == "compare":
        try:
            rows = compare_runs(args.tracking_uri or cfg.tracking_uri, args.experiment or cfg.run.experiment,
                                last=args.last, filter_string=args.filter)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(render(rows, args.format))
        if args.plot:
            comparison_plot(rows, args.plot)
            print(args.plot, file=sys.stderr)
        return 0

    if args.command == "plan":
        try:
            print(plan_command(args, cfg.tracking_uri, cfg))
        except PlanError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0

    if args.command in ("submit", "schedule"):
        return _submit_or_schedule(args, cfg)

    if args.command == "stage":
        return stage_command(cfg)

    if args.command == "compile":
        args.output.parent.mkdir(parents=True, exist_ok=True)
        compiler.Compiler().compile(build_pipeline(cfg), str(args.output))
        print(args.output)
        return 0

    summary = run_locally(cfg, verbose=args.verbose)
    print_summary(summary, RunDir(cfg.run_dir).summary)
    if summary["status"] == "succeeded":
        return 0
    return 2 if any(error.get("input_error") for error in summary["errors"]) else 1
