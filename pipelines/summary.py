"""The CLI's summary of a pipeline run, printed after the console closes: the outcome, what it trained on, its
recoveries and stragglers, its MLflow run, and last the path of summary.json (for scripts)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from trainer.run.run_dir import RunDir


def print_summary(summary: dict, summary_path: Path, out: TextIO | None = None) -> None:
    """The CLI's final summary; its last line is the summary's path, for scripts."""
    def fmt(value, spec=".4f"):
        return "n/a" if value is None else format(value, spec)

    lines = [
        "",
        f"resilient-train run {summary['pipeline_run_id']}: {summary['status'].upper()}",
        f"  steps trained      {summary['steps_trained'] if summary['steps_trained'] is not None else 'n/a'}",
        f"  final train loss   {fmt(summary['final_train_loss'])}",
        f"  held-out loss      {fmt(summary['heldout_loss'])} (perplexity {fmt(summary['heldout_perplexity'], '.2f')})",
        f"  recovery events    {summary.get('recoveries', len(summary['recovery_events']))}"
        + (f" (goodput {summary['goodput']:.0%})" if summary.get("goodput") else "")
        + (f"; the last {len(summary['recovery_events'])} below, all in MLflow's recovery table"
           if summary.get("recoveries", 0) > len(summary["recovery_events"]) else ""),
        f"  checkpoint         {summary['checkpoint'] or 'n/a'}",
        f"  promotion          {_promotion_line(summary.get('promotion'))}",
        f"  MLflow run         {summary['mlflow_parent_run_id']} (experiment {summary['mlflow_experiment']})",
        f"  wall time          {summary.get('pipeline_wall_seconds', 0):.1f} s",
    ]
    lines += _inputs_lines((summary.get("steps") or {}).get("stage") or {})
    for event in summary["recovery_events"]:
        lines.append(f"    {event['fault_type']} on rank {event['fault_rank']} at step {event['fault_step']}: "
                     f"{event['mechanism']} restart, reloaded step {event['reloaded_step']} from {event['reload_source']}, "
                     f"{event['lost_steps']} steps lost, {_seconds(event['recovery_seconds'])} to the next step")
        for cause in [*event.get("earlier_causes", []), event.get("cause")]:
            if cause:
                lines.append(f"      cause: {cause}")
    stragglers = summary.get("straggler_events") or []
    lines.append(f"  stragglers         {_straggler_line(stragglers)}")
    if summary.get("mlflow_pending_records"):
        lines.append(f"  MLflow spool       {summary['mlflow_pending_records']} record(s) not delivered (tracking "
                     f"server unreachable): python -m pipelines mlflow-sync {summary['run_dir']}")
    if summary.get("mlflow_rejected_records"):
        lines.append(f"  MLflow refused     {summary['mlflow_rejected_records']} record(s) (see "
                     f"{RunDir(summary['run_dir']).rejected}): fix the cause, then python -m pipelines "
                     f"mlflow-sync {summary['run_dir']} --retry-rejected")
    for error in summary["errors"]:
        lines.append(f"  FAILED at {error['step']}: {error['error_type']}: {error['message']}")
    uri = summary["mlflow_tracking_uri"]
    if uri.startswith("sqlite:"):
        lines.append(f"  MLflow UI          mlflow ui --backend-store-uri {uri} --port 5000")
    lines.append(str(summary_path))
    print("\n".join(lines), file=out if out is not None else sys.stdout)


def _inputs_lines(stage: dict) -> list[str]:
    """What the run trained on: the corpus's tokens, the files of no document format left out, the base model."""
    if not stage.get("train_tokens"):
        return []
    unknown = stage.get("unknown_files", 0)
    lines = [f"  data               {stage['train_tokens']:,} train tokens from {stage['objects']} object(s)"
             + (f"; {unknown} file(s) of no document format skipped (data.unknown_files)" if unknown else "")]
    tokenizer = stage.get("tokenizer")  # the one the tokens are of (a stage of an earlier release: its models')
    for model in stage.get("models", []):
        if model["kind"] == "model" or tokenizer is None:
            identity = model.get("content_hash") or model.get("tokenizer_hash") or ""
            lines.append(f"  {'base model' if model['kind'] == 'model' else 'tokenizer':<18} {model['s3_uri']} "
                         f"(content hash {identity[:12]})")
    if tokenizer is not None:
        lines.append(f"  {'tokenizer':<18} {tokenizer['source']} (content hash {tokenizer['content_hash'][:12]})")
    return lines


def _straggler_line(stragglers: list[dict]) -> str:
    """One line per run: none, or each straggling rank with its node, first report, streaks and lowest score
    (trainer.run.history's summary of the straggler records)."""
    if not stragglers:
        return "none reported"
    return "; ".join(f"rank {s['straggler_rank']} on {s['node']} from step {s['step']} ({s['streaks']} streak(s)"
                     f"{', replaced' if s.get('replaced') else ''}, lowest: {s['score']:.2f} of the fastest rank's "
                     f"work, slowest in {s['section']})" for s in sorted(stragglers, key=lambda s: s["straggler_rank"]))


def _promotion_line(decision: dict | None) -> str:
    if not decision:
        return "n/a"
    if decision.get("new_version"):
        return f"registered as version {decision['new_version']} with alias champion ({decision['reason']})"
    return f"kept the champion: {decision['reason']}"


def _seconds(value) -> str:
    return "n/a" if value is None else f"{value:.1f} s"
