"""Straggler detection (trainer.resilience.straggler): NVRx's scores on CPU/gloo, read as NVRx's Report reads.

The scores come from NVRx's own ReportGenerator (nvidia_resiliency_ext.straggler.reporting in 0.4.1): per
section, the fastest rank's median / this rank's median ("relative") and the rank's own best median / its
median now ("individual"); Report.identify_stragglers with thresholds 0.75 (NVRx's defaults).
"""

import os
import socket
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.config import ConfigError, load_config
from trainer.resilience import nvrx_compat
from trainer.resilience.straggler import StragglerDetector, findings
from trainer.run.events import EventLog, read_events


def _report(relative: dict, individual: dict, gpu: dict | None = None):
    reporting = __import__(f"{nvrx_compat.straggler_package().__name__}.reporting", fromlist=["Report"])
    return reporting.Report(gpu_relative_perf_scores=gpu or {0: float("nan"), 1: float("nan")},
                            section_relative_perf_scores=relative, gpu_individual_perf_scores={},
                            section_individual_perf_scores=individual, rank_to_node={0: "node-a", 1: "node-b"},
                            local_section_summaries={}, local_kernel_summaries={}, generate_report_elapsed_time=0.0,
                            gather_on_rank0=True, rank=0)


def test_findings_name_the_rank_by_its_whole_step_and_say_where_it_is_slow():
    report = _report({"data": {0: 1.0, 1: 0.7}, "optimizer": {0: 1.0, 1: 0.5}, "forward_backward": {0: 0.98, 1: 1.0},
                      "checkpoint_wait": {0: 0.4, 1: 1.0}, "step": {0: 1.0, 1: 0.6}},
                     {"data": {0: 0.6, 1: 0.9}, "optimizer": {0: 1.0, 1: 0.5}})
    found = findings(report, threshold=0.75, step=40)
    [straggler] = found["stragglers"]
    assert straggler["straggler_rank"] == 1 and straggler["node"] == "node-b" and straggler["score"] == 0.6
    assert straggler["section"] == "optimizer"
    assert straggler["sections"] == {"data": 0.7, "forward_backward": 1.0, "optimizer": 0.5, "checkpoint_wait": 1.0}
    # Rank 0 is slower than its own best (individual 0.6), and rank 0 commits (checkpoint_wait 0.4): neither
    # names it.
    assert found["lowest"] == {"score": 0.6, "rank": 1}
    assert findings(report, threshold=0.5, step=40)["stragglers"] == []


def test_one_slow_section_alone_names_nobody():
    report = _report({"optimizer": {0: 1.0, 1: 0.55}, "forward_backward": {0: 1.0, 1: 1.0},
                      "step": {0: 1.0, 1: 0.93}}, {})
    assert findings(report, threshold=0.75, step=10)["stragglers"] == []


def test_a_gpu_score_below_the_threshold_names_a_straggler():
    found = findings(_report({"step": {0: 1.0, 1: 1.0}}, {}, gpu={0: 1.0, 1: 0.6}), threshold=0.75, step=10)
    assert [(s["straggler_rank"], s["score"], s["sections"]["gpu"]) for s in found["stragglers"]] == [(1, 0.6, 0.6)]


def _rank(rank: int, port: int, run_dir: str, slow: dict, slow_steps: range, overrides: list, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # windows of ~60 ms here: by reports alone, unless a test asks for the time a streak must span
    cfg = load_config("local", [f"--run.work_dir={run_dir}", "--run.run_id=s", "--resilience.straggler_interval=5",
                                "--resilience.straggler_confirm_seconds=0", *overrides])
    events = EventLog(cfg.run_dir, rank)
    detector = StragglerDetector(cfg, rank=rank, world_size=2, device=__import__("torch").device("cpu"),
                                 events=events)
    reports = []
    for step in range(1, 16):
        for section in ("data", "forward_backward", "optimizer"):
            with detector.section(section):  # work, not sleep: CPU ranks are timed on their thread's CPU clock
                until = time.thread_time() + 0.004 * (slow.get((rank, section), 1.0) if step in slow_steps else 1.0)
                while time.thread_time() < until:
                    pass
        dist.barrier()  # the step's synchronisation, outside the timed sections
        found = detector.after_step(step)
        if found is not None:
            reports.append((step, [(s["straggler_rank"], s["section"]) for s in found["stragglers"]], detector.current,
                            found["suspects"]))
    out.put((rank, reports))
    dist.destroy_process_group()


def _run_two_ranks(tmp_path, slow: dict, slow_steps: range = range(1, 16), overrides: tuple = ()) -> dict:
    context = mp.get_context("spawn")
    out = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [context.Process(target=_rank, args=(r, port, str(tmp_path), slow, slow_steps, list(overrides), out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    return results


SLOW_RANK_1 = {(1, "data"): 2.0, (1, "forward_backward"): 2.0, (1, "optimizer"): 2.0}


def _straggler_events(tmp_path) -> list[dict]:
    return read_events(load_config("local", [f"--run.work_dir={tmp_path}", "--run.run_id=s"]).run_dir, "straggler")


def test_a_slow_rank_is_named_on_every_rank_over_gloo_once_slow_in_two_reports_in_a_row(tmp_path):
    results = _run_two_ranks(tmp_path, slow=SLOW_RANK_1)
    assert results[0] == results[1]  # every rank learns the same report (the gauges, the node's action)
    assert [step for step, *_ in results[0]] == [5, 10, 15]
    assert [([rank for rank, _ in stragglers], suspects) for _, stragglers, _, suspects in results[0]] == [
        ([], [1]), ([1], []), ([1], [])]  # a suspect in the first report, named in the second
    assert results[1][0][2] == "none" and results[1][1][2].startswith("rank 1 at 0.")
    [event] = _straggler_events(tmp_path)  # one record per streak, when it is named
    assert event["straggler_rank"] == 1 and event["rank"] == 0 and event["consecutive_reports"] == 2


def test_a_rank_slow_in_one_window_only_is_a_suspect_and_never_named(tmp_path):
    """What a clean 2-core CI run met: one rank's CPU time up for a few steps (a process sharing its core)."""
    results = _run_two_ranks(tmp_path, slow=SLOW_RANK_1, slow_steps=range(1, 6))
    assert [(stragglers, suspects) for _, stragglers, _, suspects in results[0]] == [([], [1]), ([], []), ([], [])]
    assert _straggler_events(tmp_path) == []


def test_a_rank_slow_in_reports_seconds_apart_is_named_only_once_its_streak_spans_the_confirm_seconds(tmp_path):
    """What a clean CI run met (test_network_faults, windows of 2.5 s): after a 2 s store partition one rank's work
    was slow in two reports in a row, a burst of contention, and was named a straggler. A slow node stays slow."""
    results = _run_two_ranks(tmp_path, slow=SLOW_RANK_1, overrides=("--resilience.straggler_confirm_seconds=60",))
    assert [([rank for rank, _ in stragglers], suspects) for _, stragglers, _, suspects in results[0]] == [
        ([], [1])] * 3  # slow in every report, over well under a second: a suspect each time
    assert _straggler_events(tmp_path) == []


def test_one_confirming_report_names_the_straggler_in_the_first(tmp_path):
    results = _run_two_ranks(tmp_path, slow=SLOW_RANK_1, slow_steps=range(1, 6),
                             overrides=("--resilience.straggler_confirm_reports=1",))
    assert [([rank for rank, _ in stragglers], suspects) for _, stragglers, _, suspects in results[0]] == [
        ([1], []), ([], []), ([], [])]
    [event] = _straggler_events(tmp_path)
    assert event["consecutive_reports"] == 1


def test_equal_ranks_and_one_slow_section_report_no_straggler(tmp_path):
    results = _run_two_ranks(tmp_path, slow={(1, "data"): 1.5})  # a third of the step 1.5x: the step 1.17x
    assert [(stragglers, suspects) for _, stragglers, _, suspects in results[0]] == [([], [])] * 3


@pytest.mark.parametrize("overrides, field", [
    (["--resilience.on_straggler=replace_node"], "resilience.on_straggler"),
    (["--resilience.on_straggler=replace_node", "--training.num_nodes=2", "--resilience.straggler_interval=0"],
     "resilience.on_straggler"),
    (["--resilience.straggler_threshold=1.5"], "resilience.straggler_threshold"),
    (["--resilience.straggler_patience=0"], "resilience.straggler_patience"),
    (["--resilience.straggler_confirm_reports=0"], "resilience.straggler_confirm_reports"),
    (["--resilience.straggler_confirm_seconds=-1"], "resilience.straggler_confirm_seconds"),
    (["--resilience.straggler_confirm_reports=3", "--resilience.straggler_patience=2"], "resilience.straggler_patience"),
    (["--faults.straggler_factor=1"], "faults.straggler_factor"),
    (["--resilience.startup_timeouts=model_bild=5"], "resilience.startup_timeouts"),
    (["--resilience.startup_timeouts=first_step=0"], "resilience.startup_timeouts"),
    (["--faults.schedule=hang_in_model_build@t=3"], "faults.schedule"),
])
def test_bad_settings_name_their_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("local", overrides)
