"""Test session set-up: this checkout's package on the path of every process the tests start."""

import os

from helpers import REPO

# A second worktree sharing one editable-installed venv must test its own code, in subprocesses too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "workflow"), os.environ.get("PYTHONPATH")) if p)
