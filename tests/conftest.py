"""Test session set-up: this checkout's package on the path of every process the tests start."""

import os

# OpenMP threads (torch's intra-op pool, libgomp) that finish a parallel region spin for the next one by
# default: on this 2-core box, beside 2 other test workers, that spinning took a third of a one-process
# training's CPU (a squeezenet run checkpointing every step: 14.8 CPU-s, 5.7 with PASSIVE; measured with
# perf, bench/RESULTS.md). Set before torch loads libgomp; every process the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers import REPO  # noqa: E402

# `make test` runs this suite: the make variables it exports (MAKELEVEL, MAKEFLAGS with its jobserver) would
# make every `make` a test starts a sub-make of it, which prints "Entering directory" lines around what the
# test reads (a user's `make stop` from a shell prints none; CI failed on exactly that).
for _name in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES"):
    os.environ.pop(_name, None)

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


# `make test` and `make check` run on pytest-xdist workers (-n 2, --dist loadgroup). Each module is one
# group, so its module fixtures (a packed dataset, a finished run's files) are built once, on one worker;
# the two SLURM modules share one group: the test cluster is configured at the fixed path
# /etc/slurm/slurm.conf. A demo training already keeps both cores busy, so two side by side gain nothing
# (bench/RESULTS.md, "The test suite's wall time"); what two workers win is the waits - the SLURM
# tests' scheduler cycles, a pipeline's job start-ups, the timeouts that tests provoke - which the other
# worker fills with work.
SHARED_GROUPS = {"test_slurm.py": "slurm", "test_slurm_requeue.py": "slurm"}
# The groups that take longest (the --durations table of a CI log), started first so no worker is left
# with a long module at the end; the SLURM pair first of all, as it mostly waits. xdist's loadgroup
# scheduler would hand out the groups with the most tests first (LoadScopeScheduling sorts its work queue
# by test count): in a 3-worker run of 2026-12-03 the SLURM pair started at 198 s. The Makefile's
# --no-loadscope-reorder makes it keep this order (bench/RESULTS.md, "The test suite's wall time").
LONGEST_FIRST = [
    "slurm",
    "test_pipeline_e2e.py",
    "test_own_model_pipeline.py",
    "test_finished_run_survives.py",
    "test_train_world_size.py",
    "test_datasets_side_by_side.py",
    "test_subset_pipeline.py",
    "test_live_report_run.py",
    "test_train_run.py",
    "test_train_preempt.py",
    "test_small_set_learns.py",
    "test_train_divergence.py",
    "test_evaluate.py",
    "test_readme_commands.py",
    "test_progressive.py",
    "test_byo_recordio.py",
    "test_recipes_today.py",
    "test_recipes.py",
    "test_gpu_check.py",
    "test_multinode.py",
]


def module_group(item) -> str:
    name = item.path.name
    return SHARED_GROUPS.get(name, name)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the test ids
def pytest_collection_modifyitems(config, items):
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(module_group(item)))
    items.sort(key=lambda item: rank.get(module_group(item), len(rank)))  # stable: collection order within
