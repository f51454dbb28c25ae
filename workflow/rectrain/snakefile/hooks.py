"""What the Snakemake process itself does around its jobs, from the onstart and onsuccess hooks
(workflow/rules/common.smk): the console relay of the jobs' lines (console), the stop on SIGINT or
SIGTERM (stopping, and `make stop` through this run's entry: runs), and the report's path as the
run's last line."""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from rectrain.snakefile import console, runs, stopping

# One run per Snakemake process: what onstart found, for onsuccess and the end.
_run: dict = {"relay": None, "stop": None, "reports": [], "entry": None}


def on_start(workflow, train_ck_dir: str) -> None:
    relay = console.start_relay(workflow)
    stop = stopping.install(workflow, Path(train_ck_dir), relay)
    _run.update(relay=relay, stop=stop, reports=console.reports_to_build(workflow))
    if stop is not None:  # `make stop` finds this run by its entry (rectrain.snakefile.runs)
        try:
            _run["entry"] = runs.register()
        except OSError as err:  # the run goes on; only make stop cannot find it
            from snakemake.logging import logger

            logger.warning(
                "[rectrain] make stop will not find this run (%s); stop it with Ctrl-C or kill %d", err, os.getpid()
            )
    atexit.register(_at_exit)


# "0": the caller names the report itself (make run, make report: also when it was up to date).
REPORT_LINE_ENV = "RECTRAIN_REPORT_LINE"


def on_success() -> None:
    """The report's path last (after the jobs' last console lines), when this run wrote one."""
    if _run["relay"] is not None:
        _run["relay"].drain()
    line = console.report_line(_run["reports"])
    if line and os.environ.get(REPORT_LINE_ENV) != "0":
        from snakemake.logging import logger

        logger.info(line)


def _at_exit() -> None:
    if _run["entry"] is not None:
        runs.unregister(_run["entry"])
    if _run["relay"] is not None:
        _run["relay"].close()
    if _run["stop"] is not None:
        _run["stop"].finish()  # after a clean stop: its last line and exit status 75 (it does not return)
