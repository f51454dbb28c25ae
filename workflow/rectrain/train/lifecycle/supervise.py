"""torchrun as the launcher's child: a stop signal forwarded to the ranks, and a stop reported as EXIT_STOPPED.

torchrun's agent turns a signal of its --signals-to-handle into a shutdown (the same signal to every worker,
--shutdown-timeout, then SIGKILL) and exits 1 whatever the workers did; another fatal signal (SIGUSR1) ends
it at once, orphaning the workers.  So `run_torchrun` names every stop signal to it with a shutdown timeout
long enough for a checkpoint, forwards a stop signal to the ranks directly (a second one to the agent makes
it give up waiting), and maps this launch's stopped.json to EXIT_STOPPED and its finished.json to 0.
docs/architecture.md, "Stopping and mid-epoch checkpoints"."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import uuid
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
        log.warning(
            "torchrun exited with status %d after the ranks had finished and published the run (a stop signal "
            "while they exited): the run is complete, exit status 0",
            rc,
        )
        return 0
    info = written_in(Path(ck_dir) / STOPPED, launch_id) if rc else None
    if info:
        # the progress logger: this line also reaches the terminal the job was started from (rectrain.log)
        logging.getLogger(PROGRESS_LOGGER).info(
            "the ranks stopped on %s after %s with their checkpoint written: exit status %d (run the same "
            "command again to continue)",
            info["signal"],
            info["after"],
            EXIT_STOPPED,
        )
        return EXIT_STOPPED
    return rc if rc >= 0 else 128 - rc
