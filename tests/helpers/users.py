"""A second user of a shared machine, for the tests of what another user may plant (they need root:
setpriv changes the uid): what that user runs, and a folder every user can reach."""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

OTHER_UID = 54321
# The two-user tests run only as root (setpriv needs it).
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root (setpriv)")


def as_other_user(code: str, *args) -> subprocess.CompletedProcess:
    """`code` run by python as another user (uid and gid OTHER_UID, no groups), as a second user of a
    shared machine would run it."""
    cmd = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", sys.executable, "-c", code]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def shared_folder():
    """A folder every user can reach (pytest's own tmp root is private to root), removed after."""
    base = Path(tempfile.mkdtemp(prefix="rectrain-shared-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base)
