"""Under SLURM, a run stopped by its time limit's warning goes back in the queue by itself (`scontrol
requeue`: same job id, a fresh time limit); a stop with more time left (a preemption, a scancel) is not
requeued.  docs/cluster.md, "Time limits, preemption and lost nodes".  Pure apart from the injected `run`."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import datetime

WARNING_ENV = "RECTRAIN_SLURM_WARNING_S"
DEFAULT_WARNING_S = 300  # a step, a checkpoint of ResNet-50's state and its fsync, with room to spare
# SLURM may send the warning up to a minute early (its event resolution, sbatch(1) --signal).
EARLY_S = 90
# How long a stopped task other than the first waits before it exits (wait_for_first_task).
FIRST_TASK_WAIT_S = 60


def stop_warning_s(env) -> int:
    """RECTRAIN_SLURM_WARNING_S (default 300): seconds before the time limit that SLURM signals."""
    raw = str(env.get(WARNING_ENV, DEFAULT_WARNING_S)).strip()
    if not raw.isdigit() or int(raw) == 0:
        raise ValueError(f"{WARNING_ENV}={raw!r}: expected a whole number of seconds above 0")
    return int(raw)


def stop_signal_option(env=None) -> str:
    """The train job's sbatch option asking for SIGTERM before its time limit.  SIGTERM, not SIGUSR1:
    SLURM signals every process of the job step, and Snakemake's job-step process (the step's task)
    waits for its running job on SIGTERM but dies on SIGUSR1, which would end the step mid-checkpoint."""
    return f"--signal=TERM@{stop_warning_s(os.environ if env is None else env)}"


def seconds_left(job_id: str, run=subprocess.run, now: float | None = None) -> float | None:
    """Seconds until the job's end time (squeue's %e, local time), or None when SLURM cannot say."""
    proc = run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True)
    text = proc.stdout.strip() if proc.returncode == 0 else ""
    try:
        end = datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None  # 'N/A', 'Unknown', not found
    return end - (time.time() if now is None else now)


def after_stop(env, run=subprocess.run, now: float | None = None) -> str | None:
    """Requeue this SLURM job when the stop was its time limit's warning; say what happened (None
    outside SLURM: the launcher has said how to continue)."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    if _another_task(env):
        return (
            "the job's first task decides whether SLURM requeues the job: this task waits up to "
            f"{FIRST_TASK_WAIT_S} s for it to end the step"
        )
    left = seconds_left(job_id, run, now)
    window = stop_warning_s(env) + EARLY_S
    if left is None or left > window:
        said = "unknown" if left is None else f"{left:.0f} s"
        return (
            f"SLURM job {job_id} was stopped with {said} of its time limit left: not the time limit's "
            "warning (a preemption, which SLURM requeues itself under the profile's slurm-requeue, or a "
            "scancel), so it is not requeued; rerun the same snakemake command to continue"
        )
    proc = run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        return (
            f"SLURM job {job_id} reached its time limit's warning but `scontrol requeue {job_id}` failed "
            f"({proc.stderr.strip() or proc.returncode}); rerun the same snakemake command to continue"
        )
    return (
        f"SLURM job {job_id} stopped {left:.0f} s before its time limit: requeued (same job id, a fresh "
        "time limit); it resumes from the checkpoint when SLURM starts it again"
    )


def wait_for_first_task(env, sleep=time.sleep) -> None:
    """A stopped launcher that is not the job's first task, in a step of several: wait for the first
    task to end the step (srun then ends this one), at most FIRST_TASK_WAIT_S.  Exiting at once with
    the stop's non-zero status would make srun (--kill-on-bad-exit) kill the first task before its
    `scontrol requeue`, and the job would fail instead of going back in the queue."""
    if _another_task(env):
        sleep(FIRST_TASK_WAIT_S)


def _another_task(env) -> bool:
    """This launcher is a SLURM job's task other than its first (so the step has several)."""
    return bool(env.get("SLURM_JOB_ID")) and env.get("SLURM_PROCID", "0") != "0"
