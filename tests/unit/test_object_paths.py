"""The key -> path mapping's rules, as pure logic (the real S3 server is in tests/integration/test_stage_keys.py)."""


import pytest

from components.stage import object_paths
from components.stage.object_paths import map_objects, relative_path


def objects(*keys, size=1):
    return [{"key": key, "bytes": size} for key in keys]


def test_keys_become_paths_below_the_folder_and_markers_are_dropped(tmp_path):
    mapped, bad = map_objects(objects("p/a.txt", "p/sub/b c.txt") + objects("p/sub/", size=0), "p", tmp_path)
    assert [path for _, path in mapped] == [tmp_path / "a.txt", tmp_path / "sub" / "b c.txt"] and bad == []


@pytest.mark.parametrize("key", ["p/../x", "p/a/../../x", "p/./x", "p//etc/passwd", "p/a//b", "p/x\x00", "p/" + "é" * 128])
def test_no_key_can_leave_the_folder(tmp_path, key):
    mapped, bad = map_objects(objects(key), "p", tmp_path)
    assert mapped == [] and [b.key for b in bad] == [key]


def test_a_non_empty_key_ending_in_a_slash_is_refused(tmp_path):
    _, bad = map_objects(objects("p/dir/", size=5), "p", tmp_path)
    assert "folder marker" in bad[0].reason


def test_two_keys_on_one_path_are_both_refused_on_a_case_insensitive_file_system(tmp_path, monkeypatch):
    """macOS (APFS default) and SMB/Windows shares fold case: 'A.txt' and 'a.txt' are one file there."""
    monkeypatch.setattr(object_paths, "is_case_insensitive", lambda directory: True)
    mapped, bad = map_objects(objects("p/A.txt", "p/a.txt", "p/b.txt"), "p", tmp_path)
    assert [path.name for _, path in mapped] == ["b.txt"]
    assert {b.key for b in bad} == {"p/A.txt", "p/a.txt"} and "same path" in bad[0].reason


def test_case_sensitivity_is_probed_not_assumed(tmp_path):
    assert object_paths.is_case_insensitive(tmp_path) is False  # Linux file systems here
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind


def test_relative_path_without_a_prefix():
    assert relative_path("a/b.txt", "") == "a/b.txt"
    with pytest.raises(ValueError, match="empty path segment"):
        relative_path("/abs", "")


def test_inside_follows_symlinks(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "link").symlink_to("/etc")
    assert object_paths.inside(tmp_path / "raw" / "x", tmp_path / "raw")
    assert not object_paths.inside(tmp_path / "raw" / "link" / "passwd", tmp_path / "raw")
