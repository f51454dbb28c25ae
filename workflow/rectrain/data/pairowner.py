"""Which run a published .rec/.idx pair belongs to: a pair is never replaced under another run.

Two runs in different working directories that share pack.fast_storage and a dataset name write the
same <fast_storage>/<dataset>/<split>.rec; publishing one run's pack over the other's gave that run's
new readers wrong or unreadable records (issue #26). So each published pair gets a stamp beside it,
``.<split>.rec.run.json``, naming the working directory that produced it, and a pack started from
another working directory refuses to replace it, naming that run, while that directory still exists.
A run whose directory is gone (moved or deleted) no longer owns its pair.

A brought pair (rectrain.data.byo_recordio) is published as links to the user's files, which stay
theirs to change: its stamp also records what the check read (`checked`: device, inode, size,
modification and change time of the .rec and .idx), and the loaders refuse the pair once either no
longer matches (refuse_changed), naming the command that checks it again (issue #38).  The change time
(ctime) is the kernel's own: a rewrite in place that restores the size and the modification time
(os.utime) still moves it (issue #47).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from rectrain.atomic import write_json


class PairTaken(RuntimeError):
    """The pair belongs to a run in another working directory; names it and the fix."""


def stamp_path(rec: Path) -> Path:
    return rec.with_name(f".{rec.name}.run.json")


def _read(stamp: Path) -> dict | None:
    try:
        with open(os.open(stamp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)) as fh:
            found = json.load(fh)
    except (OSError, ValueError):
        return None  # none, or not one this pack wrote: nothing names another run
    return found if isinstance(found, dict) else None


def check(rec: Path) -> None:
    """PairTaken when the pair at `rec` was published by a run in another existing working directory."""
    stamp = stamp_path(rec)
    owner = _read(stamp)
    here = os.path.realpath(os.getcwd())
    other = owner.get("workdir") if owner else None
    if not isinstance(other, str) or other == here or not os.path.isdir(other):
        return
    raise PairTaken(
        f"{rec} belongs to the run in {other} (packed on {owner.get('host', '?')} at {owner.get('published', '?')}); "
        f"this run in {here} shares its pack.fast_storage and dataset name, and replacing the pair would hand "
        "that run's readers records of another pack. Give this run a pack.fast_storage of its own (a relative "
        f"path stays inside its working directory), or, if the run in {other} no longer needs the pair, "
        f"remove {stamp} and rerun"
    )


def claim(rec: Path, checked: dict | None = None) -> None:
    """Record that the pair just published at `rec` belongs to this working directory, and (a brought
    pair) `checked`: file_identity of each file the check read, by kind (rec, idx)."""
    here = os.path.realpath(os.getcwd())
    published = time.strftime("%Y-%m-%d %H:%M:%S")
    stamp = {"workdir": here, "host": socket.gethostname(), "published": published}
    write_json(stamp_path(rec), {**stamp, "checked": checked} if checked else stamp)


def file_identity(path) -> dict:
    """What says a file is still the one that was read: device, inode, size, modification and change
    time (ns; no one can set the change time back)."""
    st = os.stat(path)
    return {
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


RECHECK = "snakemake --forcerun check_recordio (or rerun python -m rectrain.data.byo_recordio)"


class PairChanged(RuntimeError):
    """A brought pair is no longer the one its check read; names the file and the command that re-checks."""


def refuse_changed(rec, idx) -> None:
    """PairChanged when the pair at rec/idx was published by check_recordio and the .rec or .idx it
    leads to is no longer the file checked (replaced, rewritten, truncated); nothing for a packed pair."""
    checked = (_read(stamp_path(Path(rec))) or {}).get("checked")
    if not isinstance(checked, dict):
        return
    for kind, path in (("rec", rec), ("idx", idx)):
        try:
            now = file_identity(path)
        except OSError as err:
            now = {"error": err.strerror}
        then = checked.get(kind)
        if isinstance(then, dict) and "ctime_ns" not in then:  # a stamp written before ctime was recorded
            now.pop("ctime_ns", None)
        if now != then:
            raise PairChanged(
                f"{path} (-> {os.path.realpath(path)}) is not the .{kind} check_recordio checked ({checked.get(kind)}, now "
                f"{now}): it was replaced or rewritten since, and its records are unchecked. Check it again: {RECHECK}"
            )
