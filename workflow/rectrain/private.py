"""The config's `private`: every output readable by its owner only.

Outputs are created as the user's umask says (022 makes them world-readable: the .rec holds the raw
images, so a private dataset becomes readable by everyone once packed). With `private: true` the
Snakefile adds 077 to the umask of Snakemake and so of every job it starts (stage processes, the
shell that creates the rule logs), and closes the run's existing output folders to others (0700), so
turning it on protects what earlier runs wrote without rerunning them. Turning it off loosens nothing.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

OWNER_ONLY = 0o077  # the umask bits private adds: nothing for group and others


def apply(private: bool, folders: Iterable[str | os.PathLike]) -> None:
    """With private, add OWNER_ONLY to this process's umask (its children inherit it) and make each
    existing folder of folders that this user owns (not a link) 0700 or tighter."""
    if not private:
        return
    os.umask(os.umask(0) | OWNER_ONLY)
    for folder in map(Path, folders):
        try:
            st = folder.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & OWNER_ONLY:
            os.chmod(folder, stat.S_IMODE(st.st_mode) & ~OWNER_ONLY, follow_symlinks=False)
