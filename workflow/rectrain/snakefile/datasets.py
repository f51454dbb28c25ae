"""The dataset a config names, checked while the Snakefile parses: outputs live under
results/<dataset>/, so two datasets must never share a name (no stage imports this module)."""

from __future__ import annotations

from rectrain.config import ConfigError, format_problems

# The schema's default name, and the generated demo's (raw: null).
DEMO_DATASET = "demo"


def refuse_demo_name_for_own_data(dataset: str, raw: str | None) -> None:
    """A config with a raw root of its own but no dataset name would write under results/demo/ (the
    schema's default name), replacing the generated demo's outputs: refused, naming the fix."""
    if raw is not None and dataset == DEMO_DATASET:
        raise ConfigError(
            format_problems(
                [
                    f"config key 'dataset' = 'demo' with raw = {raw!r}: 'demo' is the generated demo's "
                    "name, and its outputs under results/demo/ would be replaced by your data's. Name your dataset "
                    "(e.g. dataset: mydata): its outputs go to results/<dataset>/"
                ]
            )
        )
