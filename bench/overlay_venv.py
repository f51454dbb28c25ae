"""Let a venv see every package of the interpreter that runs this script, after its own.

`python -m venv --system-site-packages` shows the new venv the *base* interpreter's site folders only.
On the lent GPU machine `python3` is itself a venv (/opt/torch/.venv) holding torch, numpy and pandas, so
a venv made from it saw none of them: DALI's wheel could not resolve numpy offline, and the pipeline
could not import numpy (2026-11-30, first GPU run). This writes the running interpreter's whole sys.path
into a .pth file of the venv, so its own packages still come first.

    "$PY" -m venv --system-site-packages VENV && "$PY" bench/overlay_venv.py VENV
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PTH_NAME = "overlay-python.pth"


def venv_site_packages(venv: Path) -> Path:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python bench/overlay_venv.py VENV")
    venv = Path(args[0])
    here = Path(__file__).resolve().parent  # sys.path[0] when run as a script: not a package folder
    paths = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != here]
    pth = venv_site_packages(venv) / PTH_NAME
    pth.write_text("".join(f"{p}\n" for p in paths))
    print(f"{pth}: {len(paths)} folders of {sys.executable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
