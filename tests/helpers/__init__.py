"""Test helpers shared by several test modules (tests import them from here, never from conftest.py
or from another test module): the repo root, this checkout's Snakemake, a copy of the workflow, dry-run parsing."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# What a working directory of its own needs to run the workflow (no results, logs or .snakemake).
WORKFLOW_PARTS = ["Snakefile", "workflow", "config", "envs", "profiles"]


def copy_workflow(dst: Path) -> Path:
    """This checkout's workflow files copied into `dst` (made if missing), without __pycache__."""
    dst.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dst / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / part)
    return dst


def snakemake(*args, cwd=REPO, timeout=300, check=False, snakefile=None, env=None):
    """Run Snakemake from the test interpreter's environment (with `env` over it); returns the CompletedProcess."""
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {}))
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


def dryruns(arglists: list[list[str]], cwd: Path, snakefile: Path, timeout=600) -> list[tuple[bool, str]]:
    """`snakemake -n ARGS` for each argument list, all in one Snakemake process (helpers/dryrun_batch.py):
    (succeeded, stdout and stderr together) per list, in order."""
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    prefix = ["--snakefile", str(snakefile), "--directory", str(cwd)]
    proc = subprocess.run(
        [str(VENV_BIN / "python"), str(Path(__file__).with_name("dryrun_batch.py"))],
        input=json.dumps([prefix + [str(a) for a in args] for args in arglists]),
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"the dry-run batch failed:\n{proc.stderr[-4000:]}")
    return [(a["ok"], a["out"]) for a in json.loads(proc.stdout)]


# A job's header on the console: the rule's message (workflow/rules/*.smk), which names the rule first.
JOB_HEADER = re.compile(r"^[ \t]*Job \d+: (\w+) (.*)$", re.M)


def job_headers(stdout: str) -> list[tuple[str, str]]:
    """(rule, the rest of its header line) for every job Snakemake announced, in order."""
    return JOB_HEADER.findall(stdout)


def job_reasons(dryrun_stdout: str) -> dict[str, list[str]]:
    """Rule -> the Reason line of each of its jobs; the default profile hides them, so the dry-run
    must be given `--quiet host` (after its targets)."""
    reasons: dict[str, list[str]] = {}
    for m in re.finditer(r"^[ \t]*Job \d+: (\w+) .*\n(?:[ \t]*Reason: (.*))?", dryrun_stdout, re.M):
        reasons.setdefault(m.group(1), []).append(m.group(2) or "")
    return reasons


def scheduled_rules(dryrun_stdout: str) -> dict:
    """Rule -> job count from the dry-run's job-stats table."""
    table = dryrun_stdout.split("Job stats:", 1)[1] if "Job stats:" in dryrun_stdout else ""
    return {
        m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M) if m.group(1) != "total"
    }


def launcher_of(proc, deadline):
    """The train job's `python -m rectrain.train` under the Snakemake process `proc`: the one not yet a rank
    (torchrun's ranks run the same command with RANK set)."""
    import psutil

    while time.monotonic() < deadline:
        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if "rectrain.train" in p.cmdline() and "RANK" not in p.environ():
                    return p
        assert proc.poll() is None, "Snakemake ended before the train job started"
        time.sleep(0.1)
    raise AssertionError("no train job started")


def failure_text(stderr: str, tail: int = 3000) -> str:
    """A failed run's stderr for an assertion message: its last `tail` characters, after every Python
    stack dump above them (faulthandler's: a stalled rank's watchdog writes every thread's stack), so a
    rank that was elsewhere when its peer failed is shown where it was, not cut off by the tail."""
    head, end = stderr[:-tail], stderr[-tail:]
    dumps = re.findall(r"^(?:Current thread|Thread) 0x[0-9a-f]+ .*?(?=^\S|\Z)", head, re.M | re.S)
    return "".join(dumps) + ("...\n" if head else "") + end


def readme_python(section: str) -> list[str]:
    """The ```python blocks of README.md's `section` (## heading), as written."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def tiny_demo(train_per_class: int) -> dict:
    """A demo block of 3 classes of small images and no planted defects: a whole pipeline in seconds."""
    return {
        "classes": 3,
        "train_per_class": train_per_class,
        "val_per_class": 2,
        "min_size": 40,
        "max_size": 64,
        "bad_files": False,
    }


def tiny_train(**keys) -> dict:
    """A train block for such a demo on CPU processes, fp32 at 32 px, system samples every 0.2 s, with the
    test's own `keys` over it.  Its top-1 on a handful of val images cannot be told from chance
    (rectrain.chance): train.allow_chance says that is expected."""
    base = {"devices": "cpu", "image_size": 32, "workers": 1, "precision": "fp32", "sample_interval_s": 0.2}
    base["allow_chance"] = True
    return {**base, "calibration_warmup_steps": 1, **keys}
