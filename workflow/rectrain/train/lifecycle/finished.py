"""A finished run kept beside its checkpoints, so a rerun that fails never costs it.

Snakemake deletes a job's outputs before it runs it, and again when the job fails.  A rerun of the
train job that fails at its start (a key only the job can check, a crash before the first step)
would otherwise leave a finished run without model.pt, epochs.csv or run.json, and the next start
would train again.  So `keep` links each published output into checkpoints/finished/ once the run
has published them (hard links: no byte copied, no extra disk; a copy where the filesystem has no
links), and `restore` links them back when the train job starts again for that same run.

Whether a start is "that same run" is rectrain.train.lifecycle.resume's decision (the checkpoint's identity);
whether the user asked for a new training is Snakemake's: the Snakefile's onstart hook sets FORCED_ENV
when Snakemake's reason for running the train job is `forced` (--forcerun/-R train, -F, -f on its
outputs); every other reason (outputs missing because a failed job's were removed, or deleted by
hand; an input touched) restores the finished run when it still matches.  Torch-free: the Snakefile
imports FORCED_ENV from here.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from rectrain import atomic
from rectrain.log import CONSOLE_LINE

log = logging.getLogger(__name__)

# Set to "1" by the Snakefile's onstart hook when Snakemake forces the train job: it retrains.
FORCED_ENV = "RECTRAIN_TRAIN_FORCED"
# Written beside the checkpoints once model.pt is published: this run is complete.
MARKER = "finished.json"
# checkpoints/<FOLDER>/: the finished run's published outputs, moved aside with its checkpoints.
FOLDER = "finished"
# The train rule's outputs in --out, model.pt last (the rule's marker of a finished run).
PUBLISHED = ("steps.csv", "epochs.csv", "system.csv", "run.json", "weights.safetensors", "model.pt")
# What the later stages published from the finished run's weights (evaluate: weights.json beside them,
# eval/; report: report.html, in the run's folder): kept with the run when it is moved aside.
EVALUATION = ("weights.json",)
RUN_PUBLISHED = ("eval", "report.html")
# ... and beside weights.safetensors, with train.ema, the raw and the averaged weights (rectrain.train.ema):
# kept and restored when the run wrote them, removed before a run publishes again.
VARIANTS = ("weights-raw.safetensors", "weights-ema.safetensors")


def marker(ck_dir: Path) -> Path:
    """The finished-run marker of the checkpoint folder `ck_dir`."""
    return Path(ck_dir) / MARKER


def forced(env=None) -> bool:
    """True when Snakemake forced this train job (FORCED_ENV, set by the Snakefile's onstart)."""
    return (os.environ if env is None else env).get(FORCED_ENV) == "1"


def folder(ck_dir: Path) -> Path:
    return Path(ck_dir) / FOLDER


def complete(ck_dir: Path) -> bool:
    """Every published output is kept in checkpoints/finished/."""
    return all((folder(ck_dir) / name).is_file() for name in PUBLISHED)


def _link(src: Path, dest: Path) -> None:
    """dest becomes src's bytes, atomically: a hard link, else (no links on this filesystem) a copy."""
    atomic.link_or_write(src, dest, lambda out: _copy(src, out))


def _copy(src: Path, out) -> None:
    with open(src, "rb") as f:
        shutil.copyfileobj(f, out, 1 << 20)


def clear(out: Path) -> None:
    """Remove the published outputs in out before they are written again: one that is a link into a
    kept run (published by a restore) is then replaced, never written through."""
    for name in (*VARIANTS, *PUBLISHED):
        (Path(out) / name).unlink(missing_ok=True)


def _present(where: Path) -> tuple[str, ...]:
    """The published outputs, with the weight variants found in `where`, model.pt last."""
    return (*(name for name in VARIANTS if (Path(where) / name).is_file()), *PUBLISHED)


def keep(out: Path, ck_dir: Path) -> None:
    """Link the published outputs into checkpoints/finished/ (model.pt last)."""
    for name in _present(out):
        _link(Path(out) / name, folder(ck_dir) / name)


def restore(out: Path, ck_dir: Path) -> None:
    """Publish the kept outputs again in out (model.pt last) and say so."""
    for name in VARIANTS:  # a variant the kept run has not (train.ema off) is not left from another
        (Path(out) / name).unlink(missing_ok=True)
    for name in _present(folder(ck_dir)):
        _link(folder(ck_dir) / name, Path(out) / name)
    log.info(
        "restored the finished run's outputs (%s) from %s: no training needed - its config, records, code, "
        "batch plan and processes match this job's (to train again: snakemake --forcerun train, or "
        "train.resume: never)",
        ", ".join(PUBLISHED),
        folder(ck_dir),
        extra=CONSOLE_LINE,
    )


def keep_evaluation(out: Path, dest: Path) -> list[str]:
    """Link what the later stages published from a finished run (weights.json in `out`, the run's eval/
    and report.html beside `out`) into dest/finished/, as that run moves aside to `dest` (the train job
    starts before Snakemake removes the evaluate and report outputs, so they are still the run's).
    Returns the names kept, as paths under dest."""
    kept, home = [], folder(dest)
    sources = [Path(out) / n for n in EVALUATION] + [Path(out).parent / n for n in RUN_PUBLISHED]
    for src in sources:
        files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src] if src.is_file() else []
        for f in files:
            rel = f.relative_to(src.parent)
            (home / rel).parent.mkdir(parents=True, exist_ok=True)
            _link(f, home / rel)
            kept.append(str(Path(FOLDER) / rel))
    return kept
