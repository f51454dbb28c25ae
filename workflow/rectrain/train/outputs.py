"""What a run writes in --out: the live telemetry while it trains (out/telemetry/, appended to on
resume), and at the end the published outputs - weights.safetensors (rectrain.weights) for use
elsewhere (with train.ema, weights-raw.safetensors and weights-ema.safetensors beside it), model.pt last
(the rule's marker of a finished run)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil

from rectrain import model as models
from rectrain import weights
from rectrain.atomic import write_json
from rectrain.log import utc_now
from rectrain.storage import block_device_for
from rectrain.train import ema as emas
from rectrain.train import telemetry
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import supervise
from rectrain.train.lifecycle.checkpoint import CheckpointSaver
from rectrain.train.lifecycle.identity import maths_config
from rectrain.train.run import Run

log = logging.getLogger(__name__)


@contextlib.contextmanager
def telemetry_logs(run: Run, start_epoch: int, start_step: int = 0):
    """(steps log, epochs log on rank 0 else None) in out/telemetry/, with the node's system sampler;
    resumed at (start_epoch, start_step), the rows from there on are dropped (rectrain.train.telemetry)."""
    live = run.out / "telemetry"
    live.mkdir(parents=True, exist_ok=True)
    steps_log = telemetry.step_log(live, run.d.rank, start_epoch, start_step)
    epochs_log = telemetry.epoch_log(live, start_epoch) if run.d.master else None
    if run.d.master:
        telemetry.trim_departed(live, run.d.world_size, start_epoch, start_step)
    sampler = None
    if run.d.local_rank == 0:
        node = int(os.environ.get("GROUP_RANK", 0))  # torchrun's node rank
        sampler = telemetry.SystemSampler(
            live / f"system_node{node}.csv",
            run.settings.telemetry.sample_interval_s,
            block_device_for(run.args.rec),
            telemetry.job_processes(),
            append=start_epoch > 0 or start_step > 0,
        )
        sampler.start()
    try:
        yield steps_log, epochs_log
    finally:
        steps_log.close()
        if sampler is not None:
            sampler.stop()


def weights_description(run: Run, final: dict, variant: dict | None = None) -> dict:
    """weights.safetensors' description (rectrain.weights.describe) of the finished checkpoint `final`:
    the recipe is the train block less its operational keys (what the checkpoint's identity compares);
    `variant`: which weights of a train.ema run the file holds."""
    s = run.settings
    architecture = {
        "model": s.network.model,
        "model_args": dict(s.network.model_args),
        "blurpool": bool(s.network.blurpool),
        # the tensors are the plain architecture's; these convolutions get BlurPool back (rectrain.model.load_weights)
        "blurpool_layers": models.blurpool_layers(run.model),
    }
    return weights.describe(
        s.resolution.image_size,
        s.resolution.val_resolution,
        architecture,
        run.classes,
        epoch=int(final["epoch"]) + 1,
        recipe=maths_config(s.as_dict()),
        as_run=run.resolved,
        variant=variant,
    )


def publish_weights(run: Run, final: dict, out) -> None:
    """weights.safetensors from the finished checkpoint `final`, with its BlurPool layers' plain names; with
    train.ema also weights-raw.safetensors and weights-ema.safetensors, and weights.safetensors is the one
    train.ema.result names (the weights the recipe's published top-1 is of)."""
    layers = models.blurpool_layers(run.model)
    ema = run.settings.optim.ema
    if not emas.on(ema):
        weights.save(
            models.plain_state_dict(final["model"], layers), weights_description(run, final), out / weights.FILE
        )
        return
    states = {"raw": final["model"], "ema": final["ema"]}
    files = {"result": weights.FILE, **weights.VARIANT_FILES}
    for name, state in states.items():
        variant = {"weights": name, "result": ema["result"], "files": files}
        plain = models.plain_state_dict(state, layers)
        description = weights_description(run, final, variant)
        weights.save(plain, description, out / weights.VARIANT_FILES[name])
        if name == ema["result"]:
            weights.save(plain, description, out / weights.FILE)


def finish(run: Run, info: dict) -> None:
    """Publish the outputs on rank 0: merged telemetry, run.json (`info`, now finished), the weights
    (weights.safetensors) and model.pt last;
    then keep them beside the checkpoints (checkpoints/finished/) and mark the run finished."""
    live, out = run.out / "telemetry", run.out
    ckpt.clear(out)
    most = max([run.d.world_size, *(w["world_size"] for w in run.world_sizes)])  # a run moved 2 -> 1: both ranks' rows
    telemetry.merge_steps(live, out / "steps.csv", most)
    shutil.copyfile(live / "epochs.csv", out / "epochs.csv")
    shutil.copyfile(live / "system_node0.csv", out / "system.csv")  # other nodes: telemetry/system_node<k>.csv
    write_json(out / "run.json", {**info, "finished": utc_now()})
    final = ckpt.load(run.ck_dir / "last.pt")
    publish_weights(run, final, out)
    ckpt.save_atomic(final, out / "model.pt")
    saver = CheckpointSaver.of(run)
    saver.keep_finished(out)
    saver.mark_finished(out / "model.pt", os.environ.get(supervise.LAUNCH_ID_ENV))
    log.info("done: %s", out / "model.pt")
