"""Many runs of one dataset side by side: a sweep file expanded into named runs, each a whole config.

A sweep is a config file given with --configfile (config/sweeps/backbones.yaml, docs/runs.md):

    base:                      # optional: merged over the config first, for every run
      train: {epochs: 1}
    runs:                      # named runs, each an overlay over base
      rn18: {train: {model: resnet18}}
      tiny: {train: {model: "timm:resnet10t"}}
    grid:                      # optional: every combination, each a run named after its values
      train.lr: [0.1, 0.2]

A grid run is named `<key>-<value>_...` (the last part of each key, e.g. `lr-0.1`); with `runs:` too,
the grid is crossed with every named run (`rn18_lr-0.1`).  Snakemake merges the file into the config
like any other, so its callers take the sweep's keys (SWEEP_KEYS) out of it first (the schema knows
none of them); `overlays` gives what each run merges over the config, {run name: overlay}, and the
caller merges and checks each run's whole config.  A run's overlay may
touch only the per-run blocks (RUN_BLOCKS): the index and the pack are the dataset's, shared by
every run.  Without a sweep there is one run, named by the config's `run` key (default main).

Torch-free: the Snakefile imports it while it parses.
"""

from __future__ import annotations

import copy
import itertools
import re

from rectrain.config import ConfigError

# The sweep's own keys at the top of the merged config.
SWEEP_KEYS = ("base", "runs", "grid")
# What a run may set: its name, its training, its evaluation and its report's thresholds.
RUN_BLOCKS = ("run", "train", "evaluate", "report", "recipe")
# A run's name: a folder and a wildcard value (the schema's `run` pattern).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Folders of results/<dataset>/ that are the dataset's, not a run's: no run may take their name.
DATASET_FOLDERS = ("index", "pack", "check", "raw", "train", "eval", "compare.html", "report.html", "live.html")


def merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, nested blocks key by key (Snakemake's own merge)."""
    from snakemake.utils import update_config

    merged = copy.deepcopy(base)
    update_config(merged, copy.deepcopy(over))
    return merged


def _refuse_shared_keys(where: str, overlay: dict) -> None:
    shared = sorted(k for k in overlay if k not in RUN_BLOCKS)
    if shared:
        raise ConfigError(
            f"sweep {where} sets {', '.join(shared)}: a run may set only {', '.join(RUN_BLOCKS)} - the dataset, "
            "its index and its pack are shared by every run; put those keys at the top of the sweep file"
        )


def _value_words(value) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(value)).strip("-") or "x"


def grid_runs(grid: dict) -> dict[str, dict]:
    """{name: overlay} for every combination of `grid` ({"train.lr": [0.1, 0.2], ...}: dotted keys)."""
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError("sweep grid: expected {dotted.key: [value, ...]}, e.g. {train.lr: [0.1, 0.2]}")
    runs = {}
    for values in itertools.product(*grid.values()):
        overlay: dict = {}
        for dotted, value in zip(grid, values, strict=True):
            *blocks, key = dotted.split(".")
            node = overlay
            for block in blocks:
                node = node.setdefault(block, {})
            node[key] = value
        name = "_".join(
            f"{dotted.rsplit('.', 1)[-1]}-{_value_words(v)}" for dotted, v in zip(grid, values, strict=True)
        )
        runs[name] = overlay
    return runs


def check_name(name: str, where: str) -> None:
    """ConfigError when `name` cannot be a run's folder (NAME) or is one of the dataset's folders."""
    if not isinstance(name, str) or not NAME.match(name) or name in DATASET_FOLDERS:
        raise ConfigError(
            f"{where}: run name {name!r} cannot name a run's folder results/<dataset>/<run>/: use letters, digits, "
            f"_ . - (starting with a letter or digit), and none of {', '.join(DATASET_FOLDERS)}"
        )


def overlays(sweep: dict, name: str = "main") -> dict[str, dict]:
    """{run name: what to merge over the config for it}: base, then the run's overlay, then its name.
    No sweep: the one run `name` (the config's `run`), nothing merged."""
    if not sweep:
        check_name(name, "config key 'run'")
        return {name: {}}
    base = sweep.get("base") or {}
    _refuse_shared_keys("base", base)
    named = sweep.get("runs") or {}
    if not isinstance(named, dict):
        raise ConfigError("sweep runs: expected {run name: {train: {...}}, ...}")
    grid = grid_runs(sweep["grid"]) if sweep.get("grid") else {}
    if named and grid:
        each = {f"{n}_{g}": merge(o or {}, go) for n, o in named.items() for g, go in grid.items()}
    else:
        each = {n: o or {} for n, o in {**named, **grid}.items()}
    if not each:
        raise ConfigError("sweep: neither runs: nor grid: names a run; add runs: {name: {train: {...}}}")
    found = {}
    for run, overlay in each.items():
        check_name(run, f"sweep run {run!r}")
        _refuse_shared_keys(f"run {run!r}", overlay)
        found[run] = merge(merge(base, overlay), {"run": run})
    return found


def wildcard_pattern(names) -> str:
    """The `run` wildcard's constraint: exactly the sweep's names, so no other folder under
    results/<dataset>/ (index, pack, ...) is ever read as a run."""
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
