"""The console of a Snakemake run: the jobs' console lines and, at the end, the report's path.

A rule sends its stage's output to its log file.  The lines a user watches for (progress, training's
epoch lines, resuming, starting over, moving a run aside: rectrain.log's console lines) would be only
there, or only on a terminal the job can open; with the console a file or a pipe (`> run.log 2>&1`,
nohup, a CI log) nothing would show.  So the Snakemake process makes a relay: a FIFO whose path its
jobs find in RELAY_ENV, read by a thread that copies what comes to Snakemake's own stderr, where its
job lines go.  A line is one write, atomic in a pipe, so lines of several ranks never mix; none is
redrawn.  Only for jobs run on this machine: a FIFO has no reader on another node.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from rectrain.log import RELAY_ENV

# The rules whose output is a report: the run ends by naming what they wrote.
REPORT_RULES = ("report", "current_report", "compare")  # a sweep: its comparison, the shortest path


class Relay:
    """Reads the FIFO and writes what comes to `out_fd` (Snakemake's stderr) as it comes."""

    def __init__(self, out_fd: int = 2):
        self.out_fd = out_fd
        self.folder = Path(tempfile.mkdtemp(prefix="rectrain-console-"))
        self.path = self.folder / "relay"
        os.mkfifo(self.path, 0o600)
        # Read and write: the pipe never reads as closed when the last job closes its end.
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        self.lock = threading.RLock()  # drain() also runs in a signal handler (rectrain.snakefile.stopping)
        self.closed = False
        threading.Thread(target=self._copy, name="rectrain-console", daemon=True).start()

    def _copy(self) -> None:
        while not self.closed:
            select.select([self.fd], [], [], 1.0)
            self.drain()

    def drain(self) -> None:
        """Copy what the pipe holds now (also at the end, so a job's last lines come before Snakemake's)."""
        with self.lock:
            while True:
                try:
                    data = os.read(self.fd, 65536)
                except BlockingIOError:
                    return
                if not data:
                    return
                with contextlib.suppress(OSError):
                    os.write(self.out_fd, data)

    def close(self) -> None:
        """The last lines, then the FIFO gone (the read end stays open until the process ends)."""
        self.closed = True
        self.drain()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_relay(workflow) -> Relay | None:
    """The relay for the jobs this Snakemake process runs itself (none under a cluster executor)."""
    if not workflow.local_exec:
        return None
    relay = Relay(sys.stderr.fileno())
    os.environ[RELAY_ENV] = str(relay.path)  # the jobs started from here inherit it
    return relay


def reports_to_build(workflow) -> list[Path]:
    """The reports this run will write (onstart: the jobs still to run), to name at its end."""
    jobs = workflow.dag.needrun_jobs()
    return [Path(out).resolve() for job in jobs if job.rule.name in REPORT_RULES for out in job.output]


def report_line(reports: list[Path]) -> str | None:
    """The run's last line when it wrote a report: where to open it (the copy at results/report.html
    when it made one, the dataset's own report otherwise)."""
    if not reports:
        return None
    shown = min(reports, key=lambda p: len(p.parts))  # results/report.html before results/<ds>/report.html
    return f"report: {shown}"
