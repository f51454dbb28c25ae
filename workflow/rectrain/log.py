"""Logging for the stage modules: one set-up, the same lines in the rule logs as before.

Each module logs through `logging.getLogger(__name__)`; `setup(tag)` sends records to stderr
as `[tag] message`, or `[tag   12.3s] message` with the seconds since start when `elapsed` is set
(training, where the time of each line is the point).

Every line is printable: file and class names come from datasets, and a name holding terminal escape
codes (colours, cursor moves, a window title, a carriage return that overwrites the line) or
bidirectional overrides would act on the terminal or the log viewer instead of being read. Control
characters are written as Python escapes (ESC as \\x1b, a right-to-left override as \\u202e), the odd
bytes of a non-UTF-8 name as \\xNN; in the message's arguments (the names) line breaks and tabs too, so a
name cannot forge a log line.

A rule sends a stage's output to its log file, so its console lines would be seen only there: the
progress lines (rectrain.progress) and the lines logged with `extra=CONSOLE_LINE` (training's epoch
lines, resuming, starting over, moving a run aside).  When stderr is not a terminal, they are also
written to the console: under Snakemake, to the relay pipe the Snakemake process reads and copies to
its own stderr (RELAY_ENV, rectrain.snakefile.console), so they are on the console whether that is a
terminal, a file or a pipe (`> run.log 2>&1`, nohup), one line each, in the order they came; without
one, to the terminal the process still has (/dev/tty, and by its own path, RECTRAIN_TTY, in torchrun's
ranks, which run in sessions of their own).  RECTRAIN_CONSOLE=0 turns that off.

A stage that fails ends Snakemake's console with its cause in one line (rectrain.snakefile.causes): under
a Snakemake process that asks for it (CAUSE_ENV, a folder), each stage process writes the first line of
its first error record there, with the log file its stderr goes to - a rule's log - so that the
Snakemake process can say, after its own error block, why the job failed.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import json
import logging
import math
import os
import re
import stat
import sys
import time

# Seconds are counted from the import of this module, i.e. from the start of the stage process.
_WALL0 = time.time()
# The terminal a job started from a shell still has, whatever its stderr is redirected to.
CONSOLE = "/dev/tty"
PROGRESS_LOGGER = "rectrain.progress"
# The terminal's own path (/dev/pts/3), for child processes in a session of their own (torchrun's ranks).
TTY_ENV = "RECTRAIN_TTY"
# The Snakemake process's relay pipe (a FIFO's path): console lines written there reach its console.
RELAY_ENV = "RECTRAIN_CONSOLE_RELAY"
# `log.info(..., extra=CONSOLE_LINE)`: a line for the console too, not only the stage's log.
CONSOLE_LINE = {"console": True}
# The Snakemake process's folder for failing stages' one-line causes (rectrain.snakefile.causes).
CAUSE_ENV = "RECTRAIN_CAUSES"


_BIDI = "\u202a-\u202e\u2066-\u2069"
# The message keeps its own line breaks and tabs; an argument (a name) keeps none.
_IN_MESSAGE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}\ud800-\udfff]")
_IN_ARGUMENT = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}\ud800-\udfff]")


def utc_now() -> str:
    """Now, in UTC, to the second, as run.json and stopped.json record it (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _escape_char(match: re.Match) -> str:
    c = match.group()
    if "\udc80" <= c <= "\udcff":  # os.scandir's surrogateescape for a byte that is not UTF-8
        return f"\\x{ord(c) - 0xDC00:02x}"
    return c.encode("unicode_escape").decode("ascii")


def printable(text: str, pattern: re.Pattern = _IN_ARGUMENT) -> str:
    """text with control characters, bidirectional overrides and undecodable bytes escaped."""
    return pattern.sub(_escape_char, text)


def _printable_arg(arg):
    if isinstance(arg, os.PathLike):
        arg = os.fspath(arg)
    return printable(arg) if isinstance(arg, str) else arg  # numbers stay numbers, for %d


def _printable_args(args):
    """The values a message is formatted with (the names), escaped."""
    if isinstance(args, dict):
        return {key: _printable_arg(value) for key, value in args.items()}
    return tuple(_printable_arg(arg) for arg in args)


class _StageFormatter(logging.Formatter):
    def __init__(self, tag: str, elapsed: bool):
        super().__init__()
        self.tag, self.elapsed = tag, elapsed

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"[{self.tag} {record.created - _WALL0:6.1f}s]" if self.elapsed else f"[{self.tag}]"
        message = str(record.msg) % _printable_args(record.args) if record.args else str(record.msg)
        text = f"{prefix} {message}" if self.tag else message
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return printable(text, _IN_MESSAGE)


@functools.lru_cache(maxsize=None)
def _open_console(path: str):
    """The terminal, opened once per process (a stage sets up logging once; tests, many times)."""
    try:
        return open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    except OSError:
        return None


def terminal_path() -> str | None:
    """The terminal's own device path (/dev/pts/3) from whichever standard stream is still on it
    (a rule redirects stdout and stderr; stdin stays the shell's); None when none is."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                return os.ttyname(fd)
    return None


@functools.lru_cache(maxsize=None)
def _open_relay(path: str):
    """The Snakemake process's relay FIFO, opened once per process for writing; None when no process
    reads it (opened without blocking: a FIFO left from another run, or on another node, has no reader)."""
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return None
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None
    # Blocking writes from here on: a line waits for room in the pipe rather than being lost.
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "a", buffering=1)  # one write per line: atomic in a pipe (under PIPE_BUF)


class _ConsoleHandler(logging.StreamHandler):
    """The console lines' handler: a console that has gone (Snakemake killed, its pipe without a reader,
    the terminal closed) ends them, not the stage, and is not reported once per line in its log."""

    def handleError(self, record: logging.LogRecord) -> None:
        self.setLevel(logging.CRITICAL + 1)


def is_console_line(record: logging.LogRecord) -> bool:
    return record.name == PROGRESS_LOGGER or getattr(record, "console", False)


def console_handler(tag: str, elapsed: bool) -> logging.Handler | None:
    """A handler for the console lines, when stderr goes elsewhere (a rule's log): to Snakemake's relay
    pipe, else to the terminal the process has; None otherwise (a test, a batch job, stderr already the
    terminal)."""
    if os.environ.get("RECTRAIN_CONSOLE") == "0" or sys.stderr.isatty():
        return None
    stream = _open_relay(os.environ[RELAY_ENV]) if os.environ.get(RELAY_ENV) else None
    if stream is None:
        stream = _open_console(os.environ.get(TTY_ENV) or CONSOLE)
        if stream is None:
            return None
        path = terminal_path()
        if path:  # torchrun starts the ranks in new sessions, without /dev/tty
            os.environ[TTY_ENV] = path
    handler = _ConsoleHandler(stream)
    handler.setFormatter(_StageFormatter(tag, elapsed))
    handler.addFilter(is_console_line)
    return handler


def stderr_file() -> str | None:
    """The file this process's stderr is written to (a rule's log), where the system names it (Linux's
    /proc); None for a terminal, a pipe or elsewhere."""
    with contextlib.suppress(OSError):
        path = os.path.realpath(f"/proc/{os.getpid()}/fd/2")
        if os.path.isfile(path):
            return path
    return None


class _CauseHandler(logging.Handler):
    """The first error record of this process, its first line, as <folder>/<time>-<pid>.json: `line`,
    `log` (stderr_file) and `time` - what rectrain.snakefile.causes repeats at the end of the console."""

    def __init__(self, folder: str, formatter: logging.Formatter):
        super().__init__(logging.ERROR)
        self.folder, self.written = folder, False
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        if self.written:
            return
        self.written = True
        plain = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        first = (self.format(plain).splitlines() or [""])[0]
        cause = {"line": first, "log": stderr_file(), "time": record.created}
        path = os.path.join(self.folder, f"{time.time_ns()}-{os.getpid()}.json")
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(cause, f)
            os.replace(path + ".tmp", path)  # whole or absent for its reader


def cause_handler(tag: str, elapsed: bool) -> logging.Handler | None:
    """The handler that leaves this process's first error for the Snakemake process (CAUSE_ENV), when
    one asked for it; None otherwise."""
    folder = os.environ.get(CAUSE_ENV)
    return _CauseHandler(folder, _StageFormatter(tag, elapsed)) if folder and os.path.isdir(folder) else None


def setup(tag: str, elapsed: bool = False, level: int = logging.INFO, console_tag: str = "") -> logging.Logger:
    """Configure the `rectrain` logger for a stage process and return it.  `tag` '' prints bare lines;
    `console_tag`: the tag of the terminal's progress lines (default `tag`; a terminal shows several
    stages' lines)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_StageFormatter(tag, elapsed))
    console = console_handler(console_tag or tag or "rectrain", elapsed)
    cause = cause_handler(console_tag or tag or "rectrain", elapsed)
    # "__main__" too: a module run with `python -m` logs under that name, not under rectrain.*.
    for name in ("rectrain", "__main__"):
        logger = logging.getLogger(name)
        logger.handlers[:] = (
            [handler] + ([console] if console and name == "rectrain" else []) + ([cause] if cause else [])
        )
        logger.setLevel(level)
        logger.propagate = False
    return logging.getLogger("rectrain")


def duration(seconds: float) -> str:
    """'45 s', '12 min 05 s', '3 h 07 min', '2 d 04 h': the precision a deadline needs (progress lines, the report)."""
    if not math.isfinite(seconds):
        return "unknown"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600:02d} h"
