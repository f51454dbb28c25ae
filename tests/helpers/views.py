"""A stage block's frozen view (rectrain.settings) from the keys a test sets, the rest the schema's
defaults: what a stage's entry point hands the functions below it."""

import copy

from rectrain import settings
from rectrain.config import complete_config, stage_block


def view(block: str, values: dict | None = None, **changes):
    """The `block` view of the schema's defaults updated with `values` and then `changes`."""
    return settings.view(block, {**stage_block(block, "{}"), **(values or {}), **changes})


def whole(config: dict):
    """The whole-config view (rectrain.settings.whole) of `config` completed from the schema, as the
    report's entry point builds it from its --config-json; `config` itself is left as it was."""
    return settings.whole(complete_config(copy.deepcopy(config)))


def cross_check_of(config: dict) -> list[str]:
    """rectrain.snakefile.checks.cross_check of a completed `config`, handed its blocks and train parts
    as check_config hands them."""
    from rectrain.snakefile.checks import cross_check

    blocks = settings.whole(config)
    train = blocks.train
    return cross_check(
        blocks.pack,
        blocks.evaluate,
        blocks.check,
        train.resolution,
        model=train.model.model,
        batch=train.batch,
        launch=train.launch,
    )
