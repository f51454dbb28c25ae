"""A failed run ends its console with each failed job's cause, in one line, after all Snakemake prints.

Snakemake's console after a failed job held its error block - every input (a stage's ~40 source files),
the shell command twice, the job's whole log (a torchrun traceback) - then its own closing lines, and
the stage's one line was lost in the middle.  So, for the jobs this process runs itself:

- each stage process leaves the first line of its first error record in a folder this process names
  (rectrain.log.CAUSE_ENV), with the log file its stderr goes to;
- Snakemake's console handler prints a failed job's error block short (`ShortErrors`: the rule, the job
  and its log), and the whole block - without the log it already is - is appended to the job's log;
- at exit, after Snakemake's last line, `Causes.lines` says for each failed job why: the earliest cause
  its processes left, else the last line of its log.

The console handler is Snakemake's own (a logger plugin would replace it for every command and must be
an installed package chosen with --logger): only its formatter is wrapped, so Snakemake's log file
under .snakemake/log/ keeps the whole block too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rectrain.log import CAUSE_ENV, printable

# A stage line's "[train   12.3s] " prefix: the cause line says the rule itself.
_TAG = re.compile(r"^\[[^\]]*\] ")
# What precedes Snakemake's error block where it is appended to the job's log.
BLOCK = "---- Snakemake's error block for this job ----"
# The shell command Snakemake repeats in its RuleException (a few KB of JSON params).
_COMMAND = re.compile(r"Command '.*' returned non-zero exit status (\d+)\.", re.S)


@dataclass(frozen=True)
class FailedJob:
    rule: str
    logs: tuple[Path, ...]  # absolute


def _event(record: logging.LogRecord) -> str:
    return str(getattr(record, "event", "") or "")


class Causes:
    """The causes folder of one Snakemake run and the jobs that failed in it (see the module doc)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="rectrain-causes-"))
        self.failed: list[FailedJob] = []

    def note(self, record: logging.LogRecord) -> bool:
        """Snakemake's logger filter: remembers each failed job; keeps every record."""
        if _event(record) == "job_error":
            logs = tuple(Path(p).resolve() for p in getattr(record, "log", None) or [])
            self.failed.append(FailedJob(str(getattr(record, "rule_name", "?")), logs))
        return True

    def left(self) -> list[dict]:
        """What the stage processes left, oldest first."""
        found = []
        for path in self.folder.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                found.append(json.loads(path.read_text(encoding="utf-8")))
        return sorted(found, key=lambda c: c.get("time") or 0)

    def lines(self) -> list[str]:
        """One line per failed job: its cause and its log."""
        left, out = self.left(), []
        for job in self.failed:
            mine = [c for c in left if c.get("log") and Path(c["log"]) in job.logs]
            cause = _TAG.sub("", mine[0]["line"]) if mine else last_line(job.logs)
            where = f" (log: {os.path.relpath(job.logs[0])})" if job.logs else ""
            out.append(f"{job.rule} failed: {cause}{where}")
        return out

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def last_line(logs: tuple[Path, ...]) -> str:
    """The last line of the first log that says something (not a rule of '=' or '-'), before the error
    block appended to it (`keep_in_logs`), escaped."""
    for log in logs:
        with contextlib.suppress(OSError):
            text = log.read_text(errors="replace").split(BLOCK)[0]
            lines = [ln.strip() for ln in text.splitlines()]
            said = [ln for ln in lines if ln.strip("=- ")]
            if said:
                return printable(_TAG.sub("", said[-1]))
    return "the job's log says nothing (see Snakemake's error block in .snakemake/log/)"


class ShortErrors(logging.Formatter):
    """Snakemake's console formatter with a failed job's error block short and its RuleException without
    the command; the whole block goes to the end of the job's log (see the module doc)."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        event = _event(record)
        if event == "job_error":
            keep_in_logs(record)
            logs = ", ".join(getattr(record, "log", None) or []) or "none"
            return (
                f"Error in rule {getattr(record, 'rule_name', '?')} (job {getattr(record, 'jobid', '?')}): its log "
                f"{logs} ends with Snakemake's whole error block; the cause is the last line of this run"
            )
        text = self.inner.format(record)
        if event == "error" and getattr(record, "exception", None) == "RuleException":
            return _COMMAND.sub(r"its shell command exited with status \1.", text)
        return text


def keep_in_logs(record: logging.LogRecord) -> None:
    """Append Snakemake's whole error block for the job (the log itself left out) to the job's log."""
    from snakemake.logging import DefaultFormatter

    block = DefaultFormatter(show_failed_logs=False).format(record)
    for log in getattr(record, "log", None) or []:
        with contextlib.suppress(OSError), open(log, "a", encoding="utf-8") as f:
            f.write(f"\n{BLOCK}\n{block}\n")


def install(workflow) -> Causes | None:
    """For the jobs this process runs itself (none under a cluster executor): the folder the stages
    find in CAUSE_ENV, the logger filter, and the short error block on Snakemake's console handler."""
    if not workflow.local_exec:
        return None
    from snakemake.logging import logger

    causes = Causes()
    os.environ[CAUSE_ENV] = str(causes.folder)  # the jobs started from here inherit it
    logger.addFilter(causes.note)
    for handler in logger.handlers:
        if handler.name == "DefaultStreamHandler" and handler.formatter is not None:
            handler.setFormatter(ShortErrors(handler.formatter))
    return causes
