"""The one tail reader of the run folder (trainer.run.tail) and the shared streams' appends
(trainer.run.events.append_record): whole lines after an offset, the last record read from the end, and a line
torn by a writer killed mid-write that never takes the next writer's record with it."""

import json
import os

from trainer.run.events import append_record
from trainer.run.tail import read_last_record, read_last_records, read_new_lines


def test_whole_lines_after_the_offset_and_a_line_being_written_waits(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    assert read_new_lines(path, 0) == ([], 0)  # not written yet
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2')  # the second line is still being written
    records, offset = read_new_lines(path, 0)
    assert records == [{"step": 1}] and offset == len(json.dumps({"step": 1})) + 1
    with path.open("a") as handle:
        handle.write("}\n")
    records, offset = read_new_lines(path, offset)
    assert records == [{"step": 2}] and offset == path.stat().st_size
    assert read_new_lines(path, offset) == ([], offset)


def test_a_torn_line_is_skipped_and_what_came_before_an_offset_reads_back(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')  # killed mid-write, then appended after
    records, offset = read_new_lines(path, 0)
    assert records == [{"step": 1}, {"step": 3}]
    with path.open("a") as handle:
        handle.write('{"step": 4}\n')
    assert read_new_lines(path, 0, until=offset) == ([{"step": 1}, {"step": 3}], offset)
    assert read_new_lines(path, 0, until=0) == ([], 0) and read_new_lines(tmp_path / "absent", 0, until=10) == ([], 0)


def test_a_shared_stream_loses_only_the_line_a_killed_writer_was_writing(tmp_path):
    """Many ranks append to one stream: a writer killed mid-line leaves a fragment with no newline, and the next
    writer's leading newline ends it there, so the next record stays whole (with plain `json + "\\n"` appends,
    the fragment and the next record would share a line and both be lost)."""
    path = tmp_path / "control.jsonl"
    append_record(path, {"event": "attempt", "n": 1})
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b'\n{"event": "fault", "key": "sig')  # the writer dies here
    os.close(fd)
    append_record(path, {"event": "recovery", "n": 2})
    records, offset = read_new_lines(path, 0)
    assert records == [{"event": "attempt", "n": 1}, {"event": "recovery", "n": 2}]
    assert offset == path.stat().st_size


def test_the_last_record_is_read_from_the_end_and_can_be_the_last_before_a_time(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as handle:
        for step in range(1, 20_001):  # ~1 MB: several blocks back
            handle.write(json.dumps({"step": step, "time": float(step), "pad": "x" * 30}) + "\n")
        handle.write('{"step": 20001, "ti')  # being written
    assert read_last_record(path)["step"] == 20_000
    assert read_last_record(path, before=500.5)["step"] == 500
    assert read_last_record(path, before=1.0) is None and read_last_record(tmp_path / "absent") is None


def test_since_stops_the_backward_read_at_the_first_older_block(tmp_path):
    """A failing rank looks for its failure's twin since its launch began (trainer.resilience.failures): a long
    history before that is never read, however much of it there is."""
    path = tmp_path / "failures.jsonl"
    records = [{"time": 1.0, "fingerprint": "twin"}] + [{"time": 10.0, "fingerprint": f"f{i}"} for i in range(200)] + [
        {"time": 100.0, "fingerprint": f"g{i}"} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    def twin(record):
        return record["fingerprint"] == "twin"

    assert read_last_records(path, twin, 1, block=256) == [records[0]]  # found when the whole file is read
    assert read_last_records(path, twin, 1, block=256, since=50.0) == []
    assert read_last_records(path, lambda r: r["fingerprint"] == "g0", 1, block=256, since=50.0) == [records[-3]]
