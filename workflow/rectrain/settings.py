"""Each stage's config block as one frozen, typed view, built once at the stage's entry point.

The names, types and defaults stay declared once, in config/schema.yaml: this module only shapes a
completed block (rectrain.config.stage_block) into attribute access, so a misspelt key fails at its
first use, naming it, and no function below an entry point receives - or can alter - the raw dict.

Training's block is split by concern: each train key's `x-part` in the schema names its part, and a
module receives only the part it uses (`train.optim` for the optimizer and schedule, `train.loaders`
for the loaders and decoding, ...). `as_dict()` gives the whole block back, flat, for what records
it as a whole: run.json, the checkpoint's identity (rectrain.config.output_part), the failure line.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from rectrain.config import SCHEMA_PATH, load_schema

# JSON Schema type -> the Python type a completed block holds (annotations only: the schema validated it)
_PY_TYPES = {"integer": int, "number": float, "boolean": bool, "string": str, "array": list, "object": dict}


def _annotation(spec: dict) -> Any:
    """The key's type as written in the schema (`type`, or each `oneOf` alternative's), for readers and
    editors; dataclasses do not enforce it."""
    names = spec.get("type") or [t for alt in spec.get("oneOf", []) for t in _as_list(alt.get("type"))]
    types = [_PY_TYPES[n] for n in _as_list(names) if n in _PY_TYPES]
    nullable = "null" in _as_list(names)
    annotation = " | ".join(t.__name__ for t in dict.fromkeys(types)) or "Any"
    return annotation + (" | None" if nullable else "")


def _as_list(value) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _block_properties(block: str) -> dict:
    return load_schema(SCHEMA_PATH)["properties"][block]["properties"]


def _view_class(name: str, keys: dict) -> type:
    fields = [(key, _annotation(spec)) for key, spec in keys.items()]
    return dataclasses.make_dataclass(name, fields, frozen=True, namespace={"as_dict": _flat_dict})


def _flat_dict(self) -> dict:
    """The view's keys and values as a plain dict (a copy: editing it changes nothing here)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@functools.lru_cache(maxsize=None)
def block_class(block: str) -> type:
    """The frozen view class of a flat block (pack, evaluate, ...): one field per schema key."""
    return _view_class(f"{block.capitalize()}Settings", _block_properties(block))


def view(block: str, values: dict):
    """The completed block `values` as its frozen view; a key the schema does not declare, or a
    declared one missing (the block was not completed from the schema), is a TypeError naming it."""
    if block == "train":
        return train(values)
    return block_class(block)(**values)


@functools.lru_cache(maxsize=None)
def train_part_classes() -> dict[str, type]:
    """Part name -> its frozen view class, from each train key's `x-part` in the schema."""
    by_part: dict[str, dict] = {}
    for key, spec in _block_properties("train").items():
        by_part.setdefault(spec["x-part"], {})[key] = spec
    return {part: _view_class(f"Train{part.capitalize()}", keys) for part, keys in by_part.items()}


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The train block, one frozen part per concern (the schema's `x-part`)."""

    launch: Any
    model: Any
    batch: Any
    loaders: Any
    optim: Any
    resolution: Any
    stops: Any
    telemetry: Any

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
    """The completed train block as TrainSettings."""
    classes = train_part_classes()
    keys_of = {part: {f.name for f in dataclasses.fields(cls)} for part, cls in classes.items()}
    unknown = sorted(set(values) - set().union(*keys_of.values()))
    if unknown:
        raise TypeError(f"unknown train key(s): {', '.join(unknown)}")
    return TrainSettings(
        **{part: cls(**{k: values[k] for k in keys_of[part] if k in values}) for part, cls in classes.items()}
    )


# The flat blocks' view classes by name, for annotations (`pack: PackSettings`) and isinstance checks.
DemoSettings = block_class("demo")
IndexSettings = block_class("index")
PackSettings = block_class("pack")
RecordioSettings = block_class("recordio")
EvaluateSettings = block_class("evaluate")
CheckSettings = block_class("check")
RecipeSettings = block_class("recipe")
ReportSettings = block_class("report")

# The train block's parts by name, for annotations (`batch: TrainBatch`).
TrainLaunch = train_part_classes()["launch"]
TrainModel = train_part_classes()["model"]
TrainBatch = train_part_classes()["batch"]
TrainLoaders = train_part_classes()["loaders"]
TrainOptim = train_part_classes()["optim"]
TrainResolution = train_part_classes()["resolution"]
TrainStops = train_part_classes()["stops"]
TrainTelemetry = train_part_classes()["telemetry"]


def _is_block(spec: dict) -> bool:
    return spec.get("type") == "object" and "properties" in spec


@functools.lru_cache(maxsize=None)
def whole_class() -> type:
    """The frozen view class of the whole config: one field per top-level schema key, a block's field
    holding its view (TrainSettings for train), a scalar (dataset, raw, private) its value."""
    top = load_schema(SCHEMA_PATH)["properties"]
    fields: list = [(key, "TrainSettings" if key == "train" else _annotation(spec)) for key, spec in top.items()]
    # The keys' order as completed: as_dict() gives the config back as it was (the report prints it)
    fields.append(("key_order", tuple, dataclasses.field(default=(), repr=False, compare=False)))
    return dataclasses.make_dataclass("WholeSettings", fields, frozen=True, namespace={"as_dict": _whole_dict})


# Every block by nature: the report's one view of the config it prints and reads several blocks of.
def whole(config: dict):
    """The completed whole config (rectrain.config.complete_config) as its frozen view: `.dataset`,
    `.report`, `.recipe`, `.train` (TrainSettings), ... - for the report, which reads several blocks
    and shows them all."""
    top = load_schema(SCHEMA_PATH)["properties"]
    values = {
        key: view(key, value) if isinstance(value, dict) and _is_block(top.get(key, {})) else value
        for key, value in config.items()
    }
    order = tuple((key, tuple(value) if isinstance(value, dict) else None) for key, value in config.items())
    return whole_class()(**values, key_order=order)


def _whole_dict(self) -> dict:
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


WholeSettings = whole_class()  # by name, for annotations (`config: WholeSettings`)
