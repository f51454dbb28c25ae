"""Which run a published .rec/.idx pair belongs to: a pair is never replaced under another run.

Two runs in different working directories that share pack.fast_storage and a dataset name write the
same <fast_storage>/<dataset>/<split>.rec; publishing one run's pack over the other's gave that run's
new readers wrong or unreadable records (issue #26). So each published pair gets a stamp beside it,
``.<split>.rec.run.json``, naming the working directory that produced it, and a pack started from
another working directory refuses to replace it, naming that run, while that directory still exists.
A run whose directory is gone (moved or deleted) no longer owns its pair.
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


def claim(rec: Path) -> None:
    """Record that the pair just published at `rec` belongs to this working directory."""
    here = os.path.realpath(os.getcwd())
    published = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(stamp_path(rec), {"workdir": here, "host": socket.gethostname(), "published": published})
