"""Test helpers shared by several test modules (tests import them from here, never from conftest.py
or from another test module): the repo root, this checkout's Snakemake, dry-run parsing."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def snakemake(*args, cwd=REPO, timeout=300, check=False, snakefile=None):
    """Run Snakemake from the test interpreter's environment; returns the CompletedProcess."""
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(
        [str(VENV_BIN / "snakemake"), "--snakefile", str(snakefile or REPO / "Snakefile"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def scheduled_rules(dryrun_stdout: str) -> dict:
    """Rule -> job count from the dry-run's job-stats table."""
    table = dryrun_stdout.split("Job stats:", 1)[1] if "Job stats:" in dryrun_stdout else ""
    return {
        m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M) if m.group(1) != "total"
    }
