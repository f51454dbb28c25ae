"""rectrain.settings: a stage's completed block as a frozen view, every key declared once in the schema."""

import dataclasses

import pytest

from rectrain import settings
from rectrain.config import SCHEMA_PATH, load_schema, stage_block


def test_every_train_key_belongs_to_exactly_one_part_and_as_dict_gives_the_block_back():
    block = stage_block("train", '{"lr": 0.2, "epochs": 3}')
    view = settings.train(block)
    assert view.as_dict() == block
    keys = [f.name for part in dataclasses.fields(view) for f in dataclasses.fields(getattr(view, part.name))]
    assert sorted(keys) == sorted(load_schema(SCHEMA_PATH)["properties"]["train"]["properties"])
    assert view.optim.lr == 0.2 and view.optim.epochs == 3


def test_a_view_is_frozen_and_a_changed_copy_leaves_it_as_it_was():
    view = settings.train(stage_block("train", "{}"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.optim.lr = 1.0
    changed = view.replaced(lr=0.5)
    assert changed.optim.lr == 0.5 and view.optim.lr == 0.1


def test_an_unknown_or_missing_key_is_refused_naming_it():
    block = stage_block("pack", "{}")
    with pytest.raises(TypeError, match="resizing"):
        settings.view("pack", {**block, "resizing": 1})
    with pytest.raises(TypeError, match="unknown train key.*learning_rate"):
        settings.train({**stage_block("train", "{}"), "learning_rate": 1})
    with pytest.raises(TypeError, match="quality"):
        settings.view("pack", {k: v for k, v in block.items() if k != "quality"})


def schema_type(spec: dict) -> str:
    """The annotation rectrain.settings declares for a key of this schema entry (its types, null last)."""
    py = {"integer": "int", "number": "float", "boolean": "bool", "string": "str", "array": "list", "object": "dict"}
    names = spec.get("type") or [t for alt in spec.get("oneOf", []) for t in [alt.get("type")]]
    names = names if isinstance(names, list) else [names]
    flat = [n for name in names for n in (name if isinstance(name, list) else [name])]
    types = list(dict.fromkeys(py[n] for n in flat if n in py))
    return " | ".join(types + (["None"] if "null" in flat else []))


def declared(cls) -> list[tuple[str, str]]:
    return [(f.name, f.type) for f in dataclasses.fields(cls)]


def test_every_part_and_block_declares_its_schema_keys_in_order_with_the_schemas_types():
    """Issue 48 item 2: typed views, and the schema still the one source of keys, defaults and docs."""
    schema = load_schema(SCHEMA_PATH)["properties"]
    train = schema["train"]["properties"]
    for part, cls in settings.TRAIN_PARTS.items():
        want = [(k, schema_type(spec)) for k, spec in train.items() if spec["x-part"] == part]
        assert declared(cls) == want, f"settings.{cls.__name__} against the schema's x-part {part} keys"
    assert [f.name for f in dataclasses.fields(settings.TrainSettings)] == list(settings.TRAIN_PARTS)
    for block, cls in settings.BLOCKS.items():
        want = [(k, schema_type(spec)) for k, spec in schema[block]["properties"].items()]
        assert declared(cls) == want, f"settings.{cls.__name__} against the schema's {block} block"
    whole = [f.name for f in dataclasses.fields(settings.WholeSettings) if f.name != "key_order"]
    assert whole == list(schema)
