"""`python -m rectrain.train`, the one command that trains: a rank when torchrun started it, else the
launcher of this node's ranks or the single rank itself (rectrain.train.launch.start) - and the trainer's
command line.

No torch here: rectrain.train's __main__ asks `relaunches` before it imports the trainer, so a process
that only starts torchrun never imports torch (measured: ~3.4 CPU-s of imports, and ~1.4 s of
interpreter teardown after torchrun ended, per start of a multi-process run).
"""

from __future__ import annotations

import argparse
import logging
import os

from rectrain import cli, distributed, settings
from rectrain.config import ConfigError
from rectrain.data import pairowner
from rectrain.train import cluster, launch
from rectrain.train.lifecycle.status import EXIT_STOPPED

log = logging.getLogger(__name__)

DOC = """Train a network with DistributedDataParallel from the packed .rec (rectrain.train.trainer).

    python -m rectrain.train --config-json '<train block>' --rec train.rec --idx train.idx \\
        --val-rec val.rec --val-idx val.idx --classes classes.tsv --out results/<ds>/train

The one command, for the train rule and by hand: it starts torchrun with one rank per GPU (or
train.cpu_processes CPU ranks), once per node under SLURM, or trains as a single process when one is
all the config asks for, and says which."""


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
    launch.arguments(ap)


def relaunches(argv: list[str]) -> bool:
    """Whether `python -m rectrain.train <argv>` only starts torchrun (launch.under_torchrun): not a rank
    yet, and the train block's `launch` part or the options ask for torchrun.  Anything it cannot read (a
    bad config, --help) is the trainer's to report: False."""
    if distributed.launched() or {"-h", "--help"} & set(argv):
        return False
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--config-json")
    launch.arguments(ap)
    known = ap.parse_known_args(argv)[0]
    if known.config_json is None:
        return False
    try:
        part = cli.typed("train", cli.read_config("train", known.config_json)).launch  # as cli.main reads it
        procs = distributed.plan_processes(part.devices, part.cpu_processes, distributed.visible_gpu_count())
    except (ConfigError, ValueError):  # json's decode error is a ValueError
        return False
    return launch.under_torchrun(part, procs, known)


def _run(args: argparse.Namespace, s: settings.TrainSettings) -> int | None:
    """`s`: the train block's view, as rectrain.cli read it once; each function below gets the parts it reads."""
    single = not distributed.launched()
    if single:
        status = launch.start(args, s)
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
        return launch.after_stop() if single else EXIT_STOPPED
    except divergence.Diverged:
        return divergence.EXIT_DIVERGED
    finally:
        distributed.teardown()
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m rectrain.train`: a rank (under torchrun), a single process, or the process that starts
    torchrun. A stop signal is training's to handle (train.lifecycle.stop, supervise), not a Ctrl-C line."""
    errors = {cluster.ClusterError: 1, pairowner.PairChanged: 1}
    return cli.main(
        "train",
        "train",
        arguments,
        _run,
        argv,
        errors=errors,
        elapsed=True,
        interrupted=None,
        doc=DOC,
        command="rectrain.train",
    )
