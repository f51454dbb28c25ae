"""Headless Chromium as the report tests drive it: offline, hermetic, a fresh profile per run."""

import shutil
import subprocess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = "chromium is not installed (apt-get install -y chromium; .ci/run installs it)"
# Offline and hermetic: no first-run UI, no background network, a fresh profile per run.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--hide-scrollbars",
]


def chromium(tmp_path, *args, timeout=120):
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    proc = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return proc
