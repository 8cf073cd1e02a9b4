"""The local run's console: step lines from KFP's local runner, training progress from the run folder.

The runner's lines are produced with kfp.local's own helpers (``logging_utils.local_logger_context``,
``format_task_name``, ``format_status``), the way ``kfp/local/task_dispatcher.py`` logs a task, so a change in
KFP's wording breaks these tests rather than the console silently showing nothing.
"""

import io
import json
import logging

from kfp.local import logging_utils, status

from pipelines.console import PipelineConsole, TrainingProgress
from trainer.run.events import append_record
from trainer.run.run_dir import RunDir


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run_task(name: str, succeeded: bool = True, noise: str = "executor input: {...}") -> None:
    """What kfp.local's task dispatcher logs and prints around one task."""
    with logging_utils.local_logger_context():
        logging.info(f"Executing task {logging_utils.format_task_name(name)}")
        logging.info("Streamed logs:\n")
        with logging_utils.indented_print():
            print(noise)
        outcome = status.Status.SUCCESS if succeeded else status.Status.FAILURE
        line = f"Task {logging_utils.format_task_name(name)} finished with status {logging_utils.format_status(outcome)}"
        (logging.info if succeeded else logging.error)(line)
        logging_utils.print_horizontal_line()


def test_the_console_shows_each_step_and_the_log_file_gets_everything(tmp_path):
    out = io.StringIO()
    with PipelineConsole(tmp_path, num_steps=10, out=out) as console:
        run_task("prepare-run")
        logging.getLogger("components").warning("a warning from the parent process")
        run_task("validate-checkpoint", succeeded=False)
    shown = out.getvalue()
    assert "  prepare        done" in shown
    assert "  validate       FAILED" in shown and str(console.log_path) in shown
    assert "executor input" not in shown and "a warning from the parent process" not in shown
    assert "---" not in shown
    logged = console.log_path.read_text()
    assert "Executing task" in logged and "executor input: {...}" in logged
    assert "a warning from the parent process" in logged


def test_verbose_streams_the_runner_output_and_still_writes_the_log(tmp_path):
    out = io.StringIO()
    with PipelineConsole(tmp_path, num_steps=10, verbose=True, out=out) as console:
        run_task("prepare-run")
    assert "executor input: {...}" in out.getvalue() and "Executing task" in out.getvalue()
    assert "executor input: {...}" in console.log_path.read_text()


def test_the_console_restores_stdout_stderr_and_logging(tmp_path):
    import sys

    root = logging.getLogger()
    before = (sys.stdout, sys.stderr, root.handlers[:], root.level)
    with PipelineConsole(tmp_path, num_steps=1, out=io.StringIO()):
        assert sys.stdout is not before[0]
    assert (sys.stdout, sys.stderr, root.handlers[:], root.level) == before


def write_metrics(run_dir, steps, loss=2.0):
    with RunDir(run_dir).metrics.open("a") as handle:
        for step in steps:
            handle.write(json.dumps({"step": step, "loss": loss, "tokens_per_second": 5000.0, "step_seconds": 0.5}) + "\n")


def write_event(run_dir, rank, **record):
    """A control record as a rank appends it (trainer.run.events)."""
    path = RunDir(run_dir).control_log
    path.parent.mkdir(parents=True, exist_ok=True)
    append_record(path, {"rank": rank, "time": record.pop("time", 1.0), **record})


def test_off_a_terminal_progress_is_a_line_per_quarter_and_a_line_per_fault_and_recovery(tmp_path):
    out = io.StringIO()
    progress = TrainingProgress(tmp_path, num_steps=100, out=out)
    write_metrics(tmp_path, range(1, 61))
    with RunDir(tmp_path).metrics.open("a") as handle:
        handle.write('{"step": 61, "lo')  # being written: read once complete
    progress.poll()
    write_event(tmp_path, 1, event="fault", fault_type="sigkill", key="sigkill@60:rank=1", step=60, time=2.0)
    for rank in (0, 1):  # the same recovery recorded twice (a retried record): one line
        write_event(tmp_path, rank, event="recovery", fault_key="sigkill@60:rank=1", restart_iteration=1, first_step=51,
                    mechanism="ft_launcher", reloaded_step=50, reload_source="disk", lost_steps=10,
                    recovery_seconds=5.25, time=3.0)
    with RunDir(tmp_path).metrics.open("a") as handle:
        handle.write('ss": 2.0, "tokens_per_second": 1.0, "step_seconds": 0.5}\n')
    write_metrics(tmp_path, range(51, 101), loss=1.0)
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split("  loss")[0] for line in lines if "train  step" in line] == [
        "  train  step 25/100", "  train  step 50/100", "  train  step 75/100", "  train  step 100/100"]
    assert "ETA 25 s" in lines[1]  # 50 steps left at 0.5 s each
    assert lines.count("  ! sigkill injected on rank 1 at step 60") == 1
    assert sum("! recovered by ft_launcher restart: reloaded step 50 from disk, 10 steps lost, 5.2 s" in line
               for line in lines) == 1
    assert len(lines) == 6


def test_on_a_terminal_progress_is_a_bar_with_loss_and_throughput(tmp_path):
    out = Terminal()
    progress = TrainingProgress(tmp_path, num_steps=10, out=out)
    write_metrics(tmp_path, range(1, 11), loss=0.25)
    progress.poll()
    progress.close()
    shown = out.getvalue()
    assert "10/10" in shown and "loss 0.2500, 5,000 tok/s" in shown
    assert "train  step" not in shown  # the plain lines are for logs, not terminals


def test_replica_group_changes_heals_and_discarded_steps_show_once_each(tmp_path):
    """Each group's rank 0 records a quorum change and every rank of a healed group its heal: one line each;
    a group's own first quorum (every group joining at the start) is no news."""
    out = io.StringIO()
    progress = TrainingProgress(tmp_path, num_steps=10, out=out)
    common = dict(event="quorum_changed", why="a group failed or was lost", step=5, time=1.0)
    write_event(tmp_path, 0, **{**common, "quorum_id": 1, "groups": [0, 1], "joined": [0, 1], "left": [],
                                "why": "this group (re)started", "step": 0})
    for rank in (0, 2):
        write_event(tmp_path, rank, **common, quorum_id=2, groups=[0], joined=[], left=[1])
    write_event(tmp_path, 0, event="step_discarded", step=6, why="RuntimeError: Connection closed by peer", time=1.5)
    for rank in (2, 3):
        write_event(tmp_path, rank, event="replica_group_heal", group=1, donor_group=0, step=8, bytes=14_000_000,
                    seconds=0.2, time=2.0)
    progress.poll()
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines == ["  ! replica groups at step 5: [0] train (out [1], in []): a group failed or was lost",
                     "  ! step 6 discarded by the replica groups: RuntimeError: Connection closed by peer",
                     "  ! replica group 1 healed from group 0 at step 8 (14 MB per rank in 0.2 s)"]


def test_a_rollback_and_a_suspected_sdc_show_once_each(tmp_path):
    out = io.StringIO()
    progress = TrainingProgress(tmp_path, num_steps=20, out=out)
    for rank in (0, 1):  # a second record of the same finding is no second line
        write_event(tmp_path, rank, event="sdc_suspected", step=7, anomaly="nonfinite_grad_norm", ranks=[1], time=1.0)
    write_event(tmp_path, 0, event="rollback", anomaly_step=10, anomaly="nonfinite_loss", reloaded_step=9,
                reload_source="memory", lost_steps=0, samples=16, time=2.0)
    progress.poll()
    progress.close()
    assert out.getvalue().splitlines() == [
        "  ! suspected silent data corruption at step 7 on rank(s) 1: nonfinite_grad_norm, clean when executed "
        "again; trained on",
        "  ! nonfinite_loss at step 10, again on the same batch: rolled back to step 9 (memory), 0 steps lost, "
        "16 samples skipped"]


def test_the_numeric_records_are_rows_of_the_recovery_table_with_their_mechanism_and_a_rollback_a_mark():
    from components.run_metrics import event_record, recovery_row

    rollback = {"event": "rollback", "time": 2.0, "anomaly_step": 10, "anomaly": "nonfinite_loss", "lost_steps": 3,
                "samples": 16}
    assert recovery_row(rollback)["mechanism"] == "rollback"
    assert recovery_row({"event": "sdc_suspected", "step": 7})["mechanism"] == "rerun"
    assert recovery_row({"event": "data_skipped", "step": 10})["mechanism"] == "skip"
    assert recovery_row({"event": "recovery", "mechanism": "ft_launcher"})["mechanism"] == "ft_launcher"
    assert recovery_row({"event": "fault"}) is None
    assert event_record(rollback, 0) == {"step": 10, "time": 2.0, "rollback": 1, "rollback_lost_steps": 3,
                                         "samples_skipped_by_rollback": 16}
