# Shared set-up for every stage: config validation, names and paths all rules agree on.
import json
import os
import shlex
import sys
from pathlib import Path

# The package the rules call lives in workflow/; importable here even when not pip-installed.
sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))

from rectrain.config import ConfigError
from rectrain.driver_check import DEVICES_ENV
from rectrain.snakefile.checks import check_config
from rectrain.snakefile.datasets import refuse_demo_name_for_own_data
from rectrain.snakefile.hooks import on_start, on_success, watch as watch_run
from rectrain.snakefile.jobenv import export_operational, prepare_job_env
from rectrain.snakefile.modelcheck import PASSED, check_model
from rectrain.snakefile.params import block_params, index_classes_file, report_params
from rectrain.snakefile.prestart import before_jobs
from rectrain.snakefile.resources import run_slots, scheduled_gpus, train_rule_resources, train_threads
from rectrain.snakefile.runlayout import legacy_layout_line
from rectrain.snakefile.sweep import SWEEP_KEYS, merge as merge_config, overlays as run_overlays, wildcard_pattern
from rectrain.private import apply as apply_private
from rectrain.settings import train as train_view
from rectrain.sources import stage_sources
from rectrain.modelspec import TORCHVISION_WEIGHTS, sources as model_sources

prepare_job_env(Path(workflow.basedir) / "workflow")

# The config read once: check_config validates and completes it as a whole; the other checks and the
# onstart hook get only the values, blocks or train parts (rectrain.settings views) they read.
# A sweep file (--configfile config/sweeps/<name>.yaml: base, runs, grid; docs/runs.md) is taken out
# of the config first and expanded into RUNS, {run name: its whole config}, each checked as a config
# is; without one, RUNS holds the one run the config names (run: main by default).
SWEEP = {key: config.pop(key) for key in SWEEP_KEYS if key in config}
try:
    check_config(config, Path(workflow.basedir) / "config" / "schema.yaml")
    refuse_demo_name_for_own_data(config["dataset"], config["raw"])
    RUNS = {
        name: (
            check_config(merge_config(config, overlay), Path(workflow.basedir) / "config" / "schema.yaml")
            if SWEEP
            else config
        )
        for name, overlay in run_overlays(SWEEP, config["run"]).items()
    }
    TRAINS = {name: train_view(given["train"]) for name, given in RUNS.items()}
    for name, view in TRAINS.items():
        check_model(
            view.network,
            view.resolution.image_size,
            f"results/{config['dataset']}/index/classes.tsv",
            PASSED,
        )
except ConfigError as err:
    raise WorkflowError(str(err)) from None
# The configured run: results/report.html copies its report (the sweep's first run when it names none of its runs).
RUN = config["run"] if config["run"] in RUNS else next(iter(RUNS))

# The run's end, whatever ran (rectrain.snakefile.hooks): the live report made again, each failed job's
# cause, a run at chance's line and exit status, the report's path - the console's last lines.
watch_run(workflow, RUNS)


# Once the jobs are planned and before the first starts (nothing removed yet): each scheduled run's
# train.devices against this machine's GPUs when the jobs run here, and whether Snakemake forced a train job.
onstart:
    before_jobs(workflow, {name: (v.launch, v.batch, v.network.precision) for name, v in TRAINS.items()})
    # the jobs' console lines on Snakemake's console, terminal or not; SIGINT/SIGTERM stop training cleanly
    on_start(workflow, {name: f"{run_dir(name)}/train/checkpoints" for name in RUNS})


# The run's last line: the report it wrote.
onsuccess:
    on_success()


# Operational keys (x-rerun: false in the schema: intervals, timeouts, thread and worker counts, ...)
# reach the jobs through the environment, not params: editing one reruns nothing. A run's own reach
# its jobs by the run's name (the rules set RECTRAIN_RUN).
export_operational(config, RUNS)

# For the index rule's driver check: an environment variable, not a param, so that changing
# train.devices does not re-index and repack.
os.environ[DEVICES_ENV] = json.dumps(config["train"]["devices"])

DS = config["dataset"]
# results/<dataset>/<run>/: one run's training, evaluation, weights and report; the {run} wildcard
# takes only the names in RUNS, so the dataset's own folders (index, pack, ...) are never a run.
RUN_DIR = f"results/{DS}/{{run}}"


wildcard_constraints:
    run=wildcard_pattern(RUNS),


def run_dir(name):
    """results/<dataset>/<name>: the run's folder."""
    return f"results/{DS}/{name}"


def run_train(wildcards):
    """The train block of the job's run (its wildcard)."""
    return RUNS[wildcards.run]["train"]


# An existing results/<dataset>/train of a version before runs had names: said once, and moved nowhere.
legacy_layout_line(DS, RUN)
# A generated demo set belongs to its dataset: two configs never regenerate each other's images.
DEMO_ROOT = f"results/{DS}/raw"
RAW_ROOT = config["raw"] or DEMO_ROOT
# Where the .rec/.idx pairs live: the user's SSD, per dataset.
FAST = f"{config['pack']['fast_storage'].rstrip('/')}/{DS}"
# index.absent_splits: [val] - a dataset without a val split packs and trains on train alone; there is
# nothing to evaluate, so the report is built without the evaluate stage and says so.
# recordio.train set (bring your own .rec): check_recordio replaces index_raw and pack, and val is there
# when recordio.val is.
BYO = config["recordio"]["train"] is not None
HAS_VAL = config["recordio"]["val"] is not None if BYO else "val" not in config["index"]["absent_splits"]
# private: true - every job's outputs owner-only, and the existing output folders closed (rectrain.private).
apply_private(config["private"], ["results", "logs", "benchmarks", ".snakemake", FAST])
SPLITS = ["train", "val"] if HAS_VAL else ["train"]
ENV = "../../envs/rectrain.yaml"


# A rule's params: carry only its own block's output-changing keys (rectrain.snakefile.params), so a
# change there reruns that rule and its dependents, and an operational edit reruns nothing.
def cfg_json(block):
    """The `params: cfg` of the rule that runs `block`'s stage."""
    return block_params(block, config[block])


def code(stage):
    """The stage's source files (its import closure): editing one reruns that stage and what follows."""
    return [str(p) for p in stage_sources(stage, Path(workflow.basedir) / "workflow" / "rectrain")]


def init_weights_input(wildcards):
    """{"init_weights": path} when the run's train.init_weights names a file (not torchvision:...), and
    {"resume_from": path} when its train.resume_from names a checkpoint, else {}: replacing one reruns the run."""
    value, found = run_train(wildcards)["init_weights"], {}
    if value is not None and not value.startswith(TORCHVISION_WEIGHTS):
        found["init_weights"] = value
    if run_train(wildcards)["resume_from"] is not None:
        found["resume_from"] = run_train(wildcards)["resume_from"]
    return found


def check_weights_input(value):
    """{"weights": path} when check.weights names a file (not torchvision:...), else {}: replacing the
    file reruns the check."""
    return {} if value is None or value.startswith(TORCHVISION_WEIGHTS) else {"weights": value}


def check_report_input(wildcards):
    """The check's report.json for the report, only once the check has run (and check.weights is set, so
    an unset block never asks for a check): the report never runs the check itself."""
    path = f"results/{DS}/check/report.json"
    return [path] if config["check"]["weights"] is not None and os.path.exists(path) else []


def all_cores(wildcards):
    """Every core given with --cores (Snakemake also caps threads at --max-threads). Read when a job
    is expanded, not when the rules are parsed, so commands that run no job (--unlock, --summary,
    --dag) need no --cores; --report, which lists each job's threads, gets this machine's count."""
    return workflow.resource_settings.cores or os.cpu_count()


def val_pair(wildcards):
    """The val .rec/.idx; asking for evaluate on a dataset without val says why it cannot run."""
    if not HAS_VAL:
        raise WorkflowError(
            "evaluate: this dataset has no val split (index.absent_splits lists val), so there is nothing to "
            "evaluate on; the report is built without it. Remove val from index.absent_splits once a val split exists."
        )
    return {"rec": f"{FAST}/val.rec", "idx": f"{FAST}/val.idx"}
