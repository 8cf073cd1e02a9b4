"""Where an S3 object lands on the file system: the one mapping from key to path, and what it refuses.

S3 keys are arbitrary strings; a file system gives '/', '.', '..', empty segments and NUL a meaning. Every
staging mode asks ``map_objects`` which path each key has below the dataset's ``raw/`` folder, and never
joins a key onto a path itself. Refused (with the key and the reason):

- a '..' or '.' segment, an empty segment ('a//b', or a leading '/' after the prefix: an absolute path when
  joined), NUL;
- a segment longer than the file system's NAME_MAX, or a whole path longer than PATH_MAX;
- a key that is a file while other keys use it as a directory ('a' beside 'a/b.txt');
- two keys that land on the same path (on a case-insensitive file system, 'A.txt' and 'a.txt').

A zero-byte key ending in '/' is a folder marker (what the S3 console creates): not a file, not an error.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BadKey:
    key: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"key": self.key, "reason": self.reason}


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _limits(raw_dir: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system that holds raw_dir (or will)."""
    where = _existing_ancestor(raw_dir)
    return os.pathconf(where, "PC_NAME_MAX"), os.pathconf(where, "PC_PATH_MAX")


def is_case_insensitive(directory: Path) -> bool:
    """True when the file system at directory treats 'a' and 'A' as the same name (probed, not guessed)."""
    where = _existing_ancestor(directory)
    with tempfile.NamedTemporaryFile(prefix=".case-probe-", dir=where) as probe:
        name = Path(probe.name)
        return (name.parent / name.name.upper()).exists()


def relative_path(key: str, prefix: str, *, name_max: int = 255) -> str:
    """The key below the prefix as a safe relative POSIX path; raises ValueError with the reason."""
    assert not prefix or key.startswith(prefix + "/"), f"{key!r} is not under the prefix {prefix!r}"
    relative = key[len(prefix) + 1 :] if prefix else key
    if "\x00" in relative:
        raise ValueError("contains NUL, which no POSIX path can hold")
    for segment in relative.split("/"):
        if segment == "":
            raise ValueError("empty path segment (a '//' or a leading '/')")
        if segment in (".", ".."):
            raise ValueError(f"a {segment!r} segment")
        size = len(segment.encode("utf-8"))
        if size > name_max:
            raise ValueError(f"a segment of {size} bytes, longer than the file system's NAME_MAX ({name_max})")
    return relative


def map_objects(objects: list[dict], prefix: str, raw_dir: Path) -> tuple[list[tuple[dict, Path]], list[BadKey]]:
    """(object, path) for every key that maps safely below raw_dir, and the refused keys with reasons.

    `objects` are S3 listing entries with at least "key" and "bytes"; folder markers are dropped silently.
    """
    raw_dir = Path(raw_dir)
    name_max, path_max = _limits(raw_dir)
    bad: list[BadKey] = []
    mapped: list[tuple[dict, str]] = []
    for obj in objects:
        key = obj["key"]
        if key.endswith("/") and obj["bytes"] == 0 and "\x00" not in key:
            continue  # a folder marker
        try:
            if key.endswith("/"):
                raise ValueError(f"ends with '/' (a folder marker) but holds {obj['bytes']} bytes")
            relative = relative_path(key, prefix, name_max=name_max)
            if len(str(raw_dir / relative).encode("utf-8")) >= path_max:
                raise ValueError(f"the path below {raw_dir} is longer than the file system's PATH_MAX ({path_max})")
        except ValueError as err:
            bad.append(BadKey(key, str(err)))
            continue
        mapped.append((obj, relative))

    # A file that other keys use as a directory: the directory wins, the file is refused.
    folders: dict[str, str] = {}
    for obj, relative in mapped:
        parts = relative.split("/")
        for depth in range(1, len(parts)):
            folders.setdefault("/".join(parts[:depth]), obj["key"])
    kept = []
    for obj, relative in mapped:
        if relative in folders:
            bad.append(BadKey(obj["key"], f"a file here but also a directory of other objects "
                                          f"(e.g. {folders[relative]!r})"))
        else:
            kept.append((obj, relative))

    # Two keys, one path: neither can be trusted to be the one meant.
    fold = str.casefold if kept and is_case_insensitive(raw_dir) else (lambda text: text)
    by_path: dict[str, list[str]] = {}
    for obj, relative in kept:
        by_path.setdefault(fold(relative), []).append(obj["key"])
    result = []
    for obj, relative in kept:
        same = by_path[fold(relative)]
        if len(same) > 1:
            others = [k for k in same if k != obj["key"]]
            bad.append(BadKey(obj["key"], f"lands on the same path as {others[0]!r} on this file system"))
        else:
            result.append((obj, raw_dir / relative))
    return result, sorted(bad, key=lambda b: b.key)


def inside(path: Path, root: Path) -> bool:
    """True when path, with every symlink resolved, is root or below it (a symlink cannot lead out)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))
