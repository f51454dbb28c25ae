"""Write a file so that a reader (or a rerun after a kill or a power cut) never sees it half-written.

One mechanism for every output that must be all-or-nothing: write under a temporary name in the same
folder, fsync the file, rename it over the target, fsync the folder (a rename is durable only once
its directory is).  run.json, the pack manifests and the published .rec/.idx, checkpoints, metrics and
the report all go through here.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path


def fsync_path(*paths: str | os.PathLike) -> None:
    """Flush files or directories to disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Rename a finished, synced file over `final` and make the rename itself durable."""
    final = Path(final)
    os.replace(tmp, final)
    fsync_path(final.parent)
    return final


def temporary_name(path: str | os.PathLike) -> Path:
    """A hidden name beside `path`, unique to this process."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """`with replacing(p) as tmp: write tmp` - on success tmp is synced and published as p; on an
    error it is removed and p is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        yield tmp
        fsync_path(tmp)
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_with(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Atomically create `path` with `write(tmp_path)` (e.g. torch.save, DataFrame.to_csv)."""
    with replacing(path) as tmp:
        write(tmp)
    return Path(path)


def link_or_write(source: str | os.PathLike, path: str | os.PathLike, write: Callable[[Path], object]) -> bool:
    """Atomically make `path` a second name of the finished file `source` (a hard link: the same bytes,
    not written again), or, where the file system has no hard links, write it with `write(tmp_path)`.
    True when linked.  A later write to either name replaces that name only (write_with renames a new
    file over it), so the two never change together."""
    with replacing(path) as tmp:
        try:
            os.link(source, tmp)
            return True
        except OSError:
            write(tmp)
            return False


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, obj) -> Path:
    return write_text(path, json.dumps(obj, indent=2, default=str) + "\n")
