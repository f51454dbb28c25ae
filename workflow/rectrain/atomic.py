"""Write a file so that a reader (or a rerun after a kill) never sees it half-written."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write next to `path` under a temporary name, then rename over it (atomic on one filesystem)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json(path: str | os.PathLike, obj) -> Path:
    return write_text(path, json.dumps(obj, indent=2, default=str) + "\n")
