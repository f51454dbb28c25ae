"""Each stage's config block as one frozen, typed view, built once at its entry point.

Every block and every part of the train block is a declared frozen dataclass, one field per schema key,
typed as config/schema.yaml types it, so an editor and a type checker know each field; the schema stays
the one home of the keys' defaults, meaning and checks (tests/test_settings.py holds each class's fields
equal to its block's or part's keys).  A stage's entry point completes its block (rectrain.config.
stage_block) and shapes it here; no function below it receives - or can alter - the raw dict.

Training's block is split by concern: each train key's `x-part` in the schema names its part, one name
everywhere - `launch`, `network`, `batch`, `loaders`, `optim`, `resolution`, `stops`, `telemetry` - and a
module receives only the part it uses (`s.optim` for the optimizer and schedule, `s.loaders` for the
loaders and decoding, ...).  `as_dict()` gives the whole block back, flat, for what records it as a
whole: run.json, the checkpoint's identity (rectrain.config.output_part), the failure line.
"""

from __future__ import annotations

import dataclasses


class _View:
    """What every view has: its keys and values as a plain dict."""

    def as_dict(self) -> dict:
        """The view's keys and values as a plain dict (a copy: editing it changes nothing here)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class TrainLaunch(_View):
    """The train block's `launch` part: processes, devices, DDP and the seed (train.* with x-part launch)."""

    devices: str | list
    cpu_processes: int
    nodes: int
    ddp_bucket_view: bool
    ddp_static_graph: bool
    ddp_comm_hook: str
    seed: int
    collective_timeout_s: float


@dataclasses.dataclass(frozen=True)
class TrainLoaders(_View):
    """The train block's `loaders` part: the loader, its workers, decoding and augmentation."""

    loader: str
    order: str
    repeated_aug: int
    workers: int | str
    gpu_decode: bool
    augment: dict
    mixup: dict
    decode: str
    dali_hw_decoder_load: float
    dali_prefetch_queue_depth: int
    dali_device_memory_padding: int
    dali_host_memory_padding: int
    dali_preallocate: list


@dataclasses.dataclass(frozen=True)
class TrainNetwork(_View):
    """The train block's `network` part: the network, its init, mechanics and numerics."""

    model: str
    init_weights: str | None
    init_weights_strict: bool
    model_args: dict
    zero_init_residual: bool
    blurpool: bool
    label_smoothing: float
    loss: str
    bce_target_threshold: float | None
    precision: str
    channels_last: bool
    compile: bool
    compile_mode: str
    cudnn_benchmark: bool


@dataclasses.dataclass(frozen=True)
class TrainResolution(_View):
    """The train block's `resolution` part: the training crop per epoch and validation's."""

    image_size: int
    progressive: dict | None
    val_resolution: int | None


@dataclasses.dataclass(frozen=True)
class TrainOptim(_View):
    """The train block's `optim` part: the optimizer, the epochs and the LR schedule."""

    epochs: int
    lr: float
    optimizer: str
    momentum: float
    nesterov: bool
    betas: list | None
    eps: float | None
    layer_decay: float | None
    lr_scaling: str
    weight_decay: float | None
    decay_norm_and_bias: bool
    clip_grad_norm: float | None
    lr_schedule: str
    lr_peak_epoch: float
    lr_step_epochs: list
    lr_step_ratio: float
    warmup_epochs: float
    ema: dict
    fused_sgd: bool


@dataclasses.dataclass(frozen=True)
class TrainBatch(_View):
    """The train block's `batch` part: the per-device batch, the global batch, accumulation."""

    batch_size: int | str
    global_batch: int | None
    grad_accum: int


@dataclasses.dataclass(frozen=True)
class TrainTelemetry(_View):
    """The train block's `telemetry` part: sampling, calibration, curves, progress lines."""

    sample_interval_s: float
    calibration_steps: int
    calibration_warmup_steps: int
    calibration_max_s: float
    tensorboard: bool
    progress_s: float


@dataclasses.dataclass(frozen=True)
class TrainStops(_View):
    """The train block's `stops` part: the watchdog, resuming, stop signals, checkpoints kept."""

    watchdog_s: float
    resume: str
    resume_from: str | None
    keep_checkpoints: int
    stop_signals: list
    keep_replaced: int
    nonfinite_steps: int
    allow_chance: bool
    checkpoint_interval_min: float


@dataclasses.dataclass(frozen=True)
class DemoSettings(_View):
    """The `demo` block (config/schema.yaml)."""

    classes: int
    train_per_class: int
    val_per_class: int
    min_size: int
    max_size: int
    quality: int
    seed: int
    bad_files: bool


@dataclasses.dataclass(frozen=True)
class IndexSettings(_View):
    """The `index` block (config/schema.yaml)."""

    classes: list | str | None
    per_class: int | None
    seed: int
    absent_splits: list
    allow_outside_root: list


@dataclasses.dataclass(frozen=True)
class PackSettings(_View):
    """The `pack` block (config/schema.yaml)."""

    fast_storage: str
    resize: int
    max_side: int | None
    quality: int
    shuffle_seed: int
    threads: int
    check_scan_data: bool
    max_image_bytes: int
    max_skipped_share: float
    read_order: str
    progress_s: float
    stage_to_local: bool
    local_storage: str | None


@dataclasses.dataclass(frozen=True)
class RecordioSettings(_View):
    """The `recordio` block (config/schema.yaml)."""

    train: dict | None
    val: dict | None
    classes: str | None
    order: str
    threads: int
    progress_s: float


@dataclasses.dataclass(frozen=True)
class EvaluateSettings(_View):
    """The `evaluate` block (config/schema.yaml)."""

    loader: str | None
    batch_size: int
    resize: int | None
    crop: int | None
    resolutions: list
    flip_tta: bool
    progress_s: float
    workers: int | str


@dataclasses.dataclass(frozen=True)
class CheckSettings(_View):
    """The `check` block (config/schema.yaml)."""

    weights: str | None
    model: str | None
    crop: int | None
    resize: int | None
    precision: str | None
    loader: str | None
    batch_size: int
    progress_s: float
    workers: int | str


@dataclasses.dataclass(frozen=True)
class RecipeSettings(_View):
    """The `recipe` block (config/schema.yaml)."""

    name: str | None
    published_top1: float | None
    epochs: int | None
    source: str | None
    reference_hardware: str | None
    reference_minutes: float | None


@dataclasses.dataclass(frozen=True)
class ReportSettings(_View):
    """The `report` block (config/schema.yaml)."""

    title: str
    data_wait_share: float
    imbalance_ratio: float
    iowait_percent: float
    gpu_mem_high: float
    gpu_mem_low: float
    gpu_util_low: float
    input_efficiency: float
    cpu_busy_percent: float
    slow_epoch_ratio: float
    other_cpu_percent: float
    classes_shown: int
    min_steps_per_epoch: int
    chance_factor: float
    one_class_share: float


TRAIN_PARTS = {
    "launch": TrainLaunch,
    "network": TrainNetwork,
    "batch": TrainBatch,
    "loaders": TrainLoaders,
    "optim": TrainOptim,
    "resolution": TrainResolution,
    "stops": TrainStops,
    "telemetry": TrainTelemetry,
}


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The train block, one frozen part per concern (the schema's `x-part`)."""

    launch: TrainLaunch
    network: TrainNetwork
    batch: TrainBatch
    loaders: TrainLoaders
    optim: TrainOptim
    resolution: TrainResolution
    stops: TrainStops
    telemetry: TrainTelemetry

    def as_dict(self) -> dict:
        """Every train key and its value, flat, as the block was configured."""
        flat: dict = {}
        for part in dataclasses.fields(self):
            flat.update(getattr(self, part.name).as_dict())
        return flat

    def replaced(self, **changes) -> TrainSettings:
        """A copy with some keys changed (flat names, as in the config), checked the same way."""
        unknown = sorted(set(changes) - set(self.as_dict()))
        if unknown:
            raise TypeError(f"unknown train key(s): {', '.join(unknown)}")
        return train({**self.as_dict(), **changes})


def train(values: dict) -> TrainSettings:
    """The completed train block as TrainSettings; a key no part declares is a TypeError naming it, and
    so is a declared one missing (the block was not completed from the schema)."""
    keys_of = {part: {f.name for f in dataclasses.fields(cls)} for part, cls in TRAIN_PARTS.items()}
    unknown = sorted(set(values) - set().union(*keys_of.values()))
    if unknown:
        raise TypeError(f"unknown train key(s): {', '.join(unknown)}")
    return TrainSettings(
        **{part: cls(**{k: values[k] for k in keys_of[part] if k in values}) for part, cls in TRAIN_PARTS.items()}
    )


BLOCKS = {
    "demo": DemoSettings,
    "index": IndexSettings,
    "pack": PackSettings,
    "recordio": RecordioSettings,
    "evaluate": EvaluateSettings,
    "check": CheckSettings,
    "recipe": RecipeSettings,
    "report": ReportSettings,
}


def view(block: str, values: dict):
    """The completed block `values` as its frozen view; a key the schema does not declare, or a
    declared one missing (the block was not completed from the schema), is a TypeError naming it."""
    if block == "train":
        return train(values)
    return BLOCKS[block](**values)


@dataclasses.dataclass(frozen=True)
class WholeSettings:
    """The whole config: the top-level scalars and every block's view, for the report, which reads
    several blocks and prints them all."""

    dataset: str
    run: str  # the run's name: its outputs in results/<dataset>/<run>/
    raw: str | None
    private: bool
    demo: DemoSettings
    index: IndexSettings
    pack: PackSettings
    recordio: RecordioSettings
    train: TrainSettings
    evaluate: EvaluateSettings
    check: CheckSettings
    recipe: RecipeSettings
    report: ReportSettings
    # The keys' order as completed: as_dict() gives the config back as it was (the report prints it)
    key_order: tuple = dataclasses.field(default=(), repr=False, compare=False)

    def as_dict(self) -> dict:
        """The whole config, nested, its keys in the order it was completed in (a copy of each block)."""
        config: dict = {}
        for key, block_keys in self.key_order:
            value = getattr(self, key)
            if block_keys is None:
                config[key] = value
            else:
                flat = value.as_dict()
                config[key] = {k: flat[k] for k in block_keys}
        return config


# Every block by nature: the report's one view of the config it prints and reads several blocks of.
def whole(config: dict) -> WholeSettings:
    """The completed whole config (rectrain.config.complete_config) as its frozen view: `.dataset`,
    `.report`, `.recipe`, `.train` (TrainSettings), ..."""
    values = {key: view(key, value) if isinstance(value, dict) else value for key, value in config.items()}
    order = tuple((key, tuple(value) if isinstance(value, dict) else None) for key, value in config.items())
    return WholeSettings(**values, key_order=order)
