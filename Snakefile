# rectrain: raw ImageNet -> RecordIO on fast storage -> DDP training fed by DALI -> evaluation -> report.
#
#   snakemake --cores 8 results/report.html    # the whole chain, or only what is out of date
#   snakemake -n                               # dry-run: what would run, and why
#
# Each stage reads only its own config block (params:), so editing train.* reruns training and what
# follows it, nothing before.
from pathlib import Path

from snakemake.utils import min_version

min_version("9.11")


# Found from any working directory (--directory); --configfile files are merged over it.
configfile: Path(workflow.basedir) / "config" / "config.yaml"


# `snakemake --report report.zip`: this text, plus the outputs marked report(...) in the rules.
report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/demo.smk"
include: "workflow/rules/index.smk"
include: "workflow/rules/pack.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    """Build the whole chain for the configured dataset: the report and everything it needs."""
    default_target: True
    input:
        "results/report.html",
