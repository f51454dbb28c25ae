"""Where and with what the report's numbers were made: packages, git commit, host, time."""

from __future__ import annotations

import datetime as dt
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "torch",
    "torchvision",
    "nvidia-dali-cuda110",
    "snakemake",
    "numpy",
    "pandas",
    "seaborn",
    "matplotlib",
    "jinja2",
    "pillow",
    "psutil",
    "nvidia-ml-py",
)


def package_versions(names=PACKAGES) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_commit(repo: Path | str = ".") -> str:
    """HEAD commit, '+ uncommitted changes' when the tree is dirty; a plain reason when there is no git."""

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    suffix = " + uncommitted changes" if dirty.returncode == 0 and dirty.stdout.strip() else ""
    return head.stdout.strip() + suffix


def collect(run: dict, repo: Path | str = ".") -> dict:
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "generated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git": git_commit(repo),
        "packages": package_versions(),
        "gpus": run.get("gpus") or [],
        "cuda": run.get("cuda"),
        "train_torch": run.get("torch"),
        "train_dali": run.get("dali"),
        "started": run.get("started"),
        "finished": run.get("finished"),
    }
