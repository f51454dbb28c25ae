"""train.ema: an exponential moving average of the weights, timm's ModelEmaV3 - its decay (with the
optional warm-up 1 - (1 + step)^(-2/3), capped at train.ema.decay), its first update a copy (decay 0 at
optimizer step 1, as timm's train.py passes the step count), parameters and buffers alike - kept in fp32
on the model's device and updated after every optimizer step (rectrain.train.step.train_step).

The EMA is part of the run's state: every checkpoint holds it (`state`, rectrain.train.lifecycle.midepoch.
run_state) and a resume loads it (`load`), so a resumed run's EMA equals the uninterrupted one's; each
epoch validates it beside the raw weights (rectrain.train.epochs), and the published outputs carry both
(rectrain.train.outputs: weights-raw.safetensors, weights-ema.safetensors, and weights.safetensors as
train.ema.result names).  Only rank 0's EMA is checkpointed and published: the parameters are the same on
every rank (DDP), and validation broadcasts rank 0's buffers first, as it does the raw model's."""

from __future__ import annotations

import torch

# At import: a rank imports its modules before its watchdog starts (rectrain.train.optim imports timm too)
from timm.utils import ModelEmaV3


def on(ema: dict) -> bool:
    """train.ema keeps an average: its decay is above 0."""
    return ema["decay"] > 0


def build(ema: dict, model: torch.nn.Module):
    """timm's ModelEmaV3 of `model` (unwrapped: before DDP and torch.compile) for train.ema, or None when off."""
    if not on(ema):
        return None
    return ModelEmaV3(model, decay=float(ema["decay"]), use_warmup=bool(ema["warmup"]), dtype=torch.float32)


def state(averaged) -> dict | None:
    """The checkpoint's `ema`: the averaged network's state_dict (None without an EMA)."""
    return averaged.module.state_dict() if averaged is not None else None


def load(averaged, saved: dict | None) -> None:
    """Put a checkpoint's `ema` back.  A checkpoint without one (train.ema was off when it was written: only
    train.resume: always gets this far) is a KeyError, which resume.restore turns into its refusal."""
    if averaged is None:
        return
    if saved is None:
        raise KeyError("the checkpoint holds no EMA of the weights (train.ema was off when it was written)")
    averaged.module.load_state_dict(saved)


def words(ema: dict) -> str | None:
    """What the EMA did, for run.json and the report (recipe_as_run); None when off."""
    if not on(ema):
        return None
    warmup = ", with timm's warm-up 1 - (1 + step)^(-2/3)" if ema["warmup"] else ""
    return (
        f"timm's ModelEmaV3, decay {ema['decay']:g}{warmup}, after every optimizer step, fp32 on the device; "
        f"weights.safetensors is the {ema['result']} weights'"
    )
