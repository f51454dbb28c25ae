"""The rules' `params:`: each block's values that change its stage's output, as canonical JSON.

Snakemake reruns a job whose params changed, so a rule's params carry exactly the keys whose edit must
rerun it (rectrain.config.output_part: the schema's keys not marked `x-rerun: false`), and nothing
else - no operational value, not even through a function (Snakemake 9 compares those too).
"""

from __future__ import annotations

import json

from rectrain.config import output_part


def block_params(block: str, values: dict) -> str:
    """The `params: cfg` of the rule that runs `block`'s stage, from that block's `values`."""
    return json.dumps(output_part(block, values), sort_keys=True)


# Every block by nature: the report prints the whole config, so its params hold each block's output part.
def report_params(config: dict) -> str:
    """The report's params: every block's output part (it prints the config and takes its thresholds
    from `report`), so a finished run's report reruns for a real change anywhere and for no operational one.
    The check block is left out: the check runs only when asked for, and reaches the report through its
    report.json (an input once it exists), so editing check.* reruns the check alone."""
    return json.dumps(
        {name: output_part(name, v) if isinstance(v, dict) else v for name, v in config.items() if name != "check"},
        sort_keys=True,
    )


def index_classes_file(classes) -> list[str]:
    """index.classes (`classes`) when it names a file (not a list, not a subset shipped with rectrain):
    an input of index_raw, so editing the file re-indexes as editing the list in the config does."""
    from rectrain.config import expand_path
    from rectrain.data.subset import shipped

    if not isinstance(classes, str) or classes in shipped():
        return []
    return [expand_path(classes, "index.classes")]
