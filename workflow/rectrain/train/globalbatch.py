"""The recipe's global batch with a numeric per-device batch: when train.global_batch is set and
train.batch_size is a number, that number is the per-device micro-batch and the gradient accumulation
is derived so that batch x grad_accum x processes is the global batch (a preset's recipe trains the
same on a box that fits 64 per GPU as on one that fits 512).  A global batch that is no whole
multiple of batch_size x processes cannot be kept; it is refused naming the nearest settings that can.

Pure arithmetic without torch: the Snakefile's parse-time checks, the onstart hook and every rank's
start call the same functions, so the refusal reads the same wherever it is made."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rectrain.config import ConfigError

if TYPE_CHECKING:
    from rectrain.settings import TrainBatch, TrainLaunch


def numeric_with_global(batch_size, global_batch) -> bool:
    """Whether the derivation applies: a number in train.batch_size and train.global_batch set."""
    return global_batch is not None and batch_size != "auto"


def derived_accum(global_batch: int, batch_size: int, world_size: int, grad_accum: int = 1) -> int:
    """grad_accum keeping `global_batch` with `batch_size` per device on `world_size` processes; raises
    ConfigError naming the nearest settings that work when none does, or when train.grad_accum was set to
    another value (1, the schema default, means 'not set')."""
    per_step = batch_size * world_size
    if global_batch % per_step:
        raise ConfigError(refusal(global_batch, batch_size, world_size))
    accum = global_batch // per_step
    if grad_accum not in (1, accum):
        raise ConfigError(
            f"config key 'train.grad_accum' = {grad_accum} contradicts 'train.global_batch' = {global_batch}: with "
            f"batch_size {batch_size} on {world_size} process(es) the global batch needs grad_accum {accum}, which is "
            f"derived; remove train.grad_accum (or set train.global_batch: null to use it as given)"
        )
    return accum


def refusal(global_batch: int, batch_size: int, world_size: int) -> str:
    """Why `global_batch` cannot be kept with `batch_size` per device on `world_size` processes, and the
    nearest per-device batches and global batches that can."""
    per_step = batch_size * world_size
    fixes = []
    below, above = nearest_batches(global_batch, world_size, batch_size)
    options = [f"{b} (grad_accum {global_batch // (b * world_size)})" for b in (below, above) if b]
    if options:
        fixes.append(f"train.batch_size: {' or '.join(options)}")
    lower = global_batch // per_step * per_step
    globals_ = [g for g in (lower, lower + per_step) if g > 0]
    fixes.append(
        "train.global_batch: "
        + " or ".join(f"{g} (grad_accum {g // per_step})" for g in globals_)
        + " (the LR scaled to it by train.lr_scaling)"
    )
    return (
        f"config key 'train.global_batch' = {global_batch} is not a whole multiple of train.batch_size {batch_size} x "
        f"{world_size} process(es) = {per_step}, so no grad_accum keeps it; set " + ", or ".join(fixes)
    )


def nearest_batches(global_batch: int, world_size: int, batch_size: int) -> tuple[int | None, int | None]:
    """(the largest per-device batch below `batch_size`, the smallest above it) that divide the global
    batch's per-device share; None where there is none (a global batch not divisible by the processes
    has none at all)."""
    if global_batch % world_size:
        return None, None
    share = global_batch // world_size
    divisors = [b for b in range(1, share + 1) if share % b == 0]
    below = max((b for b in divisors if b < batch_size), default=None)
    above = min((b for b in divisors if b > batch_size), default=None)
    return below, above


def parse_time_processes(devices, cpu_processes: int, nodes: int, gpus_here: int | None = None) -> int | None:
    """The processes train.devices gives, as rectrain.distributed.plan_processes counts them: a GPU list's
    length, cpu_processes for 'cpu', and for 'auto' the GPUs here (`gpus_here`; None: not known) or
    cpu_processes without any; times train.nodes.  None when not known before the job starts."""
    if isinstance(devices, list):
        per_node = len(devices)
    elif devices == "cpu":
        per_node = int(cpu_processes)
    elif gpus_here is None:
        return None
    else:
        per_node = gpus_here or int(cpu_processes)
    return per_node * int(nodes)


def global_batch_problems(batch: TrainBatch, launch: TrainLaunch, gpus_here: int | None = None) -> list[str]:
    """The config check: the train block's global batch with its numeric batch_size (`batch`, the train
    block's batch part) on the processes its `launch` part will run (when known now: see
    parse_time_processes)."""
    if not numeric_with_global(batch.batch_size, batch.global_batch):
        return []
    world = parse_time_processes(launch.devices, launch.cpu_processes, launch.nodes, gpus_here)
    if world is None:
        return []
    try:
        derived_accum(batch.global_batch, int(batch.batch_size), world, int(batch.grad_accum))
    except ConfigError as err:
        return [str(err)]
    return []
