"""Write a file so that a reader (or a rerun after a kill or a power cut) never sees it half-written.

One mechanism for every output that must be all-or-nothing: write under a temporary name in the same
folder, fsync the file, rename it over the target, fsync the folder (a rename is durable only once
its directory is).  run.json, the pack manifests and the published .rec/.idx, checkpoints, metrics and
the report all go through here.

The temporary is created here and now (O_CREAT | O_EXCL | O_NOFOLLOW under a random name, never through a link):
a predictable name in results/ or the fast storage let another user who may write there plant a link
at it, and the write went through the link into a file of the victim's (issue #38).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

from rectrain import safefs


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


def temporary_prefix(path: str | os.PathLike) -> str:
    """The start of every temporary's name beside `path` (hidden; a pack's cleanup globs it)."""
    return f".{Path(path).name}.tmp"


def new_temporary(path: str | os.PathLike) -> Path:
    """An empty file of this process's own beside `path`, created exclusively under a random name
    (safefs.create_new: nothing already there, a planted link included, is opened or followed), with
    the mode the umask gives a new file, as the outputs always had."""
    path = Path(path)
    for _ in range(100):
        tmp = path.with_name(f"{temporary_prefix(path)}{os.getpid()}.{secrets.token_hex(4)}")
        try:
            os.close(safefs.create_new(tmp, mode=0o666))
            return tmp
        except FileExistsError:
            continue  # taken (or planted): another random name
    raise FileExistsError(f"no free temporary name beside {path} after 100 tries: remove the .tmp files there")


def fresh_name(path: str | os.PathLike) -> Path:
    """A random hidden name beside `path` that nothing has (new_temporary's file, removed again), for a
    caller that creates it exclusively itself (os.symlink, os.link, safefs.create_new): one of those
    fails, never follows, should anything be planted there meanwhile."""
    tmp = new_temporary(path)
    tmp.unlink()
    return tmp


@contextlib.contextmanager
def replacing(path: str | os.PathLike, sync: bool = True) -> Iterator[Path]:
    """`with replacing(p) as tmp: write tmp` - tmp is new_temporary's file; on success it is synced
    (unless sync is False: a file rewritten every few seconds that a power cut may lose) and published
    as p; on an error it is removed and p is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temporary(path)
    try:
        yield tmp
        if sync:
            fsync_path(tmp)
            publish(tmp, path)
        else:
            os.replace(tmp, path)
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
        os.unlink(tmp)  # link() makes the name itself, exclusively: the placeholder goes
        try:
            os.link(source, tmp)
            return True
        except FileExistsError:
            raise  # planted in the moment between: nothing is written through it
        except OSError:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
            write(tmp)
            return False


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, obj) -> Path:
    return write_text(path, json.dumps(obj, indent=2, default=str) + "\n")
