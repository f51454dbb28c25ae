"""`python -m rectrain.train` started without a launcher (RANK, WORLD_SIZE, LOCAL_RANK not set): the
same command under torchrun when the train block asks for several processes, else this process as
rank 0 of 1 - and the trainer's command line.

No torch here: rectrain.train's __main__ asks `relaunches` before it imports the trainer, so a process
that only starts torchrun never imports torch (measured: ~3.4 CPU-s of imports, and ~1.4 s of
interpreter teardown after torchrun ended, per direct start of a multi-process run).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from rectrain import cli, distributed, driver_check, settings
from rectrain.config import ConfigError, stage_block
from rectrain.train.lifecycle import supervise

log = logging.getLogger(__name__)


def arguments(ap: argparse.ArgumentParser) -> None:
    """The trainer's command line (rectrain.train.trainer parses the same)."""
    ap.add_argument("--rec", required=True)
    ap.add_argument("--idx", required=True)
    ap.add_argument("--val-rec", help="the val .rec; without it (no val split) no epoch is validated")
    ap.add_argument("--val-idx")
    ap.add_argument("--classes", required=True, help="classes.tsv (label, wnid, name)")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--manifest",
        default=None,
        help="the pack manifest of --rec (results/<ds>/pack/train.manifest.json): resume fingerprint",
    )
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for the whole job (default: all)")
    ap.add_argument(
        "--single-process",
        action="store_true",
        help="without a launcher, run one process instead of relaunching through torchrun",
    )


def relaunch_or_single(launch, stop_signals: list[str], argv: list[str], single: bool, ck_dir: Path) -> int | None:
    """Called when RANK/WORLD_SIZE/LOCAL_RANK are missing: run the same command under torchrun when the
    train block's `launch` part asks for several processes, returning its exit status (supervise:
    EXIT_STOPPED after a stop, `stop_signals`: train.stop_signals), else set this process up as rank 0
    of 1 (None)."""
    gpu_count = distributed.visible_gpu_count()
    driver_check.stop_on_mismatch(launch.devices, gpu_count > 0, "train")
    procs = distributed.plan_processes(launch.devices, launch.cpu_processes, gpu_count)
    missing = ", ".join(v for v in distributed.LAUNCH_VARS if v not in os.environ)
    if _under_torchrun(procs, launch, single):
        log.info(
            "started without a launcher (%s not set): relaunching through torchrun with %d processes because %s",
            missing,
            procs.nproc,
            procs.reason,
        )
        cmd, env = distributed.torchrun_command(procs, "rectrain.train", argv)
        return supervise.run_torchrun(cmd, env, ck_dir, stop_signals)
    if single:
        why = "--single-process was given"
    elif launch.nodes > 1:
        why = "multi-node runs must be started by the launcher"
    else:
        why = procs.reason
    log.info(
        "started without a launcher (%s not set): running as a single process (rank 0 of 1) because %s", missing, why
    )
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return None


def _under_torchrun(procs: distributed.ProcessPlan, launch, single: bool) -> bool:
    return procs.nproc > 1 and launch.nodes == 1 and not single


def relaunches(argv: list[str]) -> bool:
    """Whether `python -m rectrain.train <argv>` only starts torchrun: not launched, the train block's
    `launch` part asks for several processes on one node, no --single-process.  Anything it cannot read
    (a bad config, --help) is the trainer's to report: False."""
    if distributed.launched() or {"-h", "--help"} & set(argv):
        return False
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--config-json")
    ap.add_argument("--single-process", action="store_true")
    known = ap.parse_known_args(argv)[0]
    if known.config_json is None:
        return False
    try:
        launch = settings.train(stage_block("train", known.config_json)).launch
        procs = distributed.plan_processes(launch.devices, launch.cpu_processes, distributed.visible_gpu_count())
    except (ConfigError, ValueError):  # json's decode error is a ValueError
        return False
    return _under_torchrun(procs, launch, known.single_process)


def _relaunch(args: argparse.Namespace, s: settings.TrainSettings) -> int:
    status = relaunch_or_single(
        s.launch, s.stops.stop_signals, args.argv, args.single_process, Path(args.out) / "checkpoints"
    )
    if status is None:  # relaunches() said it would: the same inputs decide both
        raise RuntimeError("rectrain.train.direct: asked to relaunch through torchrun, but the plan is one process")
    return status


def main(argv: list[str] | None = None) -> int:
    """The relaunching process's whole life: the trainer's arguments and config, then torchrun (which
    handles a stop signal: rectrain.train.lifecycle.supervise)."""
    return cli.main("train", "train", arguments, _relaunch, argv, elapsed=True, interrupted=None)
