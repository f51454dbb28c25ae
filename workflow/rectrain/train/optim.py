"""The optimizer and its learning-rate schedule: SGD (nesterov) with the LR scaled linearly with the
global batch (train.lr is for 256), linear warmup then cosine to zero, per optimizer step."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to 1, then cosine to 0, per optimizer step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(cfg: dict, model, global_batch: int, opt_steps_per_epoch: int):
    """(SGD with nesterov, warmup + cosine schedule, GradScaler for fp16) for the global batch."""
    peak_lr = cfg["lr"] * global_batch / 256
    total_steps = cfg["epochs"] * opt_steps_per_epoch
    warmup_steps = round(cfg["warmup_epochs"] * opt_steps_per_epoch)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=peak_lr,
        momentum=cfg["momentum"],
        nesterov=cfg["nesterov"] and cfg["momentum"] > 0,
        weight_decay=cfg["weight_decay"],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, total_steps))
    scaler = torch.amp.GradScaler(next(model.parameters()).device.type, enabled=cfg["precision"] == "fp16")
    return optimizer, scheduler, scaler
