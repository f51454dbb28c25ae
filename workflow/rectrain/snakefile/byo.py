"""Parse-time checks of the recordio block (bring your own .rec): the files exist, val needs train,
and the pair does not sit where the pipeline writes its own. Run by common.smk before any output is
removed; the check_recordio job then reads every record (rectrain.data.byo_recordio)."""

from __future__ import annotations

import os
from pathlib import Path

from rectrain.config import shown_path
from rectrain.safefs import not_a_file
from rectrain.settings import RecordioSettings


def byo_problems(byo: RecordioSettings, fast: str, workdir: Path, written: dict[str, str] | None = None) -> list[str]:
    """One line per problem in the recordio block `byo`, naming the key and the fix; [] when it is unset
    or fine. fast: where the pipeline publishes its own pair."""
    written = written or {}
    if byo.train is None:
        return ["recordio.val is set but recordio.train is not: name the train pair too"] if byo.val else []
    problems = []
    for split in ("train", "val"):
        for kind, value in (getattr(byo, split) or {}).items():
            path = value if os.path.isabs(value) else workdir / value
            key = f"recordio.{split}.{kind}"
            if why := not_a_file(path):
                problems.append(f"{shown_path(key, value, written)}: {why}. Point it at the existing .{kind}.")
            elif Path(os.path.realpath(path)).parent == Path(os.path.realpath(workdir / fast)):
                problems.append(
                    f"{shown_path(key, value, written)} is inside {fast}, where the pipeline publishes its pair: "
                    "move it elsewhere."
                )
    classes = byo.classes
    if classes is not None and (why := not_a_file(classes if os.path.isabs(classes) else workdir / classes)):
        problems.append(f"{shown_path('recordio.classes', classes, written)}: {why}.")
    return problems
