"""Test session set-up: this checkout's package on the path of every process the tests start."""

import logging
import os

import pytest
from helpers import REPO

# A second worktree sharing one editable-installed venv must test its own code, in subprocesses too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "workflow"), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(autouse=True)
def _fresh_stage_logging():
    """A stage's main() run in-process configures the rectrain loggers (rectrain.log.setup) with a
    handler on the stderr pytest captured for that test; later tests must start unconfigured."""
    yield
    for name in ("rectrain", "__main__"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
