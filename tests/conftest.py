"""Shared test helpers: the repo root and a way to run this checkout's Snakemake."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def snakemake(*args, cwd=REPO, timeout=300, check=False):
    """Run Snakemake from the test interpreter's environment; returns the CompletedProcess."""
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(
        [str(VENV_BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def repo():
    return REPO
