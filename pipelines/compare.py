"""Compare pipeline runs from MLflow: a table of the parent runs and a plot.

    python -m pipelines compare                                   # the last 10 runs of the local store
    python -m pipelines compare --last 5 --format markdown
    python -m pipelines compare --filter "tags.trigger = 'ci'" --plot build/compare.png
    python -m pipelines compare --tracking-uri http://mlflow:5000 --experiment resilient-train --format csv

Reads MLflow's search API only (the parent runs tagged ``pipeline_step = 'pipeline'``). Config differences
are the parameters whose values differ among the runs shown (run ids and paths left out).
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import Any

from trainer.planning.measured import BADPUT_CATEGORIES

BADPUT = [c for c in BADPUT_CATEGORIES if c != "other"]
COLUMNS = ["run", "started", "status", "trigger", "config_differences", "goodput", *(f"badput_{b}" for b in BADPUT),
           "recoveries", "lost_steps", "checkpoint_stall_s", "final_train_loss", "heldout_loss", "promoted"]
_NOT_CONFIG = ("run.run_id", "run.work_dir", "data.fsx_root", "checkpoint.dir", "mlflow.", "local.")


def compare_runs(tracking_uri: str, experiment: str, *, last: int = 10, filter_string: str = "") -> list[dict[str, Any]]:
    from mlflow.tracking import MlflowClient  # mlflow: 1.4 s to import, and only this command needs it

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ValueError(f"no MLflow experiment {experiment!r} at {tracking_uri}: check --experiment / --tracking-uri")
    query = "tags.pipeline_step = 'pipeline'" + (f" and {filter_string}" if filter_string else "")
    runs = client.search_runs([found.experiment_id], filter_string=query, order_by=["attributes.start_time DESC"],
                              max_results=last)
    differing = set()
    keys = {k for run in runs for k in run.data.params if not k.startswith(_NOT_CONFIG) and k not in _NOT_CONFIG}
    for key in keys:
        if len({run.data.params.get(key) for run in runs}) > 1:
            differing.add(key)
    rows = []
    for run in runs:
        metrics, tags = run.data.metrics, run.data.tags
        rows.append({
            "run": run.info.run_name,
            "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime(run.info.start_time / 1000)),
            "status": run.info.status,
            "trigger": tags.get("trigger", ""),
            "config_differences": " ".join(f"{k}={run.data.params.get(k)}" for k in sorted(differing)),
            "goodput": metrics.get("goodput"),
            **{f"badput_{b}": metrics.get(f"badput_{b}") for b in BADPUT},
            "recoveries": metrics.get("recoveries"),
            "lost_steps": metrics.get("lost_steps"),
            "checkpoint_stall_s": metrics.get("checkpoint_stall_mean_seconds"),
            "final_train_loss": metrics.get("final_train_loss"),
            "heldout_loss": metrics.get("heldout_loss"),
            "promoted": tags.get("promoted", ""),
        })
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render(rows: list[dict[str, Any]], fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: _cell(row.get(k)) for k in COLUMNS} for row in rows)
        return out.getvalue()
    cells = [[_cell(row.get(c)) for c in COLUMNS] for row in rows]
    if fmt == "markdown":
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines)
    if fmt != "table":
        raise ValueError(f"--format {fmt!r}: use table, csv, json or markdown")
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def comparison_plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Held-out loss and goodput per run, oldest first."""
    # matplotlib inside: only plotting needs it, and its backend must be chosen before pyplot is imported
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg")

    rows = list(reversed(rows))
    names = [row["run"] for row in rows]
    figure, (loss_axes, goodput_axes) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    loss_axes.bar(names, [row["heldout_loss"] or 0 for row in rows],
                  color=["tab:green" if row["promoted"] == "true" else "tab:blue" for row in rows])
    loss_axes.set(title="Held-out loss (green: promoted)", ylabel="loss")
    goodput_axes.bar(names, [row["goodput"] or 0 for row in rows])
    goodput_axes.set(title="Goodput", ylabel="productive / wall", ylim=(0, 1))
    for axes in (loss_axes, goodput_axes):
        axes.tick_params(axis="x", labelrotation=45, labelsize=7)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return Path(path)
