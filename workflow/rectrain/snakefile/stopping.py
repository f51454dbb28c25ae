"""Stopping a run through its Snakemake process: SIGINT or SIGTERM to it alone stops training cleanly.

What Snakemake 9 does by itself (snakemake/scheduling/job_scheduler.py, executors/local.py): a job
runs as `bash -c '<the rule's command>'`, its child, in Snakemake's own process group.  SIGTERM to the
Snakemake process only sets "exit after the running jobs finish": training went on to its end.  SIGINT
raises KeyboardInterrupt in its scheduler, which prints "Terminating processes on user request" and
shuts its thread pool down - waiting for the running jobs, which nothing signalled: training went on
too.  Only Ctrl-C in a terminal stopped training, because the terminal signals the whole foreground
process group, the train job's launcher included.

So, for the jobs this process runs itself, `install` (the onstart hook) replaces both handlers: the
signal is forwarded to each running job's command (the child of its shell: training's launcher, which
has its ranks write their checkpoint and end, rectrain.train.lifecycle.supervise), and Snakemake is
told to start nothing more and end once they have (its own SIGTERM handling).  A second signal is
forwarded again (a rank that does not reach its next step then dumps its stacks).

When training stopped with its checkpoint written (checkpoints/stopped.json written after the signal),
the run ends with one line saying where it stopped and how to go on, instead of Snakemake's error
block for the train job, and Snakemake exits with EXIT_STOPPED (75, as the train job does).
Otherwise (a stop while another stage ran, a job that failed on its own) Snakemake's own report and
exit status stand.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

from rectrain.train.lifecycle.status import EXIT_STOPPED, STOP_GRACE_S, STOPPED

# A job's command runs under Snakemake's shell; the signal goes to the command, not to the shell
# (bash ended by SIGTERM would leave its command running, and Snakemake would count the job failed).
SHELLS = {"bash", "sh", "dash", "zsh"}
# stopped.json written this long before the signal still counts (file times are coarse on some disks).
CLOCK_SLACK_S = 2.0


def job_commands(snakemake: psutil.Process) -> list[psutil.Process]:
    """The processes to signal: each job's command (the child of its shell, or the job itself)."""
    found = []
    for child in snakemake.children():
        with contextlib.suppress(psutil.NoSuchProcess):
            found += child.children() if child.name() in SHELLS else [child]
    return found


def stopped_since(ck_dir: Path, since: float) -> dict | None:
    """stopped.json when rank 0 wrote it after `since` (a time.time()): training stopped cleanly."""
    marker = Path(ck_dir) / STOPPED
    with contextlib.suppress(OSError, ValueError):
        if marker.stat().st_mtime >= since - CLOCK_SLACK_S:
            info = json.loads(marker.read_text())
            return info if isinstance(info, dict) else None
    return None


def final_line(info: dict, ck_dir: Path) -> str:
    """The run's one last line after a clean stop: what was kept and how to go on."""
    resumes = f" at {info['resumes_at']}" if info.get("resumes_at") else ""
    return (
        f"stopped on {info.get('signal', 'a stop signal')} after {info.get('after', 'a step')}: the checkpoint "
        f"{Path(ck_dir) / 'last.pt'} holds the run; run the same command again to continue{resumes} "
        f"(exit status {EXIT_STOPPED}: stopped, resumable)"
    )


class Stop:
    """The stop of one Snakemake run (see the module doc)."""

    def __init__(self, workflow, ck_dir: Path | list[Path], relay=None, out=None):
        # read by its full path (a job may change the directory), named as the config does; one folder
        # per run of the config (a sweep's runs train side by side): the first that stopped is named
        self.dirs = [(Path(d), Path(d).resolve()) for d in (ck_dir if isinstance(ck_dir, list) else [ck_dir])]
        self.workflow, self.relay = workflow, relay
        self.shown, self.ck_dir = self.dirs[0]
        self.out = out or sys.stderr
        self.signum, self.at = 0, 0.0

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.signum:
            self.signum, self.at = signum, time.time()
            self.say(
                f"{name}: asking the running job(s) to stop; training writes its checkpoint first (torchrun "
                f"waits up to {STOP_GRACE_S} s for it), then this run ends"
            )
        self.forward(signum)
        # Snakemake's own SIGTERM handling: start no new job, end once the running ones have.  From a
        # thread: it takes the scheduler's lock, which the main thread this handler interrupts may hold.
        threading.Thread(target=self.workflow.scheduler.exit_gracefully, daemon=True).start()

    def forward(self, signum: int) -> None:
        for proc in job_commands(psutil.Process()):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signum)

    def stopped(self) -> dict | None:
        if not self.signum:
            return None
        for shown, ck_dir in self.dirs:
            info = stopped_since(ck_dir, self.at)
            if info is not None:
                self.shown, self.ck_dir = shown, ck_dir
                return info
        return None

    def keep_record(self, record: logging.LogRecord) -> bool:
        """Snakemake's logger filter: after a clean stop, its error block for the train job and its
        'did not complete' error are not errors."""
        return record.levelno < logging.ERROR or self.stopped() is None

    def say(self, text: str) -> None:
        if self.relay is not None:
            self.relay.drain()  # the jobs' last lines first
        # one unbuffered write: a signal handler may interrupt a buffered write to the same stream
        os.write(self.out.fileno(), f"[rectrain] {text}\n".encode())

    def finish(self) -> None:
        """At exit (Snakemake has ended: its lock released, its log written): after a clean stop, the
        one last line, and EXIT_STOPPED instead of the status 1 Snakemake exits with for the train job it
        counts as failed."""
        info = self.stopped()
        if info is None:
            return
        self.say(final_line(info, self.shown))
        sys.stdout.flush()
        os._exit(EXIT_STOPPED)


def install(workflow, ck_dir: Path | list[Path], relay=None) -> Stop | None:
    """The onstart hook's part: SIGINT and SIGTERM stop the jobs this process runs (none under a cluster
    executor, whose own handling cancels its jobs); `finish` is for the end of the process."""
    if not workflow.local_exec:
        return None
    stop = Stop(workflow, ck_dir, relay)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop.handle)
    from snakemake.logging import logger

    logger.addFilter(stop.keep_record)
    return stop
