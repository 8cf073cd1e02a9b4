"""`python -m pipelines plan`: how often to checkpoint to each tier, and what each recovery configuration
keeps, from a run's measured costs or from flags (trainer.planning).

    python -m pipelines plan --nodes 8 --node-mtbf-hours 6335 --step-seconds 4.2 --checkpoint-stall-seconds 0.4 \\
        --checkpoint-background-seconds 25 --restart-seconds 17
    python -m pipelines plan --run-id 3f2a...  --nodes 1024                 # costs measured by a finished run
    python -m pipelines plan ... --format json                              # {interval_seconds, interval_steps, configurations}
    python -m pipelines plan ... --plot build/goodput-vs-nodes.png --simulate 10
    python -m pipelines plan --config pipelines/configs/eks-cpt.yaml --from-config --step-seconds 6 \
        --checkpoint-stall-seconds 1      # the save, reload and start-up costs the config's model implies

A flag overrides what the run measured, which overrides what the config implies (--from-config: the cluster's
size, and the FSx save, reload and base-model read times of the real model's size at kubernetes.fsx_throughput_mbps,
trainer.planning.model_size, with each GPU's memory estimate); what none gives takes the default of
trainer.planning.goodput.Costs (step time and checkpoint stall have none: give them or a run). Exit 2 with the field
named for a bad value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from trainer.planning.fsx import checkpoint_needs, smallest_persistent_2
from trainer.planning.goodput import CONFIGURATIONS, Costs, Plan, PlanError, make_plan
from trainer.planning.model_size import ModelSizeError, gib, gpu_memory_of, model_shape, throughput_seconds
from trainer.planning.simulate import FailureModel, simulate_many
from trainer.planning.survival import job_survival, pod_restart_budget, simulate_survival

# Llama 3 (Dubey et al. 2024): 419 unexpected interruptions in 54 days on 2,048 nodes of 8 GPUs.
LLAMA3_NODE_MTBF_HOURS = round(2048 * 54 * 24 / 419)
REQUIRED = ("step_seconds", "checkpoint_stall_seconds")
PLOT_NODES = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(Costs):
        if f.name in ("fault_mix", "scale_restarts"):
            continue
        flag = "--" + f.name.replace("_", "-")
        integer = f.name in ("nodes", "gpus_per_node", "replica_groups")
        parser.add_argument(flag, dest=f.name, type=int if integer else float, default=None,
                            help=f"Costs.{f.name}" + (f" (default {f.default})" if f.default is not dataclasses.MISSING
                                                      else ""))
    parser.add_argument("--fault-mix", help="share of faults per class, e.g. exception=0.15,process=0.4,node=0.4,rack=0.05")
    parser.add_argument("--run-id", help="read the costs a finished MLflow train run measured (its cost_* metrics)")
    parser.add_argument("--from-config", action="store_true",
                        help="take the cluster's size and the save/reload/start-up costs the config's model implies")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI for --run-id (default: the config's)")
    parser.add_argument("--configurations", help="comma-separated configurations to evaluate (default: all)")
    parser.add_argument("--format", default="text", choices=["text", "markdown", "json"])
    parser.add_argument("--plot", type=Path, help="write goodput against cluster size (PNG) here")
    parser.add_argument("--simulate", type=int, default=0, metavar="JOBS",
                        help="also simulate JOBS seeded jobs per configuration and report their mean goodput")
    parser.add_argument("--work-days", type=float, default=30.0,
                        help="the job's length in days: simulated work, and the restart budget's survival (default 30)")
    parser.add_argument("--distribution", default="exponential", choices=["exponential", "weibull"])
    parser.add_argument("--weibull-shape", type=float, default=0.7)
    parser.add_argument("--rack-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)


def parse_fault_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            mix[name.strip()] = float(value)
        except ValueError:
            raise PlanError(f"fault_mix (--fault-mix): {part!r} is not class=share") from None
    return mix


def costs_from_run(tracking_uri: str, run_id: str) -> dict[str, float]:
    """The cost_* metrics a train run logged (components.train.step.log_recovery), as Costs fields."""
    from mlflow.exceptions import MlflowException  # mlflow: 1.4 s to import, and only --run-id needs it
    from mlflow.tracking import MlflowClient

    try:
        run = MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
    except MlflowException as err:
        raise PlanError(f"run_id (--run-id): no MLflow run {run_id!r} at {tracking_uri}: {err.message}") from None
    found = {k.removeprefix("cost_"): v for k, v in run.data.metrics.items() if k.startswith("cost_")}
    if not found:
        raise PlanError(f"run_id (--run-id): run {run_id} has no cost_* metrics: pass the train step's run "
                        "(pipeline_step=train) of a run made by this version")
    return found


def costs_from_config(cfg) -> tuple[dict[str, float], list[str]]:
    """What the config's model and cluster imply (trainer.planning.model_size), and lines that say so: the state's
    write and read at the file system's throughput, the base model's read at a first start, and each GPU's memory."""
    try:
        shape = model_shape(cfg, cfg.dataset_dir)
    except ModelSizeError as err:
        raise PlanError(f"--from-config: {err}") from None
    t, throughput = cfg.training, cfg.kubernetes.fsx_throughput_mbps
    state = throughput_seconds(shape.state_bytes, throughput)
    costs = {"nodes": t.num_nodes, "gpus_per_node": t.nproc_per_node, "fsx_reload_seconds": state,
             "checkpoint_background_seconds": state}
    if cfg.model.init_from:
        costs["startup_seconds"] = throughput_seconds(1.1 * shape.weights_bytes, throughput)
    shard_ranks = t.num_nodes * t.nproc_per_node // t.replica_groups
    memory = gpu_memory_of(shape, cfg)
    source = f"config.json of {cfg.base_model_dir}" if cfg.model.init_from else f"preset {cfg.model.preset}"
    lines = [f"model: {shape.parameters / 1e9:.2f} B parameters ({source}); training state {gib(shape.state_bytes)}: "
             f"an FSx save or reload {state:.0f} s at {throughput:.0f} MB/s"
             + (f", the base model's first read {costs['startup_seconds']:.0f} s" if cfg.model.init_from else ""),
             f"each GPU holds about {gib(memory['total'])}: sharded state {gib(memory['sharded_state'])} (over "
             f"{shard_ranks} ranks), activations {gib(memory['activations'])} (checkpointing "
             f"{t.activation_checkpointing}), logits {gib(memory['logits'])} (one loss chunk), gathered layers "
             f"{gib(memory['gathered_layers'])}"
             + (f", gradients accumulated unsharded in {t.mixed_precision_reduce} over {t.grad_accum_steps} "
                f"micro-batches {gib(memory['accumulated_gradients'])}" if memory["accumulated_gradients"] else "")]
    return costs, lines


def fsx_sizing(cfg, step_seconds: float, plan: Plan) -> tuple[dict[str, Any], list[str]]:
    """The FSx file system the config's checkpoints need (trainer.planning.fsx) against the configured one: the
    figures, and lines that say so. The interval: checkpoint.interval_steps, or (auto) the recommended plan's."""
    k, c = cfg.kubernetes, cfg.checkpoint
    shape = model_shape(cfg, cfg.dataset_dir)
    fsx_tier = plan.recommended["tiers"].get("fsx") or {}
    interval_steps = c.interval_steps if c.interval_steps != "auto" else fsx_tier.get("interval_steps", 1)
    base_bytes = 1.1 * shape.weights_bytes if cfg.model.init_from else 0.0
    need_bytes, need_mbps = checkpoint_needs(shape.state_bytes, c.keep_last, interval_steps * step_seconds, base_bytes)
    smallest = smallest_persistent_2(need_bytes, need_mbps)
    enough = k.fsx_storage_gib * 2**30 >= need_bytes and k.fsx_throughput_mbps >= need_mbps
    figures = {"checkpoint_bytes": shape.state_bytes, "interval_steps": interval_steps,
               "interval_seconds": interval_steps * step_seconds, "needed_bytes": need_bytes,
               "needed_mbps": need_mbps, "smallest_persistent_2": dataclasses.asdict(smallest),
               "configured": {"deployment_type": k.fsx_deployment_type, "storage_gib": k.fsx_storage_gib,
                              "per_unit_throughput": k.fsx_per_unit_throughput, "throughput_mbps": k.fsx_throughput_mbps},
               "enough": enough, "durable_copy": "s3" if c.s3_uri else k.fsx_deployment_type}
    tier = f" at {k.fsx_per_unit_throughput} MB/s/TiB" if k.fsx_deployment_type == "PERSISTENT_2" else ""
    lines = [f"FSx: a {shape.state_bytes / 1e9:.1f} GB checkpoint every {interval_steps} steps ({interval_steps * step_seconds:.0f} s) "
             f"written at half the throughput within its interval needs >= {need_mbps:.0f} MB/s; keep_last "
             f"{c.keep_last} + 1 being written{' + the base model' if base_bytes else ''}: >= {need_bytes / 1e9:.0f} GB "
             f"-> the smallest PERSISTENT_2: {smallest.storage_gib} GiB at {smallest.per_unit_mbps_per_tib} MB/s/TiB "
             f"({smallest.throughput_mbps:.0f} MB/s)",
             f"configured: {k.fsx_deployment_type} {k.fsx_storage_gib} GiB{tier}, {k.fsx_throughput_mbps:.0f} MB/s: "
             + ("enough" if enough else "NOT enough (saves queue behind each other, or the folder fills): set "
                f"kubernetes.fsx_deployment_type=PERSISTENT_2, fsx_storage_gib={smallest.storage_gib}, "
                f"fsx_per_unit_throughput={smallest.per_unit_mbps_per_tib}")]
    if not c.s3_uri and k.fsx_deployment_type == "SCRATCH_2":
        lines.append("the job's only durable copy is on SCRATCH_2 (one copy, lost with a file server): set "
                     "checkpoint.s3_uri, or PERSISTENT_2")
    return figures, lines


def build_costs(args: argparse.Namespace, measured: dict[str, float], implied: dict[str, float] | None = None
                ) -> Costs:
    names = {f.name for f in dataclasses.fields(Costs)} - {"fault_mix", "scale_restarts"}
    values = {k: v for k, v in (implied or {}).items() if k in names}
    values.update({k: v for k, v in measured.items() if k in names})
    values.setdefault("nodes", 8)
    values.setdefault("node_mtbf_hours", LLAMA3_NODE_MTBF_HOURS)
    values.update({k: getattr(args, k) for k in names if getattr(args, k) is not None})
    if isinstance(values.get("nodes"), float) and values["nodes"].is_integer():
        values["nodes"] = int(values["nodes"])
    missing = [k for k in REQUIRED if k not in values]
    if missing:
        raise PlanError("; ".join(f"{k} (--{k.replace('_', '-')}): not measured by a run (--run-id) and not given"
                                  for k in missing))
    if args.fault_mix:
        values["fault_mix"] = parse_fault_mix(args.fault_mix)
    return Costs(**values)


def _simulated(plan: Plan, args: argparse.Namespace) -> dict[str, dict]:
    failures = FailureModel(args.distribution, args.weibull_shape, args.rack_size)
    by_name = {c.name: c for c in CONFIGURATIONS}
    out = {}
    for config in plan.configurations:
        intervals = {t: c["interval_seconds"] for t, c in config["tiers"].items()}
        out[config["name"]] = simulate_many(plan.costs, by_name[config["name"]], intervals, args.work_days * 86400,
                                            seeds=args.simulate, seed=args.seed, failures=failures)
    return out


def goodput_by_cluster_size(costs: Costs, nodes: list[int], names: list[str] | None = None) -> dict[str, list[float]]:
    """Expected goodput of each configuration at each cluster size (intervals re-chosen for each)."""
    curves: dict[str, list[float]] = {}
    for n in nodes:
        for config in make_plan(dataclasses.replace(costs, nodes=n), names).configurations:
            curves.setdefault(config["name"], []).append(config["goodput"])
    return curves


def replica_groups_pay_from(costs: Costs) -> int | None:
    """The smallest cluster size (of PLOT_NODES, from 2) where the replica-groups configuration keeps more than
    every other one; None when it never does up to the largest."""
    for nodes in PLOT_NODES:
        plan = make_plan(dataclasses.replace(costs, nodes=nodes))
        if plan.recommended["name"] == "replica_groups":
            return nodes
    return None


def plot_goodput(costs: Costs, path: Path, names: list[str] | None = None) -> Path:
    import matplotlib  # plotting only when asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, values in goodput_by_cluster_size(costs, PLOT_NODES, names).items():
        axes.plot(PLOT_NODES, [100 * v for v in values], marker="o", label=name)
    axes.set(xscale="log", xlabel="nodes", ylabel="expected goodput (%)",
             title=f"node MTBF {costs.node_mtbf_hours:.0f} h, step {costs.step_seconds:.2f} s")
    axes.set_xticks(PLOT_NODES, [str(n) for n in PLOT_NODES], rotation=45)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def _interval(config: dict[str, Any], tier: str) -> str:
    found = config["tiers"].get(tier)
    if found is None:
        return "—"
    return f"{found['interval_steps']} steps ({found['interval_seconds']:.0f} s)"


def restart_budget(costs: Costs, days: float, simulate_jobs: int = 0, seed: int = 0) -> dict[str, Any]:
    """The chance that a job of `days` survives its restart budget: fixed counts against the no-progress rule
    (trainer.planning.survival), and the JobSet maxRestarts that covers its pod-level faults. A recovery
    advances the state once restarted, reloaded from node memory and one step on."""
    recovery = costs.restart_seconds + costs.memory_reload_seconds + costs.step_seconds
    budget = job_survival(costs, days, recovery)
    budget["jobset_max_restarts"] = pod_restart_budget(costs, days)
    if simulate_jobs:
        budget["simulated"] = {
            "fixed": {b: simulate_survival(costs, days, recovery, ("fixed", b), simulate_jobs, seed) for b in budget["fixed"]},
            "by_progress": {limit: simulate_survival(costs, days, recovery, ("progress", limit), simulate_jobs, seed)
                            for limit in budget["by_progress"]}}
    return budget


def _budget_lines(budget: dict[str, Any]) -> list[str]:
    simulated = budget.get("simulated", {})

    def share(kind: str, key: int) -> str:
        value = budget[kind][key]
        text = f"{value:.2%}" if value < 0.9999 else f"1 - {1 - value:.1e}"
        return text + (f" (simulated {simulated[kind][key]:.2%})" if simulated else "")

    return ["", f"restart budget over {budget['days']:g} days ({budget['expected_faults']:.1f} faults expected; a "
                f"recovery fails to progress with p = {budget['no_progress_probability']:.2e}):",
            "  survival with a fixed count of restarts: " + ", ".join(f"{b}: {share('fixed', b)}" for b in budget["fixed"]),
            "  survival by progress (max_restarts_without_progress): "
            + ", ".join(f"{limit}: {share('by_progress', limit)}" for limit in budget["by_progress"]),
            f"  JobSet maxRestarts covering the pod-level faults (node, rack) with 99.9 %: {budget['jobset_max_restarts']}"]


def render_plan(plan: Plan, fmt: str, simulated: dict[str, dict] | None = None,
                budget: dict[str, Any] | None = None) -> str:
    payload = plan.to_json()
    if simulated:
        for config in payload["configurations"]:
            config["simulated"] = simulated[config["name"]]
    if budget is not None:
        payload["restart_budget"] = budget
    pays_from = replica_groups_pay_from(plan.costs)
    payload["replica_groups_pay_from_nodes"] = pays_from
    if fmt == "json":
        return json.dumps(payload, indent=2, default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else v)
    c = plan.costs
    lines = [f"{c.nodes} nodes, node MTBF {c.node_mtbf_hours:.0f} h -> a fault every {c.job_mtbf_seconds / 3600:.2f} h; "
             f"step {c.step_seconds:.3g} s; FSx save: stall {c.checkpoint_stall_seconds:.3g} s, background "
             f"{c.checkpoint_background_seconds:.3g} s",
             f"recommended: {plan.recommended['name']}, FSx every {plan.interval_steps} steps "
             f"({plan.interval_seconds:.0f} s)", ""]
    header = ["configuration", "expected goodput", *(["simulated"] if simulated else []), "FSx interval",
              "memory interval", "save", "load", "restart", "lost work"]
    rows = []
    for config in payload["configurations"]:
        fsx = "fsx" if "fsx" in config["tiers"] else "fsx_sync"
        b = config["badput"]
        rows.append([config["name"], f"{config['goodput']:.2%}",
                     *([f"{simulated[config['name']]['goodput']:.2%}"] if simulated else []),
                     _interval(config, fsx), _interval(config, "memory"), f"{b['checkpoint_save']:.2%}",
                     f"{b['checkpoint_load']:.2%}", f"{b['infrastructure_recovery']:.2%}", f"{b['wasted_progress']:.2%}"])
    if fmt == "markdown":
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines += ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    lines.append(f"replica groups (R={c.replica_groups}: a fault restarts its group only) keep the most goodput from "
                 f"{pays_from} nodes" if pays_from else f"replica groups (R={c.replica_groups}) never keep the most "
                 f"goodput up to {PLOT_NODES[-1]} nodes with these costs")
    if budget is not None:
        lines += _budget_lines(budget)
    return "\n".join(lines)


def plan_command(args: argparse.Namespace, tracking_uri: str, cfg=None) -> str:
    """The plan as text/markdown/JSON; raises PlanError naming the field for a bad input. cfg: the config, whose
    model and cluster --from-config takes the costs from."""
    measured = costs_from_run(args.tracking_uri or tracking_uri, args.run_id) if args.run_id else {}
    implied, model_lines = costs_from_config(cfg) if args.from_config else ({}, [])
    costs = build_costs(args, measured, implied)
    names = [n.strip() for n in args.configurations.split(",")] if args.configurations else None
    plan = make_plan(costs, names)
    fsx, fsx_lines = fsx_sizing(cfg, costs.step_seconds, plan) if args.from_config else ({}, [])
    model_lines = [*model_lines, *fsx_lines]
    simulated = _simulated(plan, args) if args.simulate > 0 else None
    if args.plot:
        plot_goodput(costs, args.plot, names)
    budget = restart_budget(costs, args.work_days, args.simulate, args.seed)
    rendered = render_plan(plan, args.format, simulated, budget)
    if args.format == "json" and model_lines:
        return json.dumps({**json.loads(rendered), "model": model_lines, "fsx": fsx}, indent=2)
    return "\n".join([*model_lines, rendered]) if model_lines else rendered
