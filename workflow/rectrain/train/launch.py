"""What `python -m rectrain.train` does before it is a rank: start training on this node.

`python -m rectrain.train` is the one command that trains: the train rule runs it, and so does a user
by hand or from an IDE's Run button.  Started by torchrun (RANK, LOCAL_RANK, WORLD_SIZE set) it is a
rank and trains (rectrain.train.direct -> rectrain.train.trainer).  Otherwise `start` runs first:

- under SLURM with train.nodes > 1 it re-runs the same command once per node (rectrain.train.cluster);
- a brought .rec/.idx pair replaced since its check is refused (rectrain.data.pairowner);
- with pack.stage_to_local it copies the pairs to node-local disk (rectrain.train.local_copy);
- then it runs the torchrun command rectrain.distributed builds (one rank per GPU, or
  train.cpu_processes CPU ranks) as its child (rectrain.train.lifecycle.supervise): a stop signal
  reaches the ranks, which checkpoint and stop, and the exit status is EXIT_STOPPED (75);
- or, for one process on one node (and with --single-process), this process is that one rank itself:
  no torchrun, and the log says which and why.  It never dies on a missing RANK.

After a stop, under SLURM, the job goes back in the queue at its time limit (`after_stop`).  torchrun
itself runs as `python -m rectrain._torchrun` (torchrun's main, without its traceback on a stop).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from rectrain import distributed, driver_check
from rectrain.config import ConfigError, stage_block
from rectrain.data import pairowner
from rectrain.train import cluster
from rectrain.train import local_copy as stage
from rectrain.train.lifecycle import supervise
from rectrain.train.lifecycle.status import EXIT_STOPPED

log = logging.getLogger(__name__)

# This module's options: what `start` reads, dropped from the command line the ranks get.
OWN_OPTIONS = ("--rdzv-endpoint", "--stage-to-local")


def arguments(ap: argparse.ArgumentParser) -> None:
    """The launch options of `python -m rectrain.train` (rectrain.train.direct has the rest)."""
    ap.add_argument(
        "--rdzv-endpoint", default=os.environ.get(cluster.ENDPOINT_ENV), help="host:port of a multi-node rendezvous"
    )
    ap.add_argument("--print-only", action="store_true", help="print the torchrun command, start nothing")
    ap.add_argument(
        "--stage-to-local",
        metavar="DIR",
        default=staging_dir(),
        help="copy the .rec/.idx pairs to node-local DIR first ('auto': $TMPDIR); default from pack.stage_to_local",
    )
    ap.add_argument(
        "--single-process",
        action="store_true",
        help="run one process (rank 0 of 1) instead of starting torchrun",
    )


def under_torchrun(launch, procs: distributed.ProcessPlan, own: argparse.Namespace) -> bool:
    """Whether `start` runs torchrun (else this process is the one rank): several processes or nodes, or
    pairs to stage first, or the command asked for (--print-only) - unless --single-process."""
    wanted = procs.nproc > 1 or launch.nodes > 1 or bool(own.stage_to_local) or bool(own.print_only)
    return wanted and not own.single_process


def start(own: argparse.Namespace, s) -> int | None:
    """Before this process is a rank (see the module doc): the exit status when it started torchrun, re-ran
    itself per node or printed the command; None when this process is to train as the single rank (the
    rank's environment then set).  `s`: the train block's view; its `launch` and `stops` parts are read."""
    launch = s.launch
    supervise.launch_id()  # before srun's per-node tasks and torchrun's ranks, which inherit it
    env_now = dict(os.environ, **({cluster.ENDPOINT_ENV: own.rdzv_endpoint} if own.rdzv_endpoint else {}))
    node = cluster.plan_node_launch(launch.nodes, env_now)
    if node.relaunch:
        cmd = [*node.relaunch, sys.executable, "-m", "rectrain.train", *own.argv]
        log.info("one launcher per node: %s", shlex.join(cmd))
        if not own.print_only:
            os.execvp(cmd[0], cmd)
        return 0
    train_argv = [a for a in own.argv if a != "--print-only"]
    for name in OWN_OPTIONS:
        train_argv = _drop_option(train_argv, name)
    for *_, rec, idx in stage.pairs_in(train_argv):
        pairowner.refuse_changed(rec, idx)  # a brought pair replaced since its check: before any copy or rank
    gpu_count = distributed.visible_gpu_count()
    driver_check.stop_on_mismatch(launch.devices, gpu_count > 0, "train")
    procs = distributed.plan_processes(launch.devices, launch.cpu_processes, gpu_count)
    if not under_torchrun(launch, procs, own):
        return single_process(procs, own)
    if own.stage_to_local:
        train_argv = stage.stage_argv(train_argv, None if own.stage_to_local == "auto" else own.stage_to_local)
    cmd, env = distributed.torchrun_command(
        procs,
        "rectrain.train",
        train_argv,
        nodes=launch.nodes,
        rdzv_endpoint=own.rdzv_endpoint or node.rdzv_endpoint,
        run_id=node.run_id,
    )
    missing = ", ".join(v for v in distributed.LAUNCH_VARS if v not in os.environ)
    log.info(
        "started without a launcher (%s not set): relaunching through torchrun with %d processes because %s",
        missing,
        procs.nproc,
        procs.reason,
    )
    if procs.cuda_visible_devices:
        log.info("CUDA_VISIBLE_DEVICES=%s", procs.cuda_visible_devices)
    log.info("%s", shlex.join(cmd))
    if own.print_only:
        return 0
    # torchrun as a child, not exec'd: a stop signal reaches the ranks and a stop maps to EXIT_STOPPED.
    status = supervise.run_torchrun(cmd, env, _out_dir(train_argv) / "checkpoints", s.stops.stop_signals)
    return after_stop() if status == EXIT_STOPPED else status


def single_process(procs: distributed.ProcessPlan, own: argparse.Namespace) -> None:
    """This process as rank 0 of 1, saying why."""
    why = "--single-process was given" if own.single_process else procs.reason
    missing = ", ".join(v for v in distributed.LAUNCH_VARS if v not in os.environ)
    log.info(
        "started without a launcher (%s not set): running as a single process (rank 0 of 1) because %s", missing, why
    )
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return None


def after_stop() -> int:
    """After a clean stop (EXIT_STOPPED): under SLURM, back in the queue at the time limit (or why not)."""
    said = supervise.after_stop(os.environ)
    if said:
        log.info("%s", said)
    supervise.wait_for_first_task(os.environ)
    return EXIT_STOPPED


def staging_dir() -> str | None:
    """pack.stage_to_local / pack.local_storage as configured (operational keys: the Snakefile exports
    them to the job's environment rather than in the rule's params) as a --stage-to-local value."""
    pack = stage_block("pack", "{}")
    return (pack["local_storage"] or "auto") if pack["stage_to_local"] else None


def _out_dir(argv: list[str]) -> Path:
    """The training's --out (where its checkpoints and stopped.json are)."""
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if a.startswith("--out="):
            return Path(a.split("=", 1)[1])
    raise ConfigError("python -m rectrain.train needs the training's --out DIR (where its checkpoints go)")


def _drop_option(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out
