"""torchrun as the launcher's child: a stop signal forwarded to the ranks, and a stop reported as EXIT_STOPPED.

torchrun's agent turns a signal of its --signals-to-handle into a shutdown (the same signal to every worker,
--shutdown-timeout, then SIGKILL) and exits 1 whatever the workers did; another fatal signal (SIGUSR1) ends
it at once, orphaning the workers.  So `run_torchrun` names every stop signal to it with a shutdown timeout
long enough for a checkpoint, forwards a stop signal to the ranks directly (a second one to the agent makes
it give up waiting), and maps this launch's stopped.json to EXIT_STOPPED and its finished.json to 0.
docs/architecture.md, "Stopping and mid-epoch checkpoints".

Under SLURM, a run stopped by its time limit's warning goes back in the queue by itself (`after_stop`:
`scontrol requeue`, the same job id, a fresh time limit); a stop with more time left (a preemption, a
scancel) is not requeued.  docs/cluster.md, "Time limits, preemption and lost nodes"."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
import uuid
from datetime import datetime
from pathlib import Path

import psutil

from rectrain import atomic
from rectrain.distributed import TORCHRUN
from rectrain.log import PROGRESS_LOGGER, utc_now
from rectrain.train.lifecycle.status import EXIT_STOPPED, FINISHED, STOP_GRACE_S, STOPPED
from rectrain.train.lifecycle.stop import signal_numbers

log = logging.getLogger(__name__)

LAUNCH_ID_ENV = "RECTRAIN_LAUNCH_ID"
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's default --signals-to-handle


def mark_stopped(ck_dir: Path, signal_name: str, where: str, resumes_at: str) -> None:
    """Rank 0, after the stop checkpoint is written: what the launcher maps to EXIT_STOPPED (and what
    Snakemake's last line says, rectrain.snakefile.stopping)."""
    info = {"launch_id": os.environ.get(LAUNCH_ID_ENV), "signal": signal_name, "after": where}
    atomic.write_json(Path(ck_dir) / STOPPED, {**info, "resumes_at": resumes_at, "time": utc_now()})


def written_in(marker: Path, launch_id: str) -> dict | None:
    """The JSON marker (stopped.json, finished.json) when the ranks of launch `launch_id` wrote it, else None."""
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(Path(marker).read_text())
        if isinstance(info, dict) and info.get("launch_id") == launch_id:
            return info
    return None


def with_stop_options(cmd: list[str], stop_signals: list[str]) -> list[str]:
    """The torchrun command (`python -m rectrain._torchrun ...`) handling every stop signal, with a
    shutdown timeout long enough for a checkpoint."""
    names = dict.fromkeys([*TORCHRUN_SIGNALS, *(s.name for s in signal_numbers(stop_signals))])
    at = cmd.index(TORCHRUN) + 1
    return [*cmd[:at], f"--signals-to-handle={','.join(names)}", f"--shutdown-timeout={STOP_GRACE_S}", *cmd[at:]]


def _forward(proc: subprocess.Popen):
    def handler(signum, frame) -> None:
        try:
            ranks = psutil.Process(proc.pid).children()
        except psutil.NoSuchProcess:
            return
        log.info("%s: asking the %d rank(s) to stop after their current step", signal.Signals(signum).name, len(ranks))
        for p in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signum)

    return handler


def launch_id() -> str:
    """This launch's id, made once by the first launcher and inherited by the ones it starts (srun's
    launcher per node): every node's launcher then recognises the stopped.json rank 0 wrote."""
    return os.environ.setdefault(LAUNCH_ID_ENV, uuid.uuid4().hex)


def run_torchrun(cmd: list[str], env: dict, ck_dir: Path, stop_signals: list[str]) -> int:
    """Run the torchrun command `cmd` to its end (see the module doc); its exit status, or EXIT_STOPPED."""
    launch_id = env.get(LAUNCH_ID_ENV) or uuid.uuid4().hex
    proc = subprocess.Popen(with_stop_options(cmd, stop_signals), env={**env, LAUNCH_ID_ENV: launch_id})
    previous = {sig: signal.signal(sig, _forward(proc)) for sig in signal_numbers(stop_signals)}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if rc and written_in(Path(ck_dir) / FINISHED, launch_id):
        # torchrun exits 1 on any stop signal, also one that comes while finished ranks exit (SLURM's
        # time-limit warning in a run's last seconds): the outputs are published, so the job succeeded.
        why = "after the ranks had finished and published the run (a stop signal while they exited)"
        log.warning("torchrun exited with status %d %s: the run is complete, exit status 0", rc, why)
        return 0
    info = written_in(Path(ck_dir) / STOPPED, launch_id) if rc else None
    if info:
        # the progress logger: this line also reaches the terminal the job was started from (rectrain.log)
        said = f"the ranks stopped on {info['signal']} after {info['after']} with their checkpoint written"
        progress = logging.getLogger(PROGRESS_LOGGER)
        progress.info("%s: exit status %d (run the same command again to continue)", said, EXIT_STOPPED)
        return EXIT_STOPPED
    return rc if rc >= 0 else 128 - rc


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
    try:
        end = datetime.fromisoformat(proc.stdout.strip() if proc.returncode == 0 else "").timestamp()
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
    """A stopped launcher that is not the job's first task: wait (at most FIRST_TASK_WAIT_S) for the first to
    end the step.  Exiting at once, non-zero, would make srun (--kill-on-bad-exit) kill the first task
    before its `scontrol requeue`, and the job would fail instead of going back in the queue."""
    if _another_task(env):
        sleep(FIRST_TASK_WAIT_S)


def _another_task(env) -> bool:
    """This launcher is a SLURM job's task other than its first (so the step has several)."""
    return bool(env.get("SLURM_JOB_ID")) and env.get("SLURM_PROCID", "0") != "0"
