"""Parse-time checks of the recordio block (bring your own .rec): the files exist, val needs train,
and the pair does not sit where the pipeline writes its own. Run by common.smk before any output is
removed; the check_recordio job then reads every record (rectrain.data.byo_recordio)."""

from __future__ import annotations

import os
from pathlib import Path

from rectrain.config import shown_path


def byo_problems(config: dict, fast: str, workdir: Path, written: dict[str, str] | None = None) -> list[str]:
    """One line per problem, naming the key and the fix; [] when recordio is unset or fine."""
    byo, written = config["recordio"], written or {}
    if byo["train"] is None:
        return ["recordio.val is set but recordio.train is not: name the train pair too"] if byo["val"] else []
    problems = []
    for split in ("train", "val"):
        for kind, value in (byo[split] or {}).items():
            path = value if os.path.isabs(value) else workdir / value
            key = f"recordio.{split}.{kind}"
            if not os.path.isfile(path):
                problems.append(f"{shown_path(key, value, written)}: no such file. Point it at the existing .{kind}.")
            elif Path(os.path.realpath(path)).parent == Path(os.path.realpath(workdir / fast)):
                problems.append(
                    f"{shown_path(key, value, written)} is inside {fast}, where the pipeline publishes its pair: "
                    "move it elsewhere."
                )
    classes = byo["classes"]
    if classes is not None and not os.path.isfile(classes if os.path.isabs(classes) else workdir / classes):
        problems.append(f"{shown_path('recordio.classes', byo['classes'], written)}: no such file.")
    return problems
