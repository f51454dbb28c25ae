"""Folders and files made where another user may have planted something first.

A folder is ours to write in when it is a real directory (not a symbolic link), owned by us, not
writable by other users, inside a parent no other user can swap it in (owned by us or root, and not
writable by others unless sticky, as /tmp is). Files in it are created new - O_CREAT | O_EXCL |
O_NOFOLLOW - so a name planted there (a link to a victim file, dangling or not) makes the create fail
instead of being written through. The node-local staging folder (rectrain.train.local_copy) and the
pack's <fast_storage>/<dataset>/ (rectrain.data.pack) are both checked here.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

# refuse(path, why) -> the exception to raise: each caller names its folder and its fix.
Refuse = Callable[[Path, str], Exception]

_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_parent(parent: Path, refuse: Refuse) -> None:
    """A folder another user owns, or may write to without the sticky bit, lets them swap ours."""
    st = os.stat(parent)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise refuse(parent, f"(the folder it is created in) belongs to {owner(st.st_uid)}, not to you")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise refuse(parent, "(the folder it is created in) is writable by other users and not sticky")


def owned_dir(path, refuse: Refuse, mode: int = 0o700) -> Path:
    """Create `path` (and missing parents) with `mode`, or check that the existing one is a real
    directory of this user in a safe parent; then take away every permission bit `mode` lacks (the
    owner keeps rwx), so other users can no longer plant anything in it. Raises refuse(path, why)."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        check_parent(d.parent, refuse)
        try:
            os.mkdir(d, mode)
        except FileExistsError:  # another process made it first; checked below like any existing one
            pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise refuse(path, f"is a symbolic link (to {os.readlink(path)}, owned by {owner(st.st_uid)})")
    if not stat.S_ISDIR(st.st_mode):
        raise refuse(path, "exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise refuse(path, f"belongs to {owner(st.st_uid)}, not to you ({owner(os.geteuid())})")
    check_parent(path.parent, refuse)
    now = stat.S_IMODE(st.st_mode)
    wanted = (now & mode) | 0o700
    if now != wanted:
        os.chmod(path, wanted, follow_symlinks=False)
        if now & ~mode & (stat.S_IWGRP | stat.S_IWOTH):
            log.info(
                "%s was writable by other users (mode %o): now %o, so nobody else can plant files there",
                path,
                now,
                wanted,
            )
    return path


def create_new(path, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """A descriptor of a file created here and now: FileExistsError when anything, a link included,
    already has the name (nothing is followed, truncated or written through)."""
    return os.open(path, flags | _NEW, mode)


class NotRegular(OSError):
    """A path that should be a regular file is a FIFO, device, socket or folder; names it."""


_SPECIAL = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def special_file(mode: int) -> str:
    """What a file that is not regular is, in words ("a named pipe (FIFO)", ...)."""
    return next((what for test, what in _SPECIAL if test(mode)), "a special file")


def not_a_file(path) -> str | None:
    """Why `path` is no file to read ("no such file", "a named pipe (FIFO), not a regular file"), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "no such file"
    return None if stat.S_ISREG(mode) else f"{special_file(mode)}, not a regular file"


def open_regular(path, what: str = "file"):
    """A binary reader of `path` (links followed), opened without blocking: a FIFO swapped in for a
    file would hang a blocking open until someone writes to it. NotRegular for anything but a
    regular file, naming what it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(f"{path} ({what}) is {special_file(mode)}, not a regular file: point it at the file itself")
    return os.fdopen(fd, "rb")
