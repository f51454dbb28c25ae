# rectrain: raw ImageNet -> RecordIO on fast storage -> DDP training fed by DALI -> evaluation -> report.
#
#   snakemake --cores 8 results/report.html    # the whole chain, or only what is out of date
#   snakemake --cores 8 results/demo/compare.html --configfile config/sweeps/backbones.yaml   # many runs
#   snakemake -n                               # dry-run: what would run, and why
#
# Each stage reads only its own config block (params:), so editing train.* reruns training and what
# follows it, nothing before.
from pathlib import Path

from snakemake.utils import min_version

min_version("9.11")


# config/config.yaml is the generated demo's config (its size and its short progress intervals and
# calibration): read only when no --configfile or --config names a raw dataset, and then merged under
# them. Your own dataset's config starts from the schema's defaults (config/schema.yaml), not the demo's.
# Found from any working directory (--directory).
if config.get("raw") is None:

    configfile: Path(workflow.basedir) / "config" / "config.yaml"


# `snakemake --report report.zip`: this text, plus the outputs marked report(...) in the rules.
report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/demo.smk"


if BYO:  # recordio.train: an existing .rec/.idx is checked instead of indexing and packing raw images

    include: "workflow/rules/recordio.smk"

else:

    include: "workflow/rules/index.smk"
    include: "workflow/rules/pack.smk"


include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/check.smk"


# The configured run's report, or with a sweep (docs/runs.md) the comparison of its runs;
# `snakemake results/report.html` also copies the configured run's report to results/report.html.
rule all:
    """Build the whole chain for the configured dataset: the report (a sweep: every run's, and compare.html)."""
    default_target: True
    input:
        rules.compare.output if SWEEP else expand(rules.report.output[0], run=RUN),
