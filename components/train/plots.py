"""Plots of a training run, logged to MLflow as PNG artifacts (what a user would rather look at than read).

- loss.png: training loss per step (replayed steps included, in their last values) and held-out loss;
- throughput.png: tokens/s per step;
- checkpoint_stall.png: how long the training loop was blocked by each checkpoint save (worst rank);
- recovery_timeline.png: the step reached over wall time, with each fault and its recovery marked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _figure():
    # matplotlib inside: only plotting needs it, and its backend must be chosen before pyplot is imported
    import matplotlib

    matplotlib.use("Agg")  # no display in pipeline pods or CI
    import matplotlib.pyplot as plt  # after use("Agg")

    figure, axes = plt.subplots(figsize=(8, 4), dpi=100)
    return plt, figure, axes


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def training_plots(metrics: list[dict[str, float]], checkpoints: list[dict[str, float]], faults: list[dict[str, Any]],
                   recoveries: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    last = {int(m["step"]): m for m in metrics}  # a replayed step keeps its last record
    steps = sorted(last)

    plt, figure, axes = _figure()
    axes.plot(steps, [last[s]["loss"] for s in steps], label="training loss")
    axes.set(xlabel="step", ylabel="loss", title="Training loss")
    axes.grid(alpha=0.3)
    axes.legend()
    paths.append(_save(plt, figure, out_dir / "loss.png"))

    plt, figure, axes = _figure()
    axes.plot(steps, [last[s].get("tokens_per_second", 0.0) for s in steps])
    axes.set(xlabel="step", ylabel="tokens / s", title="Throughput")
    axes.grid(alpha=0.3)
    paths.append(_save(plt, figure, out_dir / "throughput.png"))

    plt, figure, axes = _figure()
    axes.bar([c["step"] for c in checkpoints], [c["checkpoint_blocking_seconds"] for c in checkpoints],
             width=max(1, (steps[-1] if steps else 1) / 100))
    axes.set(xlabel="step", ylabel="seconds the loop was blocked", title="Checkpoint stall per save")
    axes.grid(alpha=0.3)
    paths.append(_save(plt, figure, out_dir / "checkpoint_stall.png"))

    plt, figure, axes = _figure()
    if metrics:
        start = min(m["time"] for m in metrics)
        axes.plot([m["time"] - start for m in metrics], [m["step"] for m in metrics], ".", markersize=2,
                  label="step completed")
        for fault in faults:
            axes.axvline(fault["time"] - start, color="tab:red", alpha=0.6)
            axes.annotate(f"{fault['fault_type']}\n(rank {fault['rank']})", (fault["time"] - start, fault["step"]),
                          fontsize=7, color="tab:red")
        for recovery in recoveries:
            if recovery.get("recovery_seconds") and recovery.get("fault_time"):
                recovered_at = recovery["fault_time"] + recovery["recovery_seconds"] - start
                axes.axvspan(recovery["fault_time"] - start, recovered_at, color="tab:orange", alpha=0.2)
                axes.annotate(recovery["mechanism"], (recovered_at, recovery["first_step"]), fontsize=7,
                              color="tab:green")
    axes.set(xlabel="seconds since the first step", ylabel="step", title="Recovery timeline (faults in red, "
             "recovery windows shaded)")
    axes.grid(alpha=0.3)
    paths.append(_save(plt, figure, out_dir / "recovery_timeline.png"))
    return paths
