"""The checkpoint-interval planner (trainer.planning.goodput), its simulator (trainer.planning.simulate) and
`python -m pipelines plan`.

The closed form is checked against the simulator where the closed form is exact: Daly (2006), "A higher order
estimate of the optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), eq. 8
(expected wall time of a job under exponential failures, failures during restarts and saves included) — one
fault class, one synchronous tier. Elsewhere the planner is first order in (fault rate × cost), like Young's
1974 derivation, so the two must agree within a fraction of a point at realistic rates.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from trainer.planning.scale import process_group_seconds, restart_world_seconds

from pipelines.cli import main
from trainer.planning.goodput import (CONFIGURATIONS, Configuration, Costs, PlanError, best_interval, daly_goodput,
                                      daly_interval, evaluate, expected_goodput, make_plan, young_interval)
from trainer.planning.simulate import FailureModel, simulate, simulate_many

BY_NAME = {c.name: c for c in CONFIGURATIONS}
ONE_TIER = Configuration("one", "every fault relaunches from a synchronous FSx save",
                         {c: ("job_relaunch", "fsx_sync") for c in ("exception", "process", "node", "rack")})
SEED_SETTING = dict(step_seconds=4.0, checkpoint_stall_seconds=0.5, checkpoint_background_seconds=20.0,
                    fsx_reload_seconds=30.0, memory_stall_seconds=0.2)


def _intervals(config: dict) -> dict[str, float]:
    return {tier: chosen["interval_seconds"] for tier, chosen in config["tiers"].items()}


def test_simulation_agrees_with_dalys_exact_goodput():
    costs = Costs(nodes=100, node_mtbf_hours=100, step_seconds=1.0, checkpoint_stall_seconds=30.0,
                  sync_stall_seconds=30.0, fsx_reload_seconds=60.0, job_restart_seconds=240.0,
                  fault_mix={"process": 1.0})
    mtbf = costs.job_mtbf_seconds  # one hour: a fault every ~8 segments, far from the first-order regime
    tau = daly_interval(30.0, mtbf)
    exact = daly_goodput(tau, 30.0, 300.0, mtbf)
    simulated = simulate_many(costs, ONE_TIER, {"fsx_sync": tau}, 200 * 86400, seeds=20)
    assert abs(simulated["goodput"] - exact) < max(0.004, 4 * simulated["standard_error"])
    # The first-order planner is close even here (within a point), and Daly's interval beats its neighbours.
    assert abs(expected_goodput(costs, ONE_TIER, {"fsx_sync": tau})["goodput"] - exact) < 0.01
    assert exact > daly_goodput(tau / 2, 30.0, 300.0, mtbf) and exact > daly_goodput(tau * 2, 30.0, 300.0, mtbf)


@pytest.mark.parametrize("name", [c.name for c in CONFIGURATIONS])
def test_planner_and_simulation_agree_for_every_configuration_at_1024_nodes(name):
    costs = Costs(nodes=1024, node_mtbf_hours=5000, **SEED_SETTING)
    planned = evaluate(costs, BY_NAME[name])
    simulated = simulate_many(costs, BY_NAME[name], _intervals(planned), 20 * 86400, seeds=6)
    assert abs(simulated["goodput"] - planned["goodput"]) < 0.005, (planned, simulated)


def test_an_async_copy_is_usable_only_once_its_background_write_ends():
    """A fault during the write reloads the copy before: both model and simulation lose τ/2 + b, not τ/2."""
    costs = Costs(nodes=1024, node_mtbf_hours=2000, step_seconds=1.0, checkpoint_stall_seconds=0.2,
                  checkpoint_background_seconds=120.0, fsx_reload_seconds=30.0, fault_mix={"process": 1.0})
    config = BY_NAME["async+ft_launcher"]
    planned = evaluate(costs, config)
    simulated = simulate_many(costs, config, _intervals(planned), 20 * 86400, seeds=6)
    assert abs(simulated["goodput"] - planned["goodput"]) < 0.004, (planned, simulated)
    assert planned["badput"]["wasted_progress"] > 120.0 / costs.job_mtbf_seconds


def test_more_layers_keep_more_goodput_and_async_beats_sync():
    plan = make_plan(Costs(nodes=1024, node_mtbf_hours=5000, **SEED_SETTING))
    goodput = {c["name"]: c["goodput"] for c in plan.configurations}
    assert goodput["sync+relaunch"] < goodput["async+relaunch"] < goodput["async+ft_launcher"]
    assert goodput["async+ft_launcher"] < goodput["async+ft_launcher+memory+peer"]
    assert plan.recommended["name"] in ("async+ft_launcher+memory+peer", "in_process+ft_launcher+memory+peer",
                                        "replica_groups")
    # With no per-step quorum to pay, a fault that stops only its replica group keeps the most at 1,024 nodes.
    free = make_plan(Costs(nodes=1024, node_mtbf_hours=5000, **{**SEED_SETTING, "quorum_seconds": 0.0}))
    assert free.recommended["name"] == "replica_groups"
    # A bigger cluster fails more often: shorter intervals, lower goodput.
    small = make_plan(Costs(nodes=8, node_mtbf_hours=5000, **SEED_SETTING))
    assert small.interval_seconds > plan.interval_seconds and small.recommended["goodput"] > plan.recommended["goodput"]


def test_young_and_daly_intervals():
    assert young_interval(10.0, 20000.0) == pytest.approx(math.sqrt(2 * 10 * 20000))
    # Daly's correction is small when the save is short against the MTBF, and M itself when the save is long.
    assert daly_interval(10.0, 20000.0) == pytest.approx(young_interval(10.0, 20000.0) - 10, rel=0.02)
    assert daly_interval(50000.0, 20000.0) == 20000.0


def test_a_background_write_longer_than_the_interval_is_paid_as_stall():
    costs = Costs(nodes=1024, node_mtbf_hours=500, step_seconds=1.0, checkpoint_stall_seconds=0.1,
                  checkpoint_background_seconds=300.0, fault_mix={"process": 1.0})
    tier = costs.tier("fsx")
    rate = 1 / costs.job_mtbf_seconds
    # Young on the stall alone says ~72 s; saving that often would wait ~228 s per save for the previous write.
    assert young_interval(0.1, 1 / rate) < 100
    chosen = best_interval(tier, rate, 86400.0)["interval_seconds"]
    assert chosen >= 300.0
    config = BY_NAME["async+relaunch"]
    at_young = expected_goodput(costs, config, {"fsx": young_interval(0.1, 1 / rate)})
    assert expected_goodput(costs, config, {"fsx": chosen})["goodput"] > at_young["goodput"]
    # The simulator sees the same wait.
    waited = simulate(costs, config, {"fsx": 72.0}, 86400.0, seed=3)
    assert waited["badput"]["checkpoint_save"] > 0.5


def test_simulation_is_seeded_and_deterministic():
    costs = Costs(nodes=256, node_mtbf_hours=2000, **SEED_SETTING)
    config = BY_NAME["in_process+ft_launcher+memory+peer"]
    intervals = _intervals(evaluate(costs, config))
    for failures in (FailureModel(), FailureModel("weibull", weibull_shape=0.6, rack_size=4)):
        first = simulate(costs, config, intervals, 5 * 86400, seed=11, failures=failures)
        assert first == simulate(costs, config, intervals, 5 * 86400, seed=11, failures=failures)
        assert first != simulate(costs, config, intervals, 5 * 86400, seed=12, failures=failures)
        assert sum(first["badput"].values()) + first["goodput"] == pytest.approx(1.0)


def test_rack_faults_take_the_peer_replica_with_them():
    costs = Costs(nodes=64, node_mtbf_hours=200, **{**SEED_SETTING, "fault_mix": {"rack": 1.0}})
    config = BY_NAME["async+ft_launcher+memory+peer"]
    result = simulate(costs, config, {"memory": 4.0, "fsx": 400.0}, 5 * 86400, seed=1)
    # Nodes replaced as for one node lost (docs/node-loss.md), but both copies gone: every rank reads FSx.
    assert result["faults"]["rack"] > 10 and set(result["recoveries"]) == {"replacement"}
    node_only = simulate(dataclasses.replace(costs, fault_mix={"node": 1.0}), config,
                         {"memory": 4.0, "fsx": 400.0}, 5 * 86400, seed=1)
    assert set(node_only["recoveries"]) == {"replacement"} and node_only["goodput"] > result["goodput"]
    # The wait for a machine is the lever warm spares pull: a new instance's 10 minutes cost goodput.
    no_spare = simulate(dataclasses.replace(costs, fault_mix={"node": 1.0}, spare_wait_seconds=600.0), config,
                        {"memory": 4.0, "fsx": 400.0}, 5 * 86400, seed=1)
    assert no_spare["goodput"] < node_only["goodput"]
    assert costs.restart("replacement") == (costs.restart_seconds + costs.replacement_seconds + costs.spare_wait_seconds
                                            + restart_world_seconds(64, costs.gpus_per_node))


def test_a_trace_replays_faults_at_given_steps_once_each():
    costs = Costs(nodes=2, node_mtbf_hours=1.0, step_seconds=1.0, checkpoint_stall_seconds=0.0,
                  sync_stall_seconds=0.5, fsx_reload_seconds=1.0, job_restart_seconds=10.0)
    result = simulate(costs, ONE_TIER, {"fsx_sync": 5.0}, 40.0, trace=[(12, "process"), (31, "exception")])
    assert result["faults"] == {"exception": 1, "process": 1, "node": 0, "rack": 0}
    # 40 steps + 8 saves of 0.5 s + 2 relaunches (10 s + 1 s reload) + the replayed steps (12-10, 31-30).
    assert result["wall_seconds"] == pytest.approx(40 + 8 * 0.5 + 2 * 11 + 2 + 1)


@pytest.mark.parametrize("bad, field", [
    (dict(nodes=0), "nodes (--nodes)"),
    (dict(node_mtbf_hours=-1.0), "node_mtbf_hours (--node-mtbf-hours)"),
    (dict(step_seconds=float("nan")), "step_seconds (--step-seconds)"),
    (dict(checkpoint_stall_seconds=-0.5), "checkpoint_stall_seconds (--checkpoint-stall-seconds)"),
    (dict(fault_mix={"process": 0.5}), "fault_mix (--fault-mix): shares must sum to 1"),
    (dict(fault_mix={"cosmic": 1.0}), "fault_mix (--fault-mix): unknown classes"),
])
def test_bad_costs_are_rejected_with_the_field_named(bad, field):
    values = dict(nodes=8, node_mtbf_hours=1000.0, **SEED_SETTING)
    with pytest.raises(PlanError, match=field.replace("(", r"\(").replace(")", r"\)")):
        Costs(**{**values, **bad})


def test_bad_simulation_settings_are_rejected_with_the_field_named():
    costs = Costs(nodes=8, node_mtbf_hours=1000.0, **SEED_SETTING)
    with pytest.raises(PlanError, match=r"weibull_shape \(--weibull-shape\)"):
        FailureModel("weibull", weibull_shape=0.0)
    with pytest.raises(PlanError, match=r"distribution \(--distribution\)"):
        FailureModel("gamma")
    with pytest.raises(PlanError, match=r"intervals\['fsx'\]"):
        simulate(costs, BY_NAME["async+relaunch"], {}, 1000.0)
    with pytest.raises(PlanError, match="work_seconds"):
        simulate(costs, BY_NAME["async+relaunch"], {"fsx": 10.0}, -1.0)
    with pytest.raises(PlanError, match=r"configurations \(--configurations\)"):
        make_plan(costs, ["fastest"])


FLAGS = ["plan", "--nodes", "8", "--node-mtbf-hours", "6335", "--step-seconds", "4.2", "--checkpoint-stall-seconds",
         "0.4", "--checkpoint-background-seconds", "25", "--restart-seconds", "17"]


def test_plan_command_prints_one_json_object(capsys, tmp_path):
    assert main([*FLAGS, "--format", "json", "--plot", str(tmp_path / "goodput.png"), "--simulate", "2",
                 "--work-days", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["interval_steps"] == round(plan["interval_seconds"] / 4.2) and plan["interval_steps"] >= 1
    assert {c["name"] for c in plan["configurations"]} == {c.name for c in CONFIGURATIONS}
    assert all(0 < c["goodput"] <= 1 and 0 < c["simulated"]["goodput"] <= 1 for c in plan["configurations"])
    assert plan["costs"]["restart_seconds"] == 17.0 and plan["costs"]["nodes"] == 8
    assert (tmp_path / "goodput.png").stat().st_size > 10_000


def test_plan_command_text_and_errors(capsys):
    assert main([*FLAGS, "--configurations", "sync+relaunch,async+ft_launcher"]) == 0
    out = capsys.readouterr().out
    assert "recommended: async+ft_launcher" in out and "sync+relaunch" in out and "async+relaunch " not in out
    assert main(["plan", "--nodes", "8", "--checkpoint-stall-seconds", "1"]) == 2
    assert "step_seconds (--step-seconds): not measured by a run (--run-id) and not given" in capsys.readouterr().err
    assert main([*FLAGS[:-2], "--restart-seconds", "-3"]) == 2
    assert "restart_seconds (--restart-seconds): must be >= 0" in capsys.readouterr().err
    assert main([*FLAGS, "--fault-mix", "exception=half"]) == 2
    assert "fault_mix (--fault-mix): 'exception=half' is not class=share" in capsys.readouterr().err


def test_interval_steps_auto_in_the_config():
    from trainer.config import ConfigError, load_config
    from trainer.planning.auto import job_configuration

    cfg = load_config("local")
    assert cfg.checkpoint.interval_steps == "auto"  # the demo's choice
    assert load_config("local", ["--checkpoint.interval_steps=25"]).checkpoint.interval_steps == 25
    with pytest.raises(ConfigError, match="checkpoint.interval_steps: expected an integer, got 'often'"):
        load_config("local", ["--checkpoint.interval_steps=often"])
    with pytest.raises(ConfigError, match="checkpoint.interval_steps: must be >= 1 or auto"):
        load_config("local", ["--checkpoint.interval_steps=0"])
    with pytest.raises(ConfigError, match="checkpoint.auto_node_mtbf_hours: must be > 0"):
        load_config("local", ["--checkpoint.auto_node_mtbf_hours=0"])
    # The job's layers decide which faults the FSx interval has to cover.
    assert job_configuration(cfg).routes == {"exception": ("ft_launcher", "memory"), "process": ("ft_launcher", "memory"),
                                             "node": ("replacement", "peer"), "rack": ("replacement", "fsx")}
    plain = load_config("local", ["--checkpoint.memory_interval_steps=0", "--checkpoint.mode=sync",
                                  "--resilience.max_restarts=0"])
    assert set(job_configuration(plain).routes.values()) == {("job_relaunch", "fsx_sync")}


def test_the_node_memory_copy_is_made_as_often_as_its_cost_and_the_faults_it_serves_make_worth_it():
    from trainer.config import ConfigError, load_config
    from trainer.planning.auto import memory_interval

    def steps(cfg, nodes, step, copy):
        return memory_interval(cfg, nodes, step, copy)["interval_steps"]

    demo = load_config("local", ["--faults.schedule="])  # two "nodes" failing every 3 minutes each
    assert demo.checkpoint.memory_interval_steps == "auto"
    # bench/overhead.py's tiny preset: a copy is ~9 % of a 0.26 s step; a fault every 90 s replays half an interval
    chosen = memory_interval(demo, 2, 0.26, 0.024)
    k = chosen["interval_steps"]
    assert 4 <= k <= 12, chosen
    # it is Daly's optimum: its waste (copies + replayed work) is below every step's and below twice the interval
    waste = lambda n: 0.024 / (n * 0.26) + chosen["fault_rate_per_second"] * n * 0.26 / 2  # noqa: E731
    assert waste(k) < waste(1) and waste(k) <= waste(2 * k) and waste(k) <= waste(max(1, k // 2))
    assert "a fault replays" in chosen["reason"] and "2 nodes x MTBF 0.05 h" in chosen["reason"]

    assert steps(demo, 2, 0.26, 0.0) == 1  # a copy too cheap to measure: every step
    assert steps(demo, 2, 0.26, 0.1) > k  # a dearer copy, less often
    assert steps(demo, 64, 0.26, 0.024) < k  # more nodes, more faults: more often
    # the drills' faults count: a SIGKILL every 4 steps makes every step's copy worth it
    assert steps(load_config("local", ["--faults.mtbf_steps=4"]), 2, 0.26, 0.024) < k
    assert steps(load_config("local", ["--faults.schedule=sigkill@5,sigkill@9,sigkill@13",
                                       "--training.num_steps=16"]), 2, 0.26, 0.024) == 1
    # faults the copies never serve (torchrun relaunches the job from FSx): at most once, at the end
    relaunch = load_config("local", ["--faults.schedule=", "--resilience.launcher=torchrun",
                                     "--resilience.max_restarts=0"])
    assert steps(relaunch, 2, 0.26, 0.024) == relaunch.training.num_steps
    # the 8B job: 16 nodes of Llama 3's fleet, a 5 ms wait for the async copy of a 8.8 s step
    eks = load_config("eks-cpt")
    assert eks.checkpoint.memory_interval_steps == "auto"
    assert 1 < steps(eks, 16, 8.8, 0.005) < eks.training.num_steps
    assert steps(eks, 1024, 8.8, 0.005) < steps(eks, 16, 8.8, 0.005)
    with pytest.raises(ConfigError, match="checkpoint.memory_interval_steps: must be >= 0 .0 turns it off. or auto"):
        load_config("local", ["--checkpoint.memory_interval_steps=-2"])


def test_a_write_in_flight_survives_an_exception_but_not_a_process_death():
    """trainer.job.cli closes a trainer that raised with its save waited for (the process is alive); a killed
    process, or an in-process restart (peers may be gone), drops it. Found by the goodput bench's calibration:
    without this rule the simulation lost 10 steps where the run lost none."""
    costs = Costs(nodes=2, node_mtbf_hours=1.0, step_seconds=1.0, checkpoint_stall_seconds=0.1,
                  checkpoint_background_seconds=3.0, fsx_reload_seconds=1.0, restart_seconds=2.0)
    config = BY_NAME["async+ft_launcher"]
    exception = simulate(costs, config, {"fsx": 10.0}, 30.0, trace=[(20, "exception")])
    killed = simulate(costs, config, {"fsx": 10.0}, 30.0, trace=[(20, "process")])
    assert exception["badput"]["wasted_progress"] == 0 and killed["badput"]["wasted_progress"] > 0
    # Killed: 10 steps and the step-20 save done again; the exception instead waited the 3 s write out.
    assert killed["wall_seconds"] - exception["wall_seconds"] == pytest.approx(10.0 + 0.1 - 3.0)
    in_process = simulate(costs, BY_NAME["in_process+ft_launcher+memory+peer"], {"fsx": 10.0, "memory": 1.0}, 30.0,
                          trace=[(20, "exception")])
    assert in_process["badput"]["wasted_progress"] == 0  # it reloads node memory, saved every step


def test_a_restart_reinitialises_a_world_that_grows_with_the_job():
    """The published process-group initialisation figures (pytorch/gloo#408) at their points, monotonic between
    them, and nothing added to what a restart of up to 64 ranks measures here."""
    assert process_group_seconds(64) == 0.0 and process_group_seconds(16) == 0.0
    assert process_group_seconds(2048) == 18.0 and process_group_seconds(8192) == 85.0
    assert process_group_seconds(16384) == 170.0
    sizes = [64, 128, 512, 2048, 3000, 4096, 6000, 8192, 20000]
    assert all(a <= b for a, b in zip(map(process_group_seconds, sizes), map(process_group_seconds, sizes[1:])))
    small, large = (Costs(nodes=n, node_mtbf_hours=5000, **SEED_SETTING) for n in (8, 1024))
    assert large.restart("ft_launcher") - small.restart("ft_launcher") == pytest.approx(85.0)
    assert large.restart("job_relaunch") > large.job_restart_seconds + 80


def test_replica_groups_cost_a_groups_share_plus_the_survivors_stall():
    costs = Costs(nodes=1024, node_mtbf_hours=5000, **SEED_SETTING)
    groups = costs.replica_groups
    group_world = restart_world_seconds(1024 // groups, costs.gpus_per_node)
    expected = ((costs.restart_seconds + group_world + costs.heal_seconds) / groups
                + costs.replica_detection_seconds + costs.step_seconds)
    assert costs.restart("replica_group") == pytest.approx(expected)
    assert costs.restart("replica_group") < costs.restart("ft_launcher")
    # One group is the whole job: no saving over an in-job restart but the stall on top.
    single = dataclasses.replace(costs, replica_groups=1)
    assert single.restart("replica_group") > single.restart("ft_launcher")


def test_replica_groups_pay_only_from_some_cluster_size():
    from pipelines.plan import replica_groups_pay_from

    """The per-step quorum is paid at any size, a fault's saving grows with the fault rate: a crossover."""
    costs = Costs(nodes=8, node_mtbf_hours=5000, **{**SEED_SETTING, "quorum_seconds": 0.01})
    start = replica_groups_pay_from(costs)
    assert start is not None and 8 < start <= 4096
    below = make_plan(dataclasses.replace(costs, nodes=start // 2))
    assert below.recommended["name"] != "replica_groups"
    assert make_plan(dataclasses.replace(costs, nodes=start)).recommended["name"] == "replica_groups"
    # A slower quorum moves the crossover up.
    slower = replica_groups_pay_from(dataclasses.replace(costs, quorum_seconds=0.05))
    assert slower is None or slower > start


# -- FSx for Lustre: its sizes by AWS's rules (trainer.config.fsx), and the smallest a job's checkpoints need ----

@pytest.mark.parametrize("override, message", [
    ("--kubernetes.fsx_storage_gib=3000", r"kubernetes.fsx_storage_gib: 3000 GiB is not a size FSx offers"),
    ("--kubernetes.fsx_deployment_type=PERSISTENT_2",
     r"kubernetes.fsx_per_unit_throughput: PERSISTENT_2 offers \(125, 250, 500, 1000\) MB/s/TiB, not 0"),
    ("--kubernetes.fsx_per_unit_throughput=250", r"SCRATCH_2 has no throughput tier"),
])
def test_a_file_system_fsx_does_not_offer_is_refused_naming_the_field(override, message):
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config("local", [override])


def test_the_throughput_is_the_provisioned_one_unless_measured():
    from trainer.config import load_config

    assert load_config("local", []).kubernetes.fsx_throughput_mbps == 1200 / 1024 * 200  # SCRATCH_2's baseline
    persistent = ["--kubernetes.fsx_deployment_type=PERSISTENT_2", "--kubernetes.fsx_storage_gib=4800",
                  "--kubernetes.fsx_per_unit_throughput=500"]
    assert load_config("local", persistent).kubernetes.fsx_throughput_mbps == 4.6875 * 500
    assert load_config("local", [*persistent, "--kubernetes.fsx_throughput_mbps=900"]).kubernetes.fsx_throughput_mbps == 900


def test_the_smallest_persistent_2_holds_the_checkpoints_and_writes_one_within_its_interval():
    from trainer.planning.fsx import checkpoint_needs, smallest_persistent_2

    need_bytes, need_mbps = checkpoint_needs(96e9, keep_last=3, interval_seconds=1760, base_model_bytes=17.7e9)
    assert need_bytes == 4 * 96e9 + 17.7e9 and need_mbps == pytest.approx(2 * 96e3 / 1760)
    assert smallest_persistent_2(need_bytes, need_mbps) == smallest_persistent_2(401.7e9, 109.1)
    size = smallest_persistent_2(need_bytes, need_mbps)
    assert (size.storage_gib, size.per_unit_mbps_per_tib) == (1200, 125)
    fast = smallest_persistent_2(need_bytes, 2000)  # the least storage that can, at the tier that gives it
    assert (fast.storage_gib, fast.per_unit_mbps_per_tib) == (2400, 1000)
    big = smallest_persistent_2(3000e9, 100)  # 2.8 TiB: past 2,400 GiB storage comes in steps of 2,400
    assert (big.storage_gib, big.per_unit_mbps_per_tib) == (4800, 125)


EKS_CPT = ["plan", "--config", "pipelines/configs/eks-cpt.yaml", "--from-config", "--step-seconds", "8.8",
           "--checkpoint-stall-seconds", "1", "--model.init_from=tests/data/llama-3.1-8b"]


def test_the_plan_says_what_fsx_the_checkpoints_need_and_whether_the_configured_one_does(capsys):
    assert main([*EKS_CPT, "--format", "json"]) == 0
    fsx = json.loads(capsys.readouterr().out)["fsx"]
    assert fsx["interval_steps"] == 200 and fsx["enough"] and fsx["durable_copy"] == "s3"
    assert fsx["configured"] == {"deployment_type": "PERSISTENT_2", "storage_gib": 2400, "per_unit_throughput": 250,
                                 "throughput_mbps": 2400 / 1024 * 250}
    # The planner's save and reload take the configured throughput: 96 GB at 586 MB/s.
    assert main(EKS_CPT) == 0
    out = capsys.readouterr().out
    assert "an FSx save or reload 164 s at 586 MB/s" in out and "configured: PERSISTENT_2 2400 GiB" in out

    scratch = ["--kubernetes.fsx_deployment_type=SCRATCH_2", "--kubernetes.fsx_per_unit_throughput=0",
               "--checkpoint.s3_uri=", "--checkpoint.interval_steps=20"]
    assert main([*EKS_CPT, *scratch]) == 0
    out = capsys.readouterr().out
    assert ("NOT enough (saves queue behind each other, or the folder fills): set kubernetes.fsx_deployment_type="
            "PERSISTENT_2, fsx_storage_gib=1200, fsx_per_unit_throughput=1000") in out  # 1,172 MB/s
    assert "the job's only durable copy is on SCRATCH_2" in out
