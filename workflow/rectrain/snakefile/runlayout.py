"""The folders of a dataset's runs, and the layout before runs had names.

Since issue 50 a run's outputs live in results/<dataset>/<run>/ (train/, eval/, report.html; run:
main by default).  A results/<dataset>/train/ left by an earlier version is that dataset's one run:
nothing moves it (a dry-run must not, and a folder of days of training is the user's to move), and
every Snakemake start says in one line how to keep it as the run `main` - a rename, after which the
run is found, resumed or republished as before.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

log = logging.getLogger(__name__)

# What the old layout held at results/<dataset>/: moved whole into the run's folder.
OLD_PARTS = ("train", "eval", "report.html", "live.html")


def legacy_parts(dataset: str, results: Path = Path("results")) -> list[str]:
    """The old layout's parts present in results/<dataset>/ (empty: none, or already moved)."""
    base = results / dataset
    return [part for part in OLD_PARTS if (base / part).exists()] if (base / "train").is_dir() else []


def legacy_move_command(dataset: str, run: str, parts: list[str], results: Path = Path("results")) -> str:
    base = results / dataset
    return f"mkdir -p {shlex.quote(str(base / run))} && " + " && ".join(
        f"mv {shlex.quote(str(base / p))} {shlex.quote(str(base / run / p))}" for p in parts
    )


def legacy_layout_line(dataset: str, run: str, results: Path = Path("results")) -> str | None:
    """Warn (and return the line) when results/<dataset>/train/ of the layout before named runs is there."""
    parts = legacy_parts(dataset, results)
    if not parts:
        return None
    line = (
        f"{results / dataset / 'train'} is a run of the layout before runs had names (results/<dataset>/<run>/ "
        f"since); it is not used or touched. To keep it as the run {run!r} (resumed or republished as before): "
        f"{legacy_move_command(dataset, run, parts, results)}"
    )
    log.warning("%s", line)
    return line
