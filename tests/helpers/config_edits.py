"""Edits of one config key at a time, derived from config/schema.yaml: for the rerun tests, which must
cover every key the schema has (a key added later is covered without touching the tests)."""

import yaml

from rectrain.config import SCHEMA_PATH, fill_defaults, load_schema

# Keys whose generic edit would be refused by a cross-field check, or would mean something else
# than "this key changed" (a list value, a path, a model name): the values used instead, the first
# that differs from the current one.
EXPLICIT = {
    ("train", "devices"): ["cpu", "auto"],
    ("train", "workers"): [1, 2],
    ("train", "batch_size"): [16, 8],
    ("train", "model"): ["resnet34", "resnet18"],
    ("train", "model_args"): [{"groups": 1}, {}],
    ("train", "init_weights"): ["torchvision:ResNet18_Weights.IMAGENET1K_V1", None],
    # a branch from a checkpoint that exists in a finished demo run (a missing one is refused while parsing)
    ("train", "resume_from"): ["results/demo/main/train/checkpoints/last.pt", None],
    ("train", "clip_grad_norm"): [1.0, None],
    ("train", "dali_preallocate"): [[64, 64], [0, 0]],
    ("train", "weight_decay"): [1.0e-4, 5.0e-5],
    ("train", "lr_step_epochs"): [[20, 40], [30, 60, 80]],
    ("train", "stop_signals"): [["SIGTERM", "SIGUSR1"], ["SIGTERM"]],
    ("train", "progressive"): [{"min_res": 32, "max_res": 64, "start_ramp": 0, "end_ramp": 1}, None],
    ("train", "augment"): [{"policy": "rand-m9-mstd0.5-inc1"}, {"policy": "none"}],
    ("train", "mixup"): [{"mixup_alpha": 0.2, "cutmix_alpha": 1.0}, {"mixup_alpha": 0, "cutmix_alpha": 0}],
    ("train", "ema"): [{"decay": 0.99, "warmup": True}, {"decay": 0}],
    ("train", "bce_target_threshold"): [0.2, None],
    ("train", "betas"): [[0.9, 0.99], None],
    ("train", "eps"): [1.0e-6, None],
    ("train", "layer_decay"): [0.75, None],
    ("evaluate", "resize"): [80, 96],
    ("evaluate", "crop"): [48, 56],
    ("evaluate", "resolutions"): [[80, None], [None]],
    ("evaluate", "workers"): [1, 2],
    ("pack", "resize"): [80, 96],
    ("pack", "fast_storage"): ["results/fast_storage_b", "results/fast_storage_c"],
    ("index", "absent_splits"): [["val"], []],
    ("index", "classes"): [["n01440764", "n01443537"], None],  # two of the demo's classes
    ("index", "allow_outside_root"): [["/tmp/rectrain-linked-label-file.txt"], []],
    ("recipe", "published_top1"): [0.772, 0.738],
    ("check", "weights"): ["torchvision:ResNet18_Weights.IMAGENET1K_V1", None],
    ("recipe", "reference_minutes"): [35.6, 14.9],
}


def filled(*config_paths) -> dict:
    """Config files merged in order as `--configfile a b` merges them (Snakemake's update_config: nested
    blocks key by key, a later file's value wins), with the schema's defaults filled in, as the
    Snakefile sees them."""
    from snakemake.utils import update_config

    config: dict = {}
    for path in config_paths:
        update_config(config, yaml.safe_load(open(path)))
    return fill_defaults(config)


def block_keys():
    """(block, key, its schema, operational?) for every key of every block."""
    for block, spec in load_schema(SCHEMA_PATH)["properties"].items():
        for key, sub in spec.get("properties", {}).items():
            yield block, key, sub, sub.get("x-rerun") is False


def another_value(block: str, key: str, spec: dict, current):
    """A valid value of the key other than `current`."""
    if (block, key) in EXPLICIT:
        return next(v for v in EXPLICIT[(block, key)] if v != current)
    if "enum" in spec:
        return next(v for v in spec["enum"] if v != current)
    if isinstance(current, bool):
        return not current
    if isinstance(current, int):
        return current + 1 if current + 1 <= spec.get("maximum", current + 1) else current - 1
    if isinstance(current, float):
        half = current / 2 if current > 0 else 0.5
        # a key with a floor (report.chance_factor >= 1) goes up instead
        return half if half >= spec.get("minimum", half) else min(current * 2, spec.get("maximum", current * 2))
    if current is None:
        types = spec["type"] if isinstance(spec.get("type"), list) else [spec.get("type")]
        return 64 if "integer" in types else "/tmp/rectrain-edited"
    if isinstance(current, str):
        return current + " (edited)"
    raise AssertionError(f"no edit for {block}.{key} = {current!r} ({spec})")
