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


def report_html(data, config: dict, **kwargs) -> str:
    """rectrain.report.build's page for `config` completed from the schema, handed what the report's
    entry point hands it: the blocks it reads, the dataset's name, the whole config to show."""
    from rectrain.report.build import build

    shown = whole(config)
    return build(
        data,
        shown.report,
        recipe=shown.recipe,
        index=shown.index,
        dataset=shown.dataset,
        shown=shown.as_dict(),
        **kwargs,
    )
