"""The optimizer and its learning-rate schedule: timm's optimizer factory (SGD, AdamW, LAMB, LARS) with
the LR scaled with the global batch (train.lr is for 256; train.lr_scaling: linear, sqrt, or timm's rule
by optimizer family), per optimizer step, in one of three shapes (train.lr_schedule):

- cosine: linear warmup (train.warmup_epochs), then cosine to 0 (rectrain's original schedule);
- linear: FFCV's step-free schedule (libffcv/ffcv-imagenet train_imagenet.py, get_cyclic_lr): from
  1e-4 x peak at epoch 0 linearly to the peak at train.lr_peak_epoch, then linearly to 0 at the last
  epoch.  FFCV interpolates per iteration between its per-epoch values, which for a piecewise-linear
  curve with breakpoints on epoch boundaries is the curve itself at the fractional epoch;
- step: the classic schedule (torchvision's ResNet recipe): x train.lr_step_ratio at each epoch in
  train.lr_step_epochs, after the linear warmup.

The factor is a pure function of the optimizer step, so LambdaLR's checkpointed step count makes the
LR exact across any resume.

The optimizer and its parameter groups are timm's (timm.optim.create_optimizer_v2), for every model
kind: no weight decay on any parameter of 1 dimension or less (norm weights, biases, layer-scale gammas,
RMSNorm scales) nor on whatever the model's no_weight_decay() names (ViT's position embedding and class
token, Swin's relative-position bias tables; rectrain.model gives torchvision's models the same list),
unless train.decay_norm_and_bias.  FFCV's bn_wd 0 and torchvision's norm_weight_decay 0.0 are the same
rule for the ResNets.  With train.layer_decay the groups are timm's layer-wise ones
(param_groups_layer_decay, by the model's group_matcher()), each with its `lr_scale`; timm's own schedulers
multiply by it, torch's LambdaLR does not, so each group's LR is set to its scaled peak here, before the
schedule takes it as its base.

The LR scaling with the global batch, per optimizer family (train.lr_scaling auto is timm's train.py:
`lr_base_scale = 'sqrt' if any(o in opt for o in ('ada', 'lamb')) else 'linear'`): SGD and LARS linear
(Goyal et al. 2017), AdamW and LAMB by the square root (Hoffer et al. 2017; You et al. 2020).  linear and
sqrt set it whatever the optimizer; run.json records the rule, the factor and the peak LR of every group."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

# At import, not in make_optimizer: a rank imports its modules before its watchdog starts (timm's package
# imports its model registry, ~0.4 CPU-s), so the first step's preparation is not taken for a stall.
from timm.optim import create_optimizer_v2

from rectrain.model import name_patterns

# Weight decay by model family when train.weight_decay is null: 5e-5 for the ResNet-18/34 family
# (FFCV rn18_configs/*.yaml: weight_decay 5e-5), 1e-4 for everything else - torchvision's classic
# ResNet-50 recipe (references/classification, --wd 1e-4, 76.1 % top-1) and FFCV rn50_configs/*.yaml.
FAMILY_WEIGHT_DECAY = {"resnet18": 5.0e-5, "resnet34": 5.0e-5}
DEFAULT_WEIGHT_DECAY = 1.0e-4
# ...and by optimizer where it is not SGD: AdamW 0.05, ConvNeXt's (Liu et al. 2022, Table 10) and DeiT's
# (Touvron et al. 2021, Table 9) value; their recipes' AdamW weight decay is 25-500x SGD's.
# LAMB 0.02: ResNet strikes back's A2 and A3 (Wightman et al. 2021, Table 1).
OPTIMIZER_WEIGHT_DECAY = {"adamw": 0.05, "lamb": 0.02}
# timm's train.py scales these by the square root of the batch ratio ('ada' or 'lamb' in the name).
SQRT_SCALED = ("adamw", "lamb")
LINEAR_START = 1e-4  # FFCV's get_cyclic_lr starts at 1e-4 x the peak LR


def weight_decay(optim, family: str) -> float:
    """train.weight_decay (of the train block's `optim` part), or when it is null the published value for
    train.optimizer: by the model family `family` (train.model) for SGD."""
    if optim.weight_decay is not None:
        return float(optim.weight_decay)
    if optim.optimizer in OPTIMIZER_WEIGHT_DECAY:
        return OPTIMIZER_WEIGHT_DECAY[optim.optimizer]
    return FAMILY_WEIGHT_DECAY.get(family, DEFAULT_WEIGHT_DECAY)


@dataclass(frozen=True)
class Schedule:
    """The LR factor (of the peak) at each optimizer step."""

    kind: str  # cosine | linear | step
    steps_per_epoch: int
    epochs: int
    warmup_steps: int = 0
    peak_epoch: float = 2.0
    step_epochs: tuple[float, ...] = (30, 60, 80)
    step_ratio: float = 0.1

    def factor(self, step: int) -> float:
        if self.kind == "linear":
            return self._linear(step / self.steps_per_epoch)
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "step":
            return self.step_ratio ** bisect.bisect_right(self.step_epochs, step / self.steps_per_epoch)
        total = self.epochs * self.steps_per_epoch
        progress = (step - self.warmup_steps) / max(1, total - self.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def _linear(self, epoch: float) -> float:
        peak = min(self.peak_epoch, self.epochs)
        if epoch < peak:
            return LINEAR_START + (1.0 - LINEAR_START) * epoch / peak
        if epoch >= self.epochs:
            return 0.0
        return (self.epochs - epoch) / (self.epochs - peak)


def schedule(optim, opt_steps_per_epoch: int) -> Schedule:
    """The schedule of the train block's `optim` part."""
    return Schedule(
        kind=optim.lr_schedule,
        steps_per_epoch=opt_steps_per_epoch,
        epochs=optim.epochs,
        warmup_steps=round(optim.warmup_epochs * opt_steps_per_epoch),
        peak_epoch=optim.lr_peak_epoch,
        step_epochs=tuple(sorted(optim.lr_step_epochs)),
        step_ratio=optim.lr_step_ratio,
    )


def fused_supported(device: torch.device) -> bool:
    """torch's fused SGD kernel runs on this device (CUDA and, since torch 2.4, CPU)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


def timm_name(optim) -> str:
    """timm's optimizer name for train.optimizer: its 'sgd' is SGD with Nesterov momentum, 'momentum' without;
    'nlars' is LARS with Nesterov momentum, 'lars' without."""
    nesterov = optim.nesterov and optim.momentum > 0
    if optim.optimizer == "sgd":
        return "sgd" if nesterov else "momentum"
    if optim.optimizer == "lars":
        return "nlars" if nesterov else "lars"
    return optim.optimizer


def lr_rule(optim) -> str:
    """train.lr_scaling as it applies to train.optimizer: linear or sqrt (auto: timm's rule by family)."""
    if optim.lr_scaling != "auto":
        return optim.lr_scaling
    return "sqrt" if optim.optimizer in SQRT_SCALED else "linear"


def peak_lr(optim, global_batch: int) -> float:
    """The peak LR at this global batch: train.lr (for 256) scaled by lr_rule."""
    ratio = global_batch / 256
    return optim.lr * (math.sqrt(ratio) if lr_rule(optim) == "sqrt" else ratio)


def factory_options(optim, model, device: torch.device) -> dict:
    """create_optimizer_v2's keywords beyond the groups' from the train block's `optim` part: betas and eps
    where set (the factory drops what the optimizer has not), torch's fused kernel for SGD and AdamW
    (timm's LAMB and LARS have none), layer_decay for a model timm can group - refused, naming the key,
    for one it cannot (timm would put every parameter in one group and change nothing)."""
    options: dict = {}
    if optim.betas is not None:
        options["betas"] = tuple(optim.betas)
    if optim.eps is not None:
        options["eps"] = float(optim.eps)
    if optim.optimizer in ("sgd", "adamw"):
        options["fused"] = bool(optim.fused_sgd) and fused_supported(device)
    if optim.layer_decay is not None:
        if not callable(getattr(model, "group_matcher", None)):
            raise ValueError(
                f"config key 'train.layer_decay' = {optim.layer_decay}: {type(model).__name__} has no group_matcher(), "
                "so timm cannot tell its layers apart and every parameter would get the same LR; use a timm model "
                "(timm:<name>) or set train.layer_decay: null"
            )
        options["layer_decay"] = float(optim.layer_decay)
    return options


def make_optimizer(optim, model, global_batch: int, opt_steps_per_epoch: int, *, family: str, precision: str):
    """(the optimizer - timm's factory, see the module doc -, the LR schedule, GradScaler for fp16) for the
    global batch, from the train block's `optim` part, the model family (train.model: the default weight
    decay) and train.precision.  The fused kernel takes the GradScaler's scale and found-inf flag as
    tensors (SGD._step_supports_amp_scaling), so an fp16 step skips an overflowed update on the device
    instead of reading the flag on the host."""
    device = next(model.parameters()).device
    lr = peak_lr(optim, global_batch)
    optimizer = create_optimizer_v2(
        model,
        opt=timm_name(optim),
        lr=lr,
        weight_decay=weight_decay(optim, family),
        momentum=optim.momentum,
        filter_bias_and_bn=not optim.decay_norm_and_bias,
        **factory_options(optim, model, device),
    )
    for group in optimizer.param_groups:  # layer decay: timm's schedulers apply lr_scale, LambdaLR does not
        if "lr_scale" in group:
            group["lr"] = lr * group["lr_scale"]
    sched = schedule(optim, opt_steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: sched.factor(s))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    return optimizer, scheduler, scaler


def recorded(optimizer: torch.optim.Optimizer, model: torch.nn.Module, optim=None, global_batch: int = 256) -> dict:
    """What the optimizer does, as run.json and weights.json record it: its class, the LR scaling (`optim`:
    the train block's optim part; `global_batch`: the one it ran at), and per parameter group the peak LR,
    layer-decay scale and weight decay it runs at and its tensors by name pattern, with counts."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [
        {
            "peak_lr": g.get("initial_lr", g["lr"]),
            "lr_scale": g.get("lr_scale", 1.0),
            "weight_decay": g["weight_decay"],
            "tensors": len(g["params"]),
            "parameters": sum(p.numel() for p in g["params"]),
            "names": name_patterns(names[id(p)] for p in g["params"]),
        }
        for g in optimizer.param_groups
    ]
    # the optimizer's own settings as it runs them (train.betas, eps, momentum, nesterov; LAMB's gradient clip)
    kept = ("betas", "eps", "momentum", "nesterov", "max_grad_norm", "trust_clip")
    settings = {k: optimizer.defaults[k] for k in kept if k in optimizer.defaults}
    return {
        "class": type(optimizer).__name__,
        "lr_scaling": scaling_words(optim, global_batch),
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()},
        "groups": groups,
    }


def scaling_words(optim, global_batch: int) -> str:
    """The LR scaling rule as it ran, in words (run.json's recipe_as_run.optimizer.lr_scaling)."""
    if optim is None:
        return "linear: train.lr x global batch / 256"
    rule = lr_rule(optim)
    formula = "sqrt(global batch / 256)" if rule == "sqrt" else "global batch / 256"
    why = f" (train.lr_scaling auto: timm's rule for {optim.optimizer})" if optim.lr_scaling == "auto" else ""
    return (
        f"{rule}{why}: train.lr {optim.lr:g} x {formula} = {peak_lr(optim, global_batch):.6g} at global batch "
        f"{global_batch}"
    )


def keep_configured_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, base_lrs: list[float]) -> None:
    """After loading a checkpoint's optimizer and schedule: train on at this run's peak LRs `base_lrs`
    (train.lr as now configured, scaled), at the loaded step.  Loading restores the peak the checkpoint
    was written with, so a run resumed with a lower train.lr (train.resume: always, after a divergence)
    would otherwise go on at the old one.  The same run: the same values, nothing changes."""
    scheduler.base_lrs = list(base_lrs)
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, base, lr in zip(scheduler.optimizer.param_groups, base_lrs, lrs, strict=True):
        group["initial_lr"], group["lr"] = base, lr
    scheduler._last_lr = lrs  # what get_last_lr() reports until the next step
