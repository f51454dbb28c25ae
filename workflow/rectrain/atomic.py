"""Write a file so that a reader (or a rerun after a kill or a power cut) never sees it half-written.

One mechanism for every output that must be all-or-nothing: write under a temporary name in the same
folder, fsync the file, rename it over the target, fsync the folder (a rename is durable only once
its directory is).  run.json, the pack manifests and the published .rec/.idx, checkpoints, the weights,
metrics and the report all go through here.

The temporary is created here and now (O_CREAT | O_EXCL | O_NOFOLLOW under a random name, never through
a link: a predictable name in results/ let another user who may write there plant a link at it, issue
#38), and it is written through the descriptor that created it, never opened again by name: in a
folder others may write to, the name can be swapped for a link between the create and a reopen, and
a racer won 2 of 1,500 such writes into a file of the victim's (issue #47).  Before the rename the
name is checked to still be that file.  A temporary left by a process killed mid-write (SIGKILL, a
power cut) is removed at the next start of training (remove_dead_temporaries).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from rectrain import safefs

log = logging.getLogger(__name__)

# A temporary's name: new_temporary's, with the pid of the process that made it.
TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp(?P<pid>\d+)\.[0-9a-f]{8}")


class TemporaryReplaced(OSError):
    """The temporary's name no longer leads to the file this process wrote (another process swapped it)."""


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


def create_temporary(path: str | os.PathLike, flags: int = os.O_WRONLY) -> tuple[Path, int]:
    """(name, descriptor) of an empty file of this process's own beside `path`, created exclusively under
    a random name (safefs.create_new: nothing already there, a planted link included, is opened or
    followed), with the mode the umask gives a new file, as the outputs always had."""
    path = Path(path)
    for _ in range(100):
        tmp = path.with_name(f"{temporary_prefix(path)}{os.getpid()}.{secrets.token_hex(4)}")
        try:
            return tmp, safefs.create_new(tmp, flags, mode=0o666)
        except FileExistsError:
            continue  # taken (or planted): another random name
    raise FileExistsError(f"no free temporary name beside {path} after 100 tries: remove the .tmp files there")


def new_temporary(path: str | os.PathLike) -> Path:
    """create_temporary's name, its descriptor closed: for a caller that only needs the name."""
    tmp, fd = create_temporary(path)
    os.close(fd)
    return tmp


def fresh_name(path: str | os.PathLike) -> Path:
    """A random hidden name beside `path` that nothing has (new_temporary's file, removed again), for a
    caller that creates it exclusively itself (os.symlink, os.link, safefs.create_new): one of those
    fails, never follows, should anything be planted there meanwhile."""
    tmp = new_temporary(path)
    tmp.unlink()
    return tmp


def still_ours(fd: int, tmp: Path) -> None:
    """TemporaryReplaced unless the name `tmp` still leads to the file open as `fd` (not a link to it)."""
    st, at = os.fstat(fd), os.lstat(tmp)
    if (st.st_dev, st.st_ino) != (at.st_dev, at.st_ino):
        raise TemporaryReplaced(
            f"{tmp} was replaced by another process while this one wrote it: nothing was published; make "
            f"{tmp.parent} writable by you alone"
        )


@contextlib.contextmanager
def replacing(path: str | os.PathLike, sync: bool = True, mode: str = "wb", **open_args) -> Iterator[IO]:
    """`with replacing(p) as f: f.write(...)` - f is the new temporary's descriptor opened as a file
    (`mode`, `open_args` as for open()); on success it is synced (unless sync is False: a file
    rewritten every few seconds that a power cut may lose) and published as p; on an error it is
    removed and p is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = create_temporary(path)
    try:
        with os.fdopen(fd, mode, **open_args) as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
            still_ours(f.fileno(), tmp)
        if sync:
            publish(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # the name only: unlink never follows a link


def write_with(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> Path:
    """Atomically create `path` with `write(binary_file)` (e.g. torch.save(obj, f), df.to_csv(f))."""
    with replacing(path) as f:
        write(f)
    return Path(path)


def link_or_write(source: str | os.PathLike, path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> bool:
    """Atomically make `path` a second name of the finished file `source` (a hard link: the same bytes,
    not written again), or, where the file system has no hard links, write it with `write(binary_file)`.
    True when linked.  A later write to either name replaces that name only (write_with renames a new
    file over it), so the two never change together."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_name(path)
    try:
        os.link(source, tmp)  # makes the name itself, exclusively: a name planted meanwhile fails it
    except FileExistsError:
        raise
    except OSError:
        write_with(path, write)
        return False
    try:
        if os.lstat(tmp).st_ino != os.stat(source).st_ino:
            raise TemporaryReplaced(
                f"{tmp} was replaced by another process before it was published: make {tmp.parent} yours alone"
            )
        fsync_path(tmp)
        publish(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return True


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return write_with(path, lambda f: f.write(data))


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj) -> Path:
    return write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_dead_temporaries(folder: str | os.PathLike) -> list[str]:
    """Remove the temporaries in `folder` left by processes of this user that are gone (killed while
    writing): regular files of this user, named by TEMPORARY with a pid no process has.  Returns the
    names removed.  A live process's temporary (a pid in use again included) is left alone."""
    gone = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(folder):
            found = TEMPORARY.fullmatch(entry.name)
            if found is None or _alive(int(found["pid"])):
                continue
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    gone.append(entry.name)
    if gone:
        log.info("removed %d temporary file(s) of killed processes in %s: %s", len(gone), folder, ", ".join(gone))
    return gone
