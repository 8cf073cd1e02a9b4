"""The one tail reader of the run folder (trainer.run.tail): whole lines after an offset, as the forwarder,
the console and a restarted forwarder read them."""

import json

from trainer.run.tail import read_lines_before, read_new_lines


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
    assert read_lines_before(path, offset) == [{"step": 1}, {"step": 3}]
    assert read_lines_before(path, 0) == [] and read_lines_before(tmp_path / "absent", 10) == []
