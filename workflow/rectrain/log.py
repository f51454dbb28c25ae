"""Logging for the stage modules: one set-up, the same lines in the rule logs as before.

Each module logs through `logging.getLogger(__name__)`; `setup(tag)` sends records to stderr
as `[tag] message`, or `[tag   12.3s] message` with the seconds since start when `elapsed` is set
(training, where the time of each line is the point).
"""

from __future__ import annotations

import logging
import sys
import time

# Seconds are counted from the import of this module, i.e. from the start of the stage process.
_WALL0 = time.time()


class _StageFormatter(logging.Formatter):
    def __init__(self, tag: str, elapsed: bool):
        super().__init__()
        self.tag, self.elapsed = tag, elapsed

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"[{self.tag} {record.created - _WALL0:6.1f}s]" if self.elapsed else f"[{self.tag}]"
        text = f"{prefix} {record.getMessage()}" if self.tag else record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup(tag: str, elapsed: bool = False, level: int = logging.INFO) -> logging.Logger:
    """Configure the `rectrain` logger for a stage process and return it.  `tag` '' prints bare lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_StageFormatter(tag, elapsed))
    # "__main__" too: a module run with `python -m` logs under that name, not under rectrain.*.
    for name in ("rectrain", "__main__"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
    return logging.getLogger("rectrain")
