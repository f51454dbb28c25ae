"""The train rule's entry point: start training through torchrun on this node.

The rule runs `python -m rectrain.train.launch --config-json ... <train args>`.  Under SLURM with
train.nodes > 1 this re-runs itself once per node (rectrain.train.cluster); with pack.stage_to_local
it first copies the .rec/.idx pairs to node-local disk (rectrain.train.local_copy); then it execs the
torchrun command rectrain.distributed builds (one rank per GPU, or train.cpu_processes CPU ranks) as
its child (rectrain.train.lifecycle.supervise): a stop signal reaches the ranks, which checkpoint and stop, and
the launcher then exits with EXIT_STOPPED (75).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from rectrain import cli, distributed, driver_check, settings
from rectrain.config import ConfigError, stage_block
from rectrain.data import pairowner
from rectrain.train import cluster
from rectrain.train import local_copy as stage
from rectrain.train.lifecycle import requeue, supervise
from rectrain.train.lifecycle.status import EXIT_STOPPED

log = logging.getLogger(__name__)


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rdzv-endpoint", default=os.environ.get("RECTRAIN_RDZV_ENDPOINT"))
    ap.add_argument("--print-only", action="store_true", help="print the torchrun command, start nothing")
    ap.add_argument(
        "--stage-to-local",
        metavar="DIR",
        default=staging_dir(),
        help="copy the .rec/.idx pairs to node-local DIR first ('auto': $TMPDIR); default from pack.stage_to_local",
    )


def _run(own: argparse.Namespace, s: settings.TrainSettings) -> int | None:
    """`s`: the train block's view, as rectrain.cli read it once (the launcher reads its `launch` part)."""
    launch, argv = s.launch, own.argv
    train_argv = [a for a in argv if a != "--print-only"]
    train_argv = _drop_option(_drop_option(train_argv, "--rdzv-endpoint"), "--stage-to-local")
    # train.nodes > 1 under SLURM: re-run this launcher once per node (srun); each then finds the
    # rendezvous from the allocation.  One node: nothing changes (--standalone).
    supervise.launch_id()  # before srun's launchers per node, which inherit it
    env_now = dict(os.environ, **({cluster.ENDPOINT_ENV: own.rdzv_endpoint} if own.rdzv_endpoint else {}))
    node = cluster.plan_node_launch(launch.nodes, env_now)
    if node.relaunch:
        cmd = [*node.relaunch, sys.executable, "-m", "rectrain.train.launch", *argv]
        log.info("one launcher per node: %s", shlex.join(cmd))
        if not own.print_only:
            os.execvp(cmd[0], cmd)
        return None
    for *_, rec, idx in stage.pairs_in(train_argv):
        pairowner.refuse_changed(rec, idx)  # a brought pair replaced since its check: before any copy or rank
    if own.stage_to_local:
        train_argv = stage.stage_argv(train_argv, None if own.stage_to_local == "auto" else own.stage_to_local)
    gpu_count = distributed.visible_gpu_count()
    driver_check.stop_on_mismatch(launch.devices, gpu_count > 0, "launch")
    plan = distributed.plan_processes(launch.devices, launch.cpu_processes, gpu_count)
    cmd, env = distributed.torchrun_command(
        plan,
        "rectrain.train",
        train_argv,
        nodes=launch.nodes,
        rdzv_endpoint=own.rdzv_endpoint or node.rdzv_endpoint,
        run_id=node.run_id,
    )
    log.info("%s", plan.reason)
    if plan.cuda_visible_devices:
        log.info("CUDA_VISIBLE_DEVICES=%s", plan.cuda_visible_devices)
    log.info("%s", shlex.join(cmd))
    if own.print_only:
        return None
    # torchrun as a child, not exec'd: a stop signal reaches the ranks and a stop maps to EXIT_STOPPED.
    status = supervise.run_torchrun(cmd, env, _out_dir(train_argv) / "checkpoints", s.stops.stop_signals)
    if status == EXIT_STOPPED:
        said = requeue.after_stop(os.environ)
        if said:  # under SLURM: back in the queue at the time limit, or why not
            log.info("%s", said)
        requeue.wait_for_first_task(os.environ)
    return status


def staging_dir() -> str | None:
    """pack.stage_to_local / pack.local_storage as configured (operational keys: the Snakefile exports
    them to the job's environment rather than in the rule's params) as a --stage-to-local value."""
    pack = stage_block("pack", "{}")
    return (pack["local_storage"] or "auto") if pack["stage_to_local"] else None


def main(argv: list[str] | None = None) -> int:
    """The train block comes as --config-json; every argument the launcher does not know is training's."""
    # a stop signal during training is handled (rectrain.train.lifecycle.supervise); no "nothing published" line
    return cli.main(
        "launch",
        "train",
        _arguments,
        _run,
        argv,
        errors={cluster.ClusterError: 1, pairowner.PairChanged: 1},
        passthrough=True,
        interrupted=None,
    )


def _out_dir(argv: list[str]) -> Path:
    """The training's --out (where its checkpoints and stopped.json are)."""
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if a.startswith("--out="):
            return Path(a.split("=", 1)[1])
    raise ConfigError("rectrain.train.launch needs the training's --out DIR (where its checkpoints go)")


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


if __name__ == "__main__":
    cli.end(main())
