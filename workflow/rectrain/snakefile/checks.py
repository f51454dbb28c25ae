"""Config checks made while the Snakefile is parsed, before Snakemake removes any output:
cross-field rules, paths, and combinations that run but are probably not meant. check_config alone
reads the whole config; each check gets the blocks (their rectrain.settings views) or the train
parts it reads. Stages never import this module (editing a message here reruns nothing); they
complete their own block with rectrain.config.stage_block.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
from pathlib import Path

from rectrain import driver_check, settings
from rectrain.config import (
    SCHEMA_PATH,
    ConfigError,
    fill_defaults,
    format_problems,
    key_path,
    load_schema,
    path_values,
    shown_path,
)
from rectrain.data.fit import TYPICAL_ASPECT, Fit, pack_fit
from rectrain.loaders import augment
from rectrain.safefs import not_a_file
from rectrain.settings import (
    CheckSettings,
    EvaluateSettings,
    PackSettings,
    TrainBatch,
    TrainLaunch,
    TrainResolution,
)
from rectrain.snakefile.byo import byo_problems
from rectrain.train import batchaug, losses
from rectrain.train.globalbatch import global_batch_problems
from rectrain.train.resolution import largest

log = logging.getLogger(__name__)


def check_paths(raw: str | None, fast_storage: str, workdir: Path, written: dict[str, str] | None = None) -> list[str]:
    """Paths that must exist (raw) or be creatable and writable (pack.fast_storage). written: the path
    keys as given before expansion (rectrain.config.path_values), so a message shows both."""
    problems, written = [], written or {}
    if raw is not None:
        raw_path = (workdir / raw) if not os.path.isabs(raw) else Path(raw)
        if not raw_path.is_dir():
            problems.append(
                f"{shown_path('raw', raw, written)}: no such directory. Point it at the ImageNet root "
                "(holding train/ and val/, or ILSVRC2012_img_train.tar), or set raw: null for the demo set."
            )
    fast_path = (workdir / fast_storage) if not os.path.isabs(fast_storage) else Path(fast_storage)
    existing = fast_path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        problems.append(
            f"{shown_path('pack.fast_storage', fast_storage, written)}: {existing} is a file, not a directory."
        )
    elif not os.access(existing, os.W_OK):
        problems.append(
            f"{shown_path('pack.fast_storage', fast_storage, written)}: {existing} is not writable; "
            "choose a directory on an SSD you can write to."
        )
    return problems


# The Snakefile's entry point: the one function here that sees the whole config, to validate and fill
# it as one document against the schema and then hand each check only the blocks or parts it reads.
def check_config(config: dict, schema_path=SCHEMA_PATH, workdir=".") -> dict:
    """Validate and fill defaults in place, then cross-check keys and paths; raise ConfigError listing
    every problem, and log a warning for each combination that runs but is probably not meant."""
    schema = load_schema(schema_path)
    written = path_values(config, schema)  # before fill_defaults expands them
    fill_defaults(config, schema_path)
    views = settings.whole(config)
    train = views.train
    problems = whole_numbers(config, schema)
    problems += cross_check(
        views.pack,
        views.evaluate,
        views.check,
        train.resolution,
        model=train.network.model,
        batch=train.batch,
        launch=train.launch,
    )
    problems += resume_from_problems(train.stops.resume_from)
    problems += augment.config_problems(train.loaders)
    problems += batchaug.config_problems(train.loaders, train.batch.batch_size)
    problems += check_paths(views.raw, views.pack.fast_storage, Path(workdir), written)
    fast = f"{views.pack.fast_storage.rstrip('/')}/{views.dataset}"
    problems += byo_problems(views.recordio, fast, Path(workdir), written)
    if problems:
        raise ConfigError(format_problems(problems))
    for line in cross_warnings(views.pack, train.resolution, train.optim.epochs) + losses.config_warnings(
        train.network
    ):
        log.warning("config: %s", line)
    return config


def resume_from_problems(checkpoint: str | None) -> list[str]:
    """train.resume_from must name a checkpoint file: a missing one would leave Snakemake keeping the
    finished run it should replace (a missing input of a job whose outputs exist reruns nothing)."""
    why = not_a_file(checkpoint) if checkpoint is not None else None
    if why is None:
        return []
    return [
        f"config key 'train.resume_from' = {checkpoint!r}: {why}; name an epoch_<k>.pt or last.pt of another run "
        "(results/<dataset>/<run>/train/checkpoints/), or null"
    ]


def _branches(schema: dict) -> list[dict]:
    return [schema, *schema.get("oneOf", [])]


def _types(schema: dict) -> set[str]:
    types: set[str] = set()
    for branch in _branches(schema):
        given = branch.get("type", [])
        types.update([given] if isinstance(given, str) else given)
    return types


def whole_numbers(value, schema: dict, path=()) -> list[str]:
    """Integer keys given a float: JSON Schema counts 2.0 as an integer, but the code would get a
    float (range(2.0) fails hours later), so it is refused here."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return [line for k, v in value.items() if k in props for line in whole_numbers(v, props[k], (*path, k))]
    if isinstance(value, list):
        items = next((b["items"] for b in _branches(schema) if "items" in b), None)
        return [line for i, v in enumerate(value) if items for line in whole_numbers(v, items, (*path, i))]
    types = _types(schema)
    if isinstance(value, float) and "integer" in types and "number" not in types:
        return [f"config key '{key_path(path)}' = {value!r} must be a whole number: write {int(value)}"]
    return []


def cross_check(
    pack: PackSettings,
    evaluate: EvaluateSettings,
    check: CheckSettings,
    resolution: TrainResolution,
    *,
    model: str,
    batch: TrainBatch,
    launch: TrainLaunch,
) -> list[str]:
    """Combinations of keys that every schema check passes but that can only fail in a later job.
    model: train.model; batch and launch: the train parts the global batch is checked with."""
    problems = []
    try:
        pack_fit(pack.resize, pack.max_side)
    except ConfigError as err:
        problems.append(str(err))
    crop = evaluate.crop or resolution.image_size
    if evaluate.resize is not None and crop > evaluate.resize:
        source = "evaluate.crop" if evaluate.crop else "train.image_size (evaluate.crop: null)"
        problems.append(
            f"config key 'evaluate.crop': the centre crop {crop} (from {source}) is larger than the image after "
            f"'evaluate.resize' = {evaluate.resize}; set evaluate.resize >= {crop}, or null for {crop} / 0.875"
        )
    if check.crop is not None and check.resize is not None and check.crop > check.resize:
        problems.append(
            f"config key 'check.crop' = {check.crop} is larger than the image after 'check.resize' = "
            f"{check.resize}; set check.resize >= {check.crop}, or null for {check.crop} / 0.875"
        )
    problems += progressive_problems(resolution.progressive)
    problems += global_batch_problems(batch, launch)  # train.devices auto: checked by the onstart hook (prestart)
    models = known_models()
    # timm:<name> and your own factory are built and checked by rectrain.snakefile.modelcheck
    torchvision_name = ":" not in model
    if torchvision_name and models is not None and model not in models:
        near = sorted(m for m in models if m.startswith(model.rstrip("0123456789")))[:8]
        problems.append(
            f"config key 'train.model' = {model!r} is not a torchvision model"
            + (f" (similar: {', '.join(near)})" if near else " (torchvision.models.list_models() lists them)")
            + "; timm:<name>, path/to/file.py:factory or package.module:factory name other networks"
        )
    return problems


def progressive_problems(ramp: dict | None) -> list[str]:
    """train.progressive's bounds in order: the ramp runs from min_res at start_ramp up to max_res at
    end_ramp (rectrain.train.resolution), so neither pair may be reversed."""
    if not ramp:
        return []
    problems = []
    if ramp["min_res"] > ramp["max_res"]:
        problems.append(
            f"config key 'train.progressive.min_res' = {ramp['min_res']} is larger than 'train.progressive.max_res' = "
            f"{ramp['max_res']}: the ramp grows from min_res to max_res; set min_res <= max_res "
            "(equal values train every epoch at that resolution)"
        )
    if ramp["start_ramp"] > ramp["end_ramp"]:
        problems.append(
            f"config key 'train.progressive.start_ramp' = {ramp['start_ramp']} is after 'train.progressive.end_ramp' = "
            f"{ramp['end_ramp']}: the ramp starts at epoch start_ramp and reaches max_res at epoch end_ramp; set "
            "start_ramp <= end_ramp"
        )
    return problems


def progressive_warnings(pack: PackSettings, resolution: TrainResolution, epochs: int) -> list[str]:
    """A train.progressive ramp that runs but not as written: max_res never reached within train.epochs,
    or packed images smaller than the largest crop."""
    ramp = resolution.progressive
    if not ramp or progressive_problems(ramp):
        return []
    lines, top = [], largest(resolution.image_size, ramp, epochs)
    if top < ramp["max_res"]:
        lines.append(
            f"'train.progressive.max_res' = {ramp['max_res']} is never reached: train.epochs = {epochs} ends "
            f"before 'train.progressive.end_ramp' = {ramp['end_ramp']}, so the largest crop is {top} px; set end_ramp "
            f"<= {epochs - 1} to reach it"
        )
    if pack.resize and resolution.image_size <= pack.resize < top:  # below image_size: warned already
        lines.append(
            f"'pack.resize' = {pack.resize} stores images smaller than the largest training crop {top} px "
            "(train.progressive): those epochs train on upscaled crops; set pack.resize >= it (or 0)"
        )
    return lines


def cross_warnings(pack: PackSettings, resolution: TrainResolution, epochs: int) -> list[str]:
    """Combinations that run but waste work or are ignored. epochs: train.epochs."""
    return stored_size_warnings(pack, resolution.image_size) + progressive_warnings(pack, resolution, epochs)


def stored_size_warnings(pack: PackSettings, image_size: int) -> list[str]:
    """The pack's stored images smaller than the training crop: every such crop is upscaled. A longest
    side is judged by a 4:3 photo's shorter side (rectrain.data.fit.TYPICAL_ASPECT)."""
    resize, max_side = pack.resize, pack.max_side
    if resize and resize < image_size:
        return [
            f"'pack.resize' = {resize} stores images smaller than 'train.image_size' = {image_size}: "
            "every training crop is upscaled; set pack.resize >= train.image_size (or 0 to keep the originals)"
        ]
    shorter = Fit(longer=max_side or 0).typical_shorter_side()
    if shorter and shorter < image_size:
        return [
            f"'pack.max_side' = {max_side} stores a 4:3 photo at {max_side}x{shorter}, its shorter side below "
            f"'train.image_size' = {image_size}: most training crops are upscaled; set pack.max_side >= "
            f"{math.ceil(image_size * TYPICAL_ASPECT)} (or null to keep the originals)"
        ]
    return []


def device_problems(devices, env=None, gpus: driver_check.Gpus | None = None) -> list[str]:
    """train.devices against the GPUs this machine shows, as the train job's launcher would refuse them
    at its start: ids beyond the GPUs visible here, or GPUs torch cannot use (driver_check).  Read
    through NVML or /dev/nvidia* (driver_check.find_gpus, ~0.1 s) rather than torch (~2 s to import),
    honouring CUDA_VISIBLE_DEVICES; the launcher's own torch check stays the final word."""
    env = os.environ if env is None else env
    if devices == "cpu":
        return []
    gpus = driver_check.find_gpus() if gpus is None else gpus
    try:
        driver_check.check(devices, None, env=env, gpus=gpus)
    except driver_check.DriverMismatch as err:
        return [f"config key 'train.devices' = {devices!r}: {err}"]
    visible = visible_gpus(gpus.count, env)
    wanted = sorted({int(d) for d in devices if int(d) >= visible}) if isinstance(devices, list) else []
    if not wanted:
        return []
    seen = f"{gpus.count} GPU(s) seen through {gpus.source}"
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        seen += f", CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
    here = (
        f"only {visible} GPU(s) are visible here (ids 0..{visible - 1}; {seen})"
        if visible
        else f"no GPU is visible here ({seen})"
    )
    return [
        f"config key 'train.devices' = {devices} asks for GPU id(s) {wanted}, but {here}: "
        "the train job would fail at its start, after Snakemake removed its outputs. Fix: set train.devices: auto "
        "(every GPU here, CPU processes when none) or cpu, or list ids that exist here; or run the jobs where the "
        "GPUs are (--workflow-profile profiles/slurm)"
    ]


def precision_problems(devices, precision: str, env=None, gpus: driver_check.Gpus | None = None) -> list[str]:
    """train.precision fp16 where training would run on CPU processes here (train.devices cpu, or auto
    with no GPU visible). CPUs have no fast fp16 kernels: a copy of a GPU config (imagenet-2gpu.yaml,
    fp16 for Turing) trained resnet18 at 64 px at 0.2 img/s on this project's 2-core machine, against
    33 img/s in bf16, its calibration step alone taking 5 minutes - without a word (issue 27)."""
    if precision != "fp16" or isinstance(devices, list):
        return []
    env = os.environ if env is None else env
    if devices == "auto" and visible_gpus((driver_check.find_gpus() if gpus is None else gpus).count, env):
        return []
    where = "train.devices is 'cpu'" if devices == "cpu" else "train.devices is 'auto' and no GPU is visible here"
    return [
        f"config key 'train.precision' = 'fp16', but {where}: training would run on CPU processes, which have no "
        "fast fp16 kernels (about 150x slower than bf16 on a CPU). Fix: set train.precision: bf16 (or fp32) for a "
        "run on CPUs; keep fp16 for GPUs without fast bf16 (Turing, e.g. the RTX 2080 Ti)"
    ]


def node_problems(nodes: int, env=None) -> list[str]:
    """train.nodes > 1 where this machine cannot start it (not a SLURM job, no rendezvous endpoint
    given), as the train job's launcher would refuse it at its start (rectrain.train.cluster)."""
    if nodes <= 1:
        return []
    from rectrain.train import cluster  # imports torch (~2 s): only for a multi-node config

    try:
        cluster.plan_node_launch(nodes, dict(os.environ if env is None else env))
    except cluster.ClusterError as err:
        return [f"config key 'train.nodes' = {nodes}: {err}"]
    return []


def visible_gpus(count: int, env) -> int:
    """How many of the driver's `count` GPUs CUDA would show under env's CUDA_VISIBLE_DEVICES."""
    if driver_check.gpus_hidden(env):
        return 0
    listed = env.get("CUDA_VISIBLE_DEVICES")
    return count if listed is None else min(count, len([e for e in listed.split(",") if e.strip()]))


def known_models() -> set[str] | None:
    """torchvision's model names (what train.model may be), or None where torchvision is not installed
    beside Snakemake (the jobs' own environment decides then). Importing torchvision costs seconds,
    so the list is cached per torchvision version and a dry-run stays fast."""
    try:
        version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return None
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = cache_home / "rectrain" / f"torchvision-{version}-models.json"
    try:
        return set(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    import torchvision.models

    from rectrain.atomic import write_json

    names = sorted(torchvision.models.list_models())
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json(cache, names)
    except OSError as err:  # a read-only home only costs the import next time
        log.debug("model list not cached at %s: %s", cache, err)
    return set(names)
