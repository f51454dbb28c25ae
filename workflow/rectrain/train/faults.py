"""Failures on purpose, for the tests: each hook is an environment variable naming where to fail, so
a test can check what a real failure of that kind does to the job.  Unset - always, outside the
tests - they do nothing."""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)

# Why: a crash right after a checkpoint must resume at the next epoch (kill-and-resume test).
KILL_AFTER_EPOCH_ENV = "RECTRAIN_KILL_AFTER_EPOCH"
# Why: a rank hung in data loading (a hung filesystem) must be ended by the watchdog, named (watchdog test).
STALL_RANK_ENV = "RECTRAIN_STALL_RANK"
# Why: a rank dying while its peers wait in an all-reduce must end the job, naming it (crash test).
FAIL_RANK_ENV = "RECTRAIN_FAIL_RANK"


def _chosen(env: str, value: int) -> bool:
    return os.environ.get(env) == str(value)


def stall_loader(batches, rank: int):
    """The batches; with RECTRAIN_STALL_RANK=rank the loader sleeps for an hour before its second."""
    for i, batch in enumerate(batches):
        if i == 1 and _chosen(STALL_RANK_ENV, rank):
            log.info("%s=%d: this rank's loader stalls now, as on a hung filesystem", STALL_RANK_ENV, rank)
            time.sleep(3600)
        yield batch


def fail_rank(rank: int) -> None:
    """With RECTRAIN_FAIL_RANK=rank: raise as the epoch starts, while the peers go on to their all-reduce."""
    if _chosen(FAIL_RANK_ENV, rank):
        raise RuntimeError(f"injected failure ({FAIL_RANK_ENV}={rank})")


def kill_after_checkpoint(epoch: int) -> None:
    """With RECTRAIN_KILL_AFTER_EPOCH=epoch: `kill -9` this process once the epoch's checkpoint is written."""
    if _chosen(KILL_AFTER_EPOCH_ENV, epoch):
        log.info("%s=%d: killing this process as a crash would", KILL_AFTER_EPOCH_ENV, epoch)
        os.kill(os.getpid(), signal.SIGKILL)
