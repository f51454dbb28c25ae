"""What the workflow does once Snakemake has planned the jobs and before it starts the first (the
Snakefile's `onstart` hook): nothing is deleted yet - Snakemake removes a job's outputs only as it
starts that job - and two things are known that were not while the Snakefile was parsed: the
executor (Snakemake's API parses the workflow before execute_workflow hands it the executor plugin,
so `workflow.local_exec` is always true during the parse) and why the train job runs.

- train.devices is checked against this machine's GPUs (and train.precision fp16 refused where
  training would run on CPU processes), and train.nodes > 1 against what can start it here (a SLURM
  allocation, or a rendezvous endpoint), when the jobs run here (a local executor);
  under a cluster executor (--executor slurm, --workflow-profile profiles/slurm) the jobs run on
  other nodes and this login node's GPUs say nothing, so the job checks them where it runs.
- A pack or check_recordio job's pair in fast storage that another working directory's run published
  (rectrain.data.pairowner) is refused now: Snakemake would delete it before the job could refuse it.
- train.global_batch with a numeric batch_size and train.devices auto is checked against the
  processes this machine's GPUs give (a GPU list or cpu was checked while parsing).
- The train job learns whether Snakemake forced it (rectrain.train.lifecycle.status.FORCED_ENV): forced, it
  trains again; otherwise it republishes a finished run it matches.

Not run by a dry-run (nothing runs) or with --no-hooks; the train job's own checks still hold then.
"""

from __future__ import annotations

import os
from pathlib import Path

from snakemake.exceptions import WorkflowError

from rectrain.config import format_problems
from rectrain.data import pairowner
from rectrain.settings import TrainBatch, TrainLaunch
from rectrain.snakefile.checks import device_problems, node_problems, precision_problems
from rectrain.snakefile.resources import scheduled_gpus
from rectrain.train.globalbatch import global_batch_problems
from rectrain.train.lifecycle.status import FORCED_ENV

TRAIN_RULE = "train"
PACK_RULE = "pack"
# The jobs that publish a pair in fast storage: packed, or brought and checked (rectrain.data.byo_recordio).
PAIR_RULES = (PACK_RULE, "check_recordio")


def before_jobs(workflow, trains: dict[str, tuple[TrainLaunch, TrainBatch, str]]) -> None:
    """The onstart hook: mark a forced train job, and refuse devices or nodes this machine cannot
    give a scheduled run, or a pair another run owns, before any output is removed. trains: {run name:
    its train block's launch and batch parts and train.precision} (a sweep's runs, or the one)."""
    needed = list(workflow.dag.needrun_jobs())
    jobs = [job for job in needed if job.rule.name == TRAIN_RULE]
    mark_forced(any(workflow.dag.reason(job).forced for job in jobs))
    executor = workflow.executor_plugin.common_settings
    problems = [] if executor.dryrun_exec or executor.touch_exec else pair_problems(needed)
    if jobs and checks_gpus_here(executor):
        for name in dict.fromkeys(_run_of(job, trains) for job in jobs):
            found = run_problems(*trains[name])
            problems += [f"run {name}: {p}" for p in found] if len(trains) > 1 else found
    if problems:
        raise WorkflowError(format_problems(problems))


def _run_of(job, trains: dict) -> str:
    """The run a train job trains (its wildcard; the one run when it has none)."""
    name = (getattr(job, "wildcards", None) or {}).get("run")
    return name if name in trains else next(iter(trains))


def run_problems(launch: TrainLaunch, batch: TrainBatch, precision: str) -> list[str]:
    """What this machine cannot give one run (its train block's launch and batch parts, train.precision):
    its devices, nodes, precision, global batch."""
    problems = device_problems(launch.devices) + node_problems(launch.nodes)
    problems += precision_problems(launch.devices, precision)
    if launch.devices == "auto":  # its process count is known only here, from this machine's GPUs
        problems += global_batch_problems(batch, launch, scheduled_gpus("auto"))
    return problems


def pair_problems(jobs) -> list[str]:
    """Each .rec a pack or check_recordio job would replace that belongs to a run in another working directory."""
    recs = [Path(out) for job in jobs if job.rule.name in PAIR_RULES for out in job.output if str(out).endswith(".rec")]
    problems = []
    for rec in recs:
        try:
            pairowner.check(rec)
        except pairowner.PairTaken as taken:
            problems.append(str(taken))
    return problems


def checks_gpus_here(executor) -> bool:
    """True when the executor (its plugin's common_settings) runs the jobs on this machine, so its GPUs
    are the jobs' GPUs: the local executor, not a cluster's (slurm: non_local_exec), nor --touch."""
    return bool(executor.local_exec) and not executor.touch_exec and not executor.dryrun_exec


def mark_forced(forced: bool, env=os.environ) -> None:
    """Tell the train job (through its environment) whether Snakemake forced it."""
    if forced:
        env[FORCED_ENV] = "1"
    else:
        env.pop(FORCED_ENV, None)
