"""Train a network with DistributedDataParallel from the packed .rec: one rank's whole run.

    python -m rectrain.train --config-json '<train block>' --rec train.rec --idx train.idx \\
        --val-rec val.rec --val-idx val.idx --classes classes.tsv --out results/<ds>/train

is the one command that trains (rectrain.train.direct, its entry point): not yet a rank, it starts
torchrun, which starts one `python -m rectrain.train` per device with RANK, LOCAL_RANK and WORLD_SIZE
set, or it trains as the single rank when one process is all the config asks for, and says which
(rectrain.train.launch); it never dies on a missing RANK.  A partial --config-json block is completed
from config/schema.yaml.

A run, in order (`train`), each step in its own module of rectrain.train: set up the rank, build the
model (run.prepare_rank), plan the batch - on a GPU after checking it fits beside what the loaders
will hold (batchplan) - build the loaders, optimizer (optim) and network (run.build_run), resume a
checkpoint of the same run or move the one it replaces aside (resume, train.resume), calibrate (img/s on synthetic data,
calibrate), write run.json (runinfo), then per epoch train (step.run_steps), validate (rectrain.metrics'
tally, as the evaluate stage counts) and checkpoint (epochs); finally publish the outputs (outputs).  A watchdog
(rectrain.watchdog, train.watchdog_s) ends a rank that stops making progress; a failing rank's log
line says what an out-of-memory in disguise needs (failure).  Test hooks: faults.

Outputs in --out: checkpoints/epoch_<k>.pt (the last train.keep_checkpoints) + last.pt (every epoch,
atomic; a replaced run's under checkpoints/replaced/), telemetry/ (live CSVs),
and once finished steps.csv, epochs.csv, system.csv, run.json and model.pt (written last), then
checkpoints/finished/ (links to the published outputs) and checkpoints/finished.json: a later start of
the job republishes them when it is the same run and Snakemake did not force it (resume, checkpoint.CheckpointSaver).
See docs/architecture.md for the formats.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import torch

from rectrain import distributed, settings, usage, watchdog, weights
from rectrain import model as models
from rectrain.atomic import write_json
from rectrain.distributed import all_gather, barrier
from rectrain.train import batchplan, calibrate, curves, outputs, runinfo, telemetry
from rectrain.train.epochs import Books, train_epochs
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import divergence, failure, stop
from rectrain.train.lifecycle.identity import maths_config
from rectrain.train.lifecycle.resume import previous_plan, resume
from rectrain.train.lifecycle.stop import Agreement, StopRequest
from rectrain.train.run import Run, build_run, prepare_rank
from rectrain.train.step import Step, run_steps

__all__ = ["Step", "run_steps", "train"]  # the step lives in rectrain.train.step; the bench imports it from here

log = logging.getLogger(__name__)


def train(args: argparse.Namespace, s: settings.TrainSettings) -> None:
    """One rank's whole run of the train block `s`; a failure is logged with what it means
    (failure.explain), then raised."""
    plan = None  # the failure line names it once it exists
    try:
        d = distributed.setup(s.launch.devices != "cpu", s.launch.collective_timeout_s)
        s = s.replaced(precision=run_precision(s.network, d))
        if d.master:
            (Path(args.out) / "checkpoints").mkdir(parents=True, exist_ok=True)
            # the evaluate stage's description of the weights this run replaces: not this run's
            (Path(args.out) / weights.JSON).unlink(missing_ok=True)
        with (
            watchdog.Watchdog(s.stops.watchdog_s, d.rank, d.world_size, Path(args.out) / "telemetry"),
            stop.handling(s.stops.stop_signals) as request,  # after the watchdog's SIGTERM stack dump: replaces it
        ):
            watchdog.beat("preparing: model, memory preflight, loaders")
            # the checkpoint's plan: batch_size auto reuses it when it fits, another world size regroups it
            previous = previous_plan(Path(args.out) / "checkpoints", s.stops.resume, maths_config(s.as_dict()))
            parts = prepare_rank(args, d, s.network, s.loaders, s.resolution, seed=s.launch.seed, epochs=s.optim.epochs)
            plan = batchplan.plan_batch(s.batch, d, parts, optim=s.optim, network=s.network, previous=previous)
            run = build_run(args, s, parts, plan)
            train_run(run, request)
    except stop.Agreed:  # a clean stop or a divergence: each said what it kept, no traceback
        raise
    except Exception as exc:
        log.exception(failure.explain(exc, s.batch, s.launch.devices, plan))
        raise


def run_precision(network: settings.TrainNetwork, d: distributed.Dist) -> str:
    """train.precision (of the train block's `network` part) as it runs on this rank's device
    (rectrain.model.resolve_precision), which the block then holds: every part of the run - the loaders'
    dtype, the preflight, the checkpoint's identity, run.json - sees it."""
    precision = models.resolve_precision(network.precision, d.device)
    if d.master and network.precision == "auto":
        log.info("train.precision auto: %s on %s", precision, d.device.type.upper())
    elif d.master and precision == "bf16" and d.device.type == "cpu":
        log.warning(
            "train.precision bf16 on a CPU: torch %s's CPU bf16 convolution backward reads uninitialised memory for a "
            "3x3 stride-2 convolution over a 1 x 1 map (at 16 px and below a ResNet's layer4 has one), which turns a "
            "run to NaN at random (bench/bf16_cpu_conv.py); auto or fp32 trains in fp32 here",
            torch.__version__,
        )
    return precision


def train_run(run: Run, request: StopRequest) -> None:
    """Resume or start over, calibrate, train the epochs (stopping when `request` gets a stop signal), publish."""
    d = run.d
    watchdog.beat("reading checkpoints/last.pt")
    resumed = resume(run)
    if resumed.restored:  # the finished run, published again from checkpoints/finished/
        return
    if resumed.world_sizes:
        run = dataclasses.replace(run, world_sizes=resumed.world_sizes)
    calibration = calibrate.reused_or_measured(run, run.out / calibrate.KEPT, resumed.continues)
    info = runinfo.run_info(
        run,
        resumed.start_epoch,
        calibration,
        resumed_despite=resumed.despite,
        start_step=resumed.start_step,
        diverged_before=divergence.diverged_before(run.ck_dir) if resumed.start_epoch or resumed.start_step else None,
    )
    info["calibration_setup"] = calibrate.setup_key(run)  # a resume on the same setup reuses the calibration
    info["parent"] = (
        resumed.parent
    )  # a branch (train.resume_from): the run, checkpoint, epoch and sha256 it started from
    if d.master:
        write_json(run.out / "run.json", info)
        (run.out / "telemetry").mkdir(parents=True, exist_ok=True)
        write_json(run.out / "telemetry" / telemetry.LIVE_RUN_JSON, info)  # what survives Snakemake's clean-up
        calibrate.keep(run.out / calibrate.KEPT, info)
        runinfo.log_start(run)
    if resumed.rng_states is not None:
        ckpt.set_rng_state(resumed.rng_states[d.rank])
    elif resumed.regrouped:
        ckpt.reseed(run.settings.launch.seed, resumed.start_epoch, d.rank)
    else:
        ckpt.seed_host_rngs(run.settings.launch.seed, d.rank)
    agreement = Agreement(d, request, run.settings.stops.checkpoint_interval_min)
    with (
        outputs.telemetry_logs(run, resumed.start_epoch, resumed.start_step) as (steps_log, epochs_log),
        curves.opened(
            d.master and run.settings.telemetry.tensorboard,
            run.out,
            run.train_loader.batches_per_epoch,
            resumed.start_epoch,
            resumed.start_step,
        ) as live,
    ):
        train_epochs(run, resumed.position, Books(steps_log, epochs_log, calibration, live), agreement)
    watchdog.beat("publishing the outputs")
    used = usage.combined(all_gather(usage.own(), d))  # every rank's CPU and memory: the report's train row
    reads = all_gather(run.train_loader.read_stats(), d)  # each rank's training reads (None: not measured)
    barrier(d)
    if d.master:
        epochs_log.close()
        outputs.finish(run, {**info, "usage": used, "reads": reads})
    barrier(d)
