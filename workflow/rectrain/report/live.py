"""The report of a run that is still training, stopped or killed: results/<dataset>/<run>/live.html.

    make live CONFIG=config/my-data.yaml     # or: python -m rectrain.report.live --configfile config/my-data.yaml

The final report's page (rectrain.report.build) from what the run has written so far - the live
telemetry under results/<ds>/<run>/train/telemetry/ (complete lines only: a row may be half-written), its
copy of run.json (Snakemake removes the published one with a stopped or failed job's outputs), the
checkpoints' markers and the stages before training - with a banner on where the run stands
(rectrain.report.inprogress). No Snakemake rule: it runs while Snakemake holds its lock, reads only,
and writes live.html alone (atomically), never an output of the pipeline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from pathlib import Path

import pandas as pd

from rectrain import atomic, cli, config, settings
from rectrain.config import ConfigError
from rectrain.report import build, inprogress
from rectrain.report.inputs import RunData, load_upstream, read_complete_csv, stage_paths
from rectrain.snakefile import sweep
from rectrain.train.telemetry import EPOCH_COLUMNS, LIVE_RUN_JSON, STEP_COLUMNS, SYSTEM_BASE_COLUMNS

logger = logging.getLogger(__name__)

PAGE = "live.html"


class NotStarted(RuntimeError):
    """No run to report on yet."""


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--configfile",
        nargs="*",
        default=[],
        help="the config file(s) the run was started with (make run CONFIG=...; a sweep file: each of its runs); none: the demo",
    )
    ap.add_argument("--run", help="the run to report on (a sweep's run name); default: every run that has started")


def run_json(train_dir: Path) -> dict:
    """run.json as published, else its live copy in telemetry/ (LIVE_RUN_JSON): Snakemake removes a
    stopped or failed job's outputs, run.json among them, and the copy is what survives."""
    for path in (train_dir / "run.json", train_dir / "telemetry" / LIVE_RUN_JSON):
        with contextlib.suppress(FileNotFoundError):
            return json.loads(path.read_text())
    raise NotStarted(
        f"{train_dir / 'run.json'} is missing, and its live copy in telemetry/ too: no training has started yet, "
        "or it is still preparing (calibration); start one with make run, or try again in a minute"
    )


def live_steps(telemetry: Path) -> list:
    """Every rank's step log (steps_rank<r>.csv), complete lines only, in rank order."""
    logs = sorted(telemetry.glob("steps_rank*.csv"), key=lambda p: int(p.stem.removeprefix("steps_rank") or 0))
    return [read_complete_csv(p, STEP_COLUMNS) for p in logs]


def runs_from_files(paths: list) -> dict[str, dict]:
    """{run name: its whole config, completed} of `snakemake --configfile <paths>`: a sweep file's runs
    (rectrain.snakefile.sweep), or the one run the config names."""
    given = config.merged_files(paths)
    found = {key: given.pop(key) for key in sweep.SWEEP_KEYS if key in given}
    overlays = sweep.overlays(found, given.get("run", "main"))
    return {name: config.complete_config(sweep.merge(given, overlay)) for name, overlay in overlays.items()}


def load_live(results: Path, benchmarks: Path, dataset: str, name: str = "main") -> RunData:
    """The run `name` as far as it got: the live telemetry, run.json, and the stages before training."""
    train = results / name / "train"
    telemetry = train / "telemetry"
    run = run_json(train)
    up = load_upstream(results / "pack", results / "index", [benchmarks], dataset)
    ranks = [s for s in live_steps(telemetry) if not s.empty]
    return RunData(
        steps=pd.concat(ranks, ignore_index=True) if ranks else pd.DataFrame(columns=STEP_COLUMNS),
        system=read_complete_csv(telemetry / "system_node0.csv", SYSTEM_BASE_COLUMNS),
        epochs=read_complete_csv(telemetry / "epochs.csv", EPOCH_COLUMNS),
        run=run,
        metrics={},  # the evaluate stage runs after training
        per_class=pd.DataFrame(),
        manifests=up.manifests,
        classes=up.classes,
        benchmarks=up.benchmarks,
        # an eval folder when there is a val split: the page says evaluation comes, not that there is none
        paths=stage_paths(
            train, results / name / "eval" if "val" in up.manifests else None, results / "pack", results / "index"
        ),
        image_sizes=up.image_sizes,
    )


def _run(args: argparse.Namespace, cfg: None) -> None:
    """Each run of the config (a sweep's every run that has started; --run: that one) as far as it got:
    results/<dataset>/<run>/live.html."""
    runs = runs_from_files(args.configfile)
    if args.run and args.run not in runs:
        raise config.ConfigError(f"--run {args.run}: the config's runs are {', '.join(runs)}")
    built = 0
    for name, given in runs.items() if not args.run else [(args.run, runs[args.run])]:
        t, whole = time.perf_counter(), settings.whole(given)
        results = Path("results") / whole.dataset
        try:
            data = load_live(results, Path("benchmarks"), whole.dataset, name)
        except NotStarted:
            if len(runs) == 1 or args.run:
                raise
            logger.info("run %s: not started yet", name)
            continue
        status = inprogress.status(results / name / "train", data)
        page = {**inprogress.banner(status), "final": str(results / name / "report.html")}
        shown = whole.as_dict()
        html = build(
            data, whole.report, recipe=whole.recipe, index=whole.index, dataset=whole.dataset, shown=shown, live=page
        )
        out = atomic.write_text(results / name / PAGE, html)
        logger.info(
            "%s: %s (%.2f MB, %.1f s)", out.resolve(), page["headline"], len(html) / 1e6, time.perf_counter() - t
        )
        built += 1
    if not built:
        raise NotStarted(f"none of the runs {', '.join(runs)} has started training yet")


def main(argv=None) -> int:
    return cli.main("live", None, _arguments, _run, argv, errors={ConfigError: 2, NotStarted: 1, FileNotFoundError: 1})


if __name__ == "__main__":
    cli.end(main())
