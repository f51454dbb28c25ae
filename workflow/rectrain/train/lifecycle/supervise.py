"""torchrun as a child that a stop signal reaches and whose stop is reported as EXIT_STOPPED.

The process tree of a train job: Snakemake -> shell -> `python -m rectrain.train` (the launcher,
rectrain.train.launch.start) -> torchrun's agent -> one process per rank, each `python -m rectrain.train`.  Read from
torch.distributed.elastic: the agent turns the signals of its --signals-to-handle (default SIGTERM,
SIGINT, SIGHUP, SIGQUIT) into a shutdown - it sends that same signal to every worker, waits
--shutdown-timeout seconds (default 30) and SIGKILLs what is left - and then exits 1 whatever the
workers did; any other signal with a default action that ends a process (SIGUSR1) ends the agent at
once, orphaning the workers.  A worker that exits non-zero (as a stopped rank does, EXIT_STOPPED)
makes the agent end the others the same way and exit 1.

So `run_torchrun`: starts torchrun with every stop signal in --signals-to-handle and a shutdown
timeout long enough for a checkpoint (STOP_GRACE_S); forwards a stop signal it gets itself to the
ranks directly (not to the agent: a signal sent to the whole process group reaches the agent too,
and a second one while it shuts down would make it give up waiting); and returns EXIT_STOPPED when
the ranks wrote their stop checkpoint during this launch (checkpoints/stopped.json, `mark_stopped`,
naming this launch's id), 0 when they finished the run during this launch (checkpoints/finished.json
naming it: a stop signal while finished ranks exit still makes torchrun exit 1), torchrun's own
status otherwise.
"""

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
from rectrain.train.lifecycle import finished
from rectrain.train.lifecycle.status import EXIT_STOPPED, STOP_GRACE_S, STOPPED
from rectrain.train.lifecycle.stop import signal_numbers

log = logging.getLogger(__name__)

LAUNCH_ID_ENV = "RECTRAIN_LAUNCH_ID"
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's default --signals-to-handle


def mark_stopped(ck_dir: Path, signal_name: str, where: str, resumes_at: str) -> None:
    """Rank 0, after the stop checkpoint is written: what the launcher maps to EXIT_STOPPED (and what
    Snakemake's last line says, rectrain.snakefile.stopping)."""
    info = {
        "launch_id": os.environ.get(LAUNCH_ID_ENV),
        "signal": signal_name,
        "after": where,
        "resumes_at": resumes_at,
        "time": utc_now(),
    }
    atomic.write_json(Path(ck_dir) / STOPPED, info)


def written_in(marker: Path, launch_id: str) -> dict | None:
    """The JSON marker (stopped.json, finished.json) when the ranks of launch `launch_id` wrote it, else None."""
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(Path(marker).read_text())
        if isinstance(info, dict) and info.get("launch_id") == launch_id:
            return info
    return None


def stopped_in(ck_dir: Path, launch_id: str) -> dict | None:
    """stopped.json when the ranks of launch `launch_id` wrote it, else None."""
    return written_in(Path(ck_dir) / STOPPED, launch_id)


def torchrun_stop_options(stop_signals: list[str]) -> list[str]:
    names = dict.fromkeys([*TORCHRUN_SIGNALS, *(s.name for s in signal_numbers(stop_signals))])
    return [f"--signals-to-handle={','.join(names)}", f"--shutdown-timeout={STOP_GRACE_S}"]


def with_stop_options(cmd: list[str], stop_signals: list[str]) -> list[str]:
    """The torchrun command (`python -m rectrain._torchrun ...`) with torchrun_stop_options."""
    at = cmd.index(TORCHRUN) + 1
    return [*cmd[:at], *torchrun_stop_options(stop_signals), *cmd[at:]]


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
    if rc and written_in(finished.marker(ck_dir), launch_id):
        # torchrun exits 1 on any stop signal, also one that comes while finished ranks exit (SLURM's
        # time-limit warning in a run's last seconds): the outputs are published, so the job succeeded.
        log.warning(
            "torchrun exited with status %d after the ranks had finished and published the run (a stop signal "
            "while they exited): the run is complete, exit status 0",
            rc,
        )
        return 0
    info = stopped_in(ck_dir, launch_id) if rc else None
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
