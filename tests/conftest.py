"""Test session set-up: this checkout's package on the path of every process the tests start."""

import logging
import os
from pathlib import Path

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


def pytest_terminal_summary(terminalreporter):
    """The test process's own memory at the end of the run, in every CI log: memory that in-process
    loaders keep shows here before a fork runs out of it (a DALI restore once left 17 GB of heap, and a
    later DataLoader worker's fork failed with ENOMEM)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:  # not Linux
        return
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    shown = ", ".join(f"{key} {status[key].strip()}" for key in ("VmData", "VmPeak", "VmHWM") if key in status)
    terminalreporter.write_line(f"test process memory at the end (heap, peak virtual, peak resident): {shown}")


# `make check` runs the fast tier on pytest-xdist workers (-n, --dist loadgroup). Each module is one group,
# so its module fixtures (a packed dataset, a finished run's files) are built once, on one worker; the two
# SLURM modules share one group: the test cluster is configured at the fixed path /etc/slurm/slurm.conf.
# `make test` stays serial: two demo trainings side by side on 2 cores ran at 3.7 img/s each, one alone
# at 6.7 (bench/RESULTS.md, "The test suite's wall time"): the trainings are most of the suite, and CPU-bound.
SHARED_GROUPS = {"test_slurm.py": "slurm", "test_slurm_requeue.py": "slurm"}


def module_group(item) -> str:
    name = item.path.name
    return SHARED_GROUPS.get(name, name)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(module_group(item)))
