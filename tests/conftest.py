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


# `make test` runs the suite on pytest-xdist workers (-n, --dist loadgroup). Each module is one group, so
# its module fixtures (a finished demo pipeline, a packed dataset) are built once, on one worker. The two
# SLURM modules share one group: the test cluster is configured at the fixed path /etc/slurm/slurm.conf.
SHARED_GROUPS = {"test_slurm.py": "slurm", "test_slurm_requeue.py": "slurm"}
# The groups that take longest (measured: the --durations table of a CI log) start first, so no worker
# is left with a long module at the end while the other idles. The rest follow in collection order.
LONGEST_FIRST = [
    "slurm",
    "test_pipeline_e2e.py",
    "test_train_preempt.py",
    "test_train_run.py",
    "test_finished_run_survives.py",
    "test_compiled_calibration.py",
    "test_small_runs.py",
    "test_train_calibration.py",
    "test_datasets_side_by_side.py",
    "test_recipes.py",
    "test_byo_recordio.py",
    "test_progressive.py",
]


def test_group(item) -> str:
    name = item.path.name
    return SHARED_GROUPS.get(name, name)


def pytest_collection_modifyitems(config, items):
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(test_group(item)))
    items.sort(key=lambda item: rank.get(test_group(item), len(rank)))  # stable: collection order within
