"""What the Snakemake process itself does around its jobs, from the onstart and onsuccess hooks
(workflow/rules/common.smk): the console relay of the jobs' lines (console), the stop on SIGINT or
SIGTERM (stopping, and `make stop` through this run's entry: runs), the failed jobs' causes (causes), and at its end,
in this order: the live report made again when the run trained and there is one (a live.html left
saying "In progress" by a run that ended), a clean stop's line, each failed job's cause, after a
success the report's path, and a run at chance's line (and exit status 1 unless train.allow_chance) -
the console's last lines."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rectrain.chance import EXIT_AT_CHANCE
from rectrain.snakefile import causes, console, runs, stopping

# One run per Snakemake process: what onstart found, for onsuccess and the end; what the Snakefile
# said when it was read (`watch`), for the end of a run that had nothing to do.
_run: dict = {"relay": None, "stop": None, "reports": [], "causes": None, "entry": None}
# onstart ran, and planned the train job; onsuccess ran; Snakemake said "Nothing to be done"
_run.update(started=False, trains=False, succeeded=False, nothing=False)
_parsed: dict = {"workflow": None, "runs": {}}


def watch(workflow, runs: dict | None = None) -> None:
    """When the Snakefile is read: keep the workflow (its config, completed) for the run's end, and
    notice a run with nothing to do (Snakemake runs no hook then, and its evaluation may still be at
    chance)."""
    first = _parsed["workflow"] is None
    _parsed.update(workflow=workflow, runs=runs or {})
    if first:
        from snakemake.logging import logger

        logger.addFilter(_note_nothing_to_do)
        atexit.register(_at_end)


def _note_nothing_to_do(record) -> bool:
    if str(record.msg or "").startswith("Nothing to be done"):
        _run["nothing"] = True
    return True


def on_start(workflow, train_ck_dirs: dict[str, str]) -> None:
    """train_ck_dirs: {run name: its checkpoints folder}; a stop names those of the runs this process trains."""
    relay = console.start_relay(workflow)
    training = {job.wildcards.get("run") for job in workflow.dag.needrun_jobs() if job.rule.name == "train"}
    dirs = [Path(d) for name, d in train_ck_dirs.items() if name in training] or [
        Path(d) for d in train_ck_dirs.values()
    ]
    stop = stopping.install(workflow, dirs, relay)
    failed = causes.install(workflow)  # after the stop's filter: a clean stop's error block is none
    _run.update(relay=relay, stop=stop, causes=failed, reports=console.reports_to_build(workflow), started=True)
    _run["trains"] = any(job.rule.name == "train" for job in workflow.dag.needrun_jobs())
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
    """The jobs' last console lines; the report's path comes last, at the end (`_at_end`)."""
    if _run["relay"] is not None:
        _run["relay"].drain()
    _run["succeeded"] = True


def _at_exit() -> None:
    if _run["entry"] is not None:
        runs.unregister(_run["entry"])
    if _run["relay"] is not None:
        _run["relay"].close()


def _at_end() -> None:
    """The run's last lines (see the module doc); after a clean stop or a run at chance, its exit status."""
    workflow = _parsed["workflow"]
    if workflow is None or workflow.dryrun or not (_run["started"] or _run["nothing"]):
        return
    if _run["trains"]:
        refresh_live(workflow)
    failed = _run["causes"].lines() if _run["causes"] is not None else []
    if _run["causes"] is not None:
        _run["causes"].close()
    if _run["stop"] is not None:
        _run["stop"].finish()  # after a clean stop: its last line and exit status 75 (it does not return)
    for line in failed:
        say(line)
    verdicts = at_chance(workflow) if _run["succeeded"] or _run["nothing"] else []
    line = console.report_line(_run["reports"]) if _run["succeeded"] else None
    if line and os.environ.get(REPORT_LINE_ENV) != "0":
        say(line, tag=False)
    refused = False
    for run, verdict in verdicts:
        allowed = bool(_run_config(workflow, run)["train"]["allow_chance"])
        refused |= not allowed
        say(
            (f"run {run}: " if len(_parsed["runs"]) > 1 else "")
            + verdict["line"]
            + (" (train.allow_chance: true: exit status 0)" if allowed else f" (exit status {EXIT_AT_CHANCE})")
        )
    if refused:
        sys.stdout.flush()
        os._exit(EXIT_AT_CHANCE)


def say(text: str, tag: bool = True) -> None:
    """One unbuffered line on Snakemake's console (stderr), after everything it printed."""
    os.write(sys.stderr.fileno(), f"{'[rectrain] ' if tag else ''}{text}\n".encode())


def _run_config(workflow, run: str) -> dict:
    """The config of the run named `run` (a sweep's own), else the workflow's."""
    return _parsed["runs"].get(run) or workflow.config


def at_chance(workflow) -> list[tuple[str, dict]]:
    """(run, the evaluate stage's verdict: rectrain.chance) for each run whose evaluation this
    Snakemake run's targets include, when it is at chance."""
    if workflow.dag is None:
        return []
    found = []
    for run in dict.fromkeys(job.wildcards.get("run") for job in workflow.dag.jobs if job.rule.name == "evaluate"):
        path = Path("results") / workflow.config["dataset"] / str(run) / "eval" / "metrics.json"
        with contextlib.suppress(OSError, ValueError):
            verdict = json.loads(path.read_text()).get("at_chance")
            if verdict is not None:
                found.append((run, verdict))
    return found


def refresh_live(workflow) -> None:
    """The live report made again (rectrain.report.live) when there is one: it said how the run stood
    when it was made, maybe "In progress", and the run has ended.  It reads the run's config as this
    process completed it.  A minute at most; its failure only leaves the old page."""
    for run, given in (_parsed["runs"] or {workflow.config.get("run", "main"): workflow.config}).items():
        page = Path("results") / workflow.config["dataset"] / run / "live.html"
        if not page.exists():
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(given, f, default=str)  # YAML's superset: the live report reads it as a --configfile
        cmd = [sys.executable, "-m", "rectrain.report.live", "--configfile", f.name]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=False)
        os.unlink(f.name)
