"""This user's Snakemake runs on this machine, for `make stop`: each run's own entry in a folder only
this user can write, read back only while the process it names is still the one that wrote it.

The Snakemake process of a run registers itself from its onstart hook (rectrain.snakefile.hooks):
`<folder>/<host>-<pid>.json`, created exclusively and without following links (safefs.create_new) in
$XDG_CACHE_HOME/rectrain/runs (default ~/.cache/rectrain/runs; safefs.owned_dir: a real folder of
this user's, 0700, in a parent no one else may write), holding its pid, its start time (psutil's
create_time), its working directory and the host.  The entry is removed when the process ends, by
its name in that folder (unlink never follows a link).

`python -m rectrain.snakefile.runs stop [PID]` (`make stop`, `make stop RUN=<pid>`) sends SIGTERM to
every run of the working directory it is started in - several pipelines in one folder (a `make
report` beside a training) each have an entry - or to the one named, and only to a process whose pid,
start time and user are the entry's.  Before (issue 47), one pid file in the working folder's
.snakemake/ was trusted: another user's .snakemake/ in a shared folder made `make stop` signal any
process of the victim's whose command line held "snakemake", a link planted at the pid file had the
pid written into, and then deleted, the file it led to, and a second pipeline in the folder took the
pid file over, so `make stop` found no run while the training went on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from rectrain import safefs

# An entry is a few hundred bytes; more is not one.
MAX_ENTRY_BYTES = 64 << 10
# psutil's create_time, read by two processes, may differ by its rounding of the boot time.
START_SLACK_S = 0.05


class RunsFolderError(OSError):
    """The folder of the entries is not this user's alone; names it and why."""


def folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rectrain" / "runs"


def _own_folder() -> Path:
    return safefs.owned_dir(folder(), lambda path, why: RunsFolderError(f"{path} {why}: make stop cannot use it"))


@dataclass(frozen=True)
class Entry:
    """One run's entry: its process (pid and start time), its working directory, its host."""

    pid: int
    start: float
    workdir: str
    host: str

    @property
    def name(self) -> str:
        return f"{self.host}-{self.pid}.json"

    def process(self) -> psutil.Process | None:
        """The process the entry names when it is still the one that wrote it (this user's), else None."""
        try:
            proc = psutil.Process(self.pid)
            same = abs(proc.create_time() - self.start) <= START_SLACK_S and proc.uids().real == os.getuid()
        except psutil.Error:
            return None
        return proc if same else None


def register() -> Path:
    """This process's entry (see the module doc); returns its path, for unregister."""
    me = psutil.Process()
    entry = Entry(os.getpid(), me.create_time(), os.path.realpath(os.getcwd()), socket.gethostname())
    path = _own_folder() / entry.name
    with contextlib.suppress(FileNotFoundError):
        stale = read(path)
        if stale is None or stale.process() is None:  # a process of that pid that is gone: its leftover
            os.unlink(path)
    fd = safefs.create_new(path, os.O_WRONLY, mode=0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(entry.__dict__, f)
    return path


def unregister(path: Path) -> None:
    """Remove this process's entry, when it is still this process's (by name: no link followed)."""
    entry = read(path)
    if entry is not None and entry.pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def read(path: Path) -> Entry | None:
    """The entry at `path`: None when it is not a regular file of this user's holding one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        try:
            found = json.loads(f.read(MAX_ENTRY_BYTES))
            return Entry(int(found["pid"]), float(found["start"]), str(found["workdir"]), str(found["host"]))
        except (ValueError, KeyError, TypeError):
            return None


def runs_here(workdir: str | os.PathLike) -> list[tuple[Entry, psutil.Process]]:
    """This user's live runs on this host in `workdir`; entries of ended processes are removed."""
    where, host, found = os.path.realpath(workdir), socket.gethostname(), []
    base = folder()
    if not base.is_dir():
        return []
    for path in sorted(base.glob(f"{host}-*.json")):
        entry = read(path)
        proc = entry.process() if entry is not None else None
        if proc is None:
            with contextlib.suppress(OSError):
                os.unlink(path)
        elif entry.workdir == where:
            found.append((entry, proc))
    return found


def stop(workdir: str | os.PathLike, pid: int | None = None) -> list[str]:
    """SIGTERM to every run in `workdir` (or to the one of pid `pid`); the lines to print."""
    found = runs_here(workdir)
    chosen = [(e, p) for e, p in found if pid is None or e.pid == pid]
    if not chosen:
        if pid is not None and found:
            going = ", ".join(str(e.pid) for e, _ in found)
            return [f"make stop: pid {pid} is no run of yours in this folder; the runs here are pids {going}"]
        return [f"make stop: no run is going in this folder (no Snakemake run of yours registered in {folder()})"]
    lines = []
    for entry, proc in chosen:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM)
            lines.append(f"make stop: asked Snakemake (pid {entry.pid}) to stop; it ends after training's checkpoint")
    return lines


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "stop" or len(argv) > 2 or (len(argv) == 2 and not argv[1].isdigit()):
        print("usage: python -m rectrain.snakefile.runs stop [PID]", file=sys.stderr)
        return 2
    for line in stop(os.getcwd(), int(argv[1]) if len(argv) == 2 else None):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
