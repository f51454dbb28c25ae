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
from rectrain.config import ConfigError
from rectrain.train.lifecycle import supervise
from rectrain.train.lifecycle.status import EXIT_STOPPED

log = logging.getLogger(__name__)

DOC = """Train a network with DistributedDataParallel from the packed .rec (rectrain.train.trainer).

    python -m rectrain.train.launch --config-json '<train block>' --rec train.rec --idx train.idx \\
        --val-rec val.rec --val-idx val.idx --classes classes.tsv --out results/<ds>/train

Started without a launcher (plain `python -m rectrain.train ...`), it relaunches itself through torchrun
when the config asks for more than one process, or runs as a single process, and says which."""


def arguments(ap: argparse.ArgumentParser) -> None:
    """The command line of `python -m rectrain.train` (rectrain.cli adds --config-json)."""
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
        launch = cli.typed("train", cli.read_config("train", known.config_json)).launch  # as cli.main reads it
        procs = distributed.plan_processes(launch.devices, launch.cpu_processes, distributed.visible_gpu_count())
    except (ConfigError, ValueError):  # json's decode error is a ValueError
        return False
    return _under_torchrun(procs, launch, known.single_process)


def _run(args: argparse.Namespace, s: settings.TrainSettings) -> int | None:
    """`s`: the train block's view, as rectrain.cli read it once; each function below gets the parts it reads."""
    if not distributed.launched():
        ck_dir = Path(args.out) / "checkpoints"
        status = relaunch_or_single(s.launch, s.stops.stop_signals, args.argv, args.single_process, ck_dir)
        if status is not None:
            return status
    # torch from here (already imported by rectrain.train's __main__ in a rank or a single process)
    from rectrain.train import batchplan, trainer
    from rectrain.train.lifecycle import divergence, stop

    # a global batch this world size cannot keep is refused in one line, before any rank builds anything
    batchplan.fixed_accum(s.batch, int(os.environ["WORLD_SIZE"]))
    try:
        trainer.train(args, s)
    except stop.Stopped:
        return EXIT_STOPPED
    except divergence.Diverged:
        return divergence.EXIT_DIVERGED
    finally:
        distributed.teardown()
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m rectrain.train`: a rank (under torchrun), a single process, or the process that starts
    torchrun. A stop signal is training's to handle (train.lifecycle.stop, supervise), not a Ctrl-C line."""
    return cli.main("train", "train", arguments, _run, argv, elapsed=True, interrupted=None, doc=DOC)
