"""The environment of the jobs the rules start: this package and this interpreter first on their
paths, the working directory on neither (PYTHONSAFEPATH), and every block's operational config values
(rectrain.config.OPERATIONAL_ENV), which reach the jobs here rather than through `params:` so that
editing one reruns nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from rectrain.atomic import replacing
from rectrain.config import OPERATIONAL_ENV, RUNS_OPERATIONAL_ENV, operational_part

# Python's -P as an environment variable: no script folder or working directory on sys.path.
SAFE_PATH_ENV = "PYTHONSAFEPATH"


# Every block by nature: the jobs of every stage read their operational values back from this one variable.
def _operational(blocks) -> dict:
    """{block: its operational values} of (name, values) pairs, the blocks without any left out."""
    found = {name: operational_part(name, values) for name, values in blocks if isinstance(values, dict)}
    return {name: ops for name, ops in found.items() if ops}


def export_operational(config: dict, runs: dict | None = None) -> None:
    """Every block's operational values (x-rerun: false in the schema) for the jobs to read back, and
    each run's own (`runs`: {name: its config}; a job names its run in RUN_ENV)."""
    os.environ[OPERATIONAL_ENV] = json.dumps(_operational(config.items()), sort_keys=True)
    per_run = {name: _operational(values.items()) for name, values in (runs or {}).items()}
    os.environ[RUNS_OPERATIONAL_ENV] = json.dumps(per_run, sort_keys=True)


def prepare_job_env(package_dir, executable: str = sys.executable) -> None:
    """Make jobs' `python -m rectrain.<stage>` find this package and, unless a conda env is
    activated for the job (its activation puts the env's python first), the interpreter Snakemake
    itself runs in (an unactivated .venv, or a system python3 with no `python` beside it).
    PYTHONSAFEPATH=1 (Python >= 3.11's -P, for every process of every job: torchrun's ranks and the
    loaders' workers inherit it): `python -m` no longer puts the working directory first on sys.path,
    where a json.py planted in a shared working folder ran inside the job (issue 47); the modules come
    from this package and the installed ones only."""
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(package_dir), os.environ.get("PYTHONPATH")) if p)
    os.environ[SAFE_PATH_ENV] = "1"
    first = dict.fromkeys([str(python_dir(executable)), str(Path(executable).parent)])
    os.environ["PATH"] = os.pathsep.join((*first, os.environ.get("PATH", "")))


def python_dir(executable: str, workdir=".") -> Path:
    """A folder whose `python` runs `executable`: the interpreter's own folder when its `python` is that
    program, else .snakemake/rectrain-bin/ holding a wrapper (many machines have only `python3`, and a
    `python` found further along the PATH lacks the packages).  A wrapper, not a link: a venv's
    interpreter finds its packages only when started by its own path."""
    exe = Path(executable)
    own = exe.parent / "python"
    if own.is_file() and os.path.samefile(own, exe):
        return exe.parent
    folder = (Path(workdir) / ".snakemake" / "rectrain-bin").resolve()
    wrapper, text = folder / "python", f'#!/bin/sh\nexec {shlex.quote(str(exe))} "$@"\n'
    if not wrapper.is_file() or wrapper.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        # created O_EXCL|O_NOFOLLOW and written through its descriptor: a planted link is never written through;
        # whole, executable, even when several Snakemake processes parse at once
        with replacing(wrapper, sync=False, mode="w") as f:
            f.write(text)
            os.fchmod(f.fileno(), 0o755)
    return folder
