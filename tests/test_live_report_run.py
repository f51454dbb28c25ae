"""The live report of a real run (issue 34 item 2): a tiny demo trains through Snakemake; after its
first epoch, while the job runs and Snakemake holds its lock, `python -m rectrain.report.live` builds
results/demo/main/live.html and Chromium renders it with the in-progress banner and the epoch so far; then
every process of the run is SIGKILLed and `make live` shows the run killed, the same epoch kept."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml
from helpers import REPO, VENV_BIN, copy_workflow, tiny_demo, tiny_train
from helpers.browser import CHROMIUM, NO_CHROMIUM, chromium

pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)]

EPOCHS, STEPS = 3, 5  # 36 train images, batch 8: 5 steps an epoch (4 images repeated)
TINY = {
    "demo": tiny_demo(train_per_class=12),
    "train": tiny_train(cpu_processes=1, epochs=EPOCHS, batch_size=8, model="squeezenet1_1", calibration_steps=2),
}
TELEMETRY = "results/demo/main/train/telemetry"


def epoch_rows(path) -> list[str]:
    return path.read_text().splitlines()[1:] if path.is_file() else []


def wait_for_epoch_1(work, proc, deadline) -> None:
    """Until epoch 0 is in epochs.csv and rank 0 logged a step of epoch 1 (where RECTRAIN_PAUSE_AT holds it)."""
    epochs, steps = work / TELEMETRY / "epochs.csv", work / TELEMETRY / "steps_rank0.csv"
    while not (epoch_rows(epochs) and any(r.startswith("0,1,") for r in epoch_rows(steps))):
        assert proc.poll() is None, (work / "snakemake.out").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never reached epoch 1"
        time.sleep(0.2)


def kill_all(proc) -> None:
    """SIGKILL Snakemake and every process under it at once, as the OOM killer or a power cut would."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)


def banner(dom: str) -> str:
    return dom[dom.index('<div id="live-banner"') : dom.index("</div>", dom.index('<div id="live-banner"'))]


def learning_rows(dom: str) -> list[str]:
    section = dom[dom.index('<section id="learning">') : dom.index('<section id="classes">')]
    return re.findall(r"<tr[^>]*>\s*<td>(\d+)", section)


def test_a_run_in_progress_and_then_killed_renders_its_banner_and_epochs_so_far(tmp_path):
    work = copy_workflow(tmp_path / "work")
    (work / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    env = dict(
        os.environ,
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        # rank 0 waits after epoch 1's second step for a gate that never comes: the run is surely
        # still training when the page is built, however slow the machine
        RECTRAIN_PAUSE_AT=f"0:1:1:{tmp_path / 'gate-never-made'}",
    )
    command = [str(VENV_BIN / "snakemake"), "--snakefile", str(work / "Snakefile"), "--cores", "2"]
    command += ["results/report.html", "--configfile", "tiny.yaml"]
    with open(work / "snakemake.out", "w") as out:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_epoch_1(work, proc, time.monotonic() + 600)
        assert list((work / ".snakemake" / "locks").iterdir()), "Snakemake holds no lock: not a test of that"
        built = subprocess.run(
            [sys.executable, "-m", "rectrain.report.live", "--configfile", "tiny.yaml"],
            cwd=work, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert built.returncode == 0, built.stderr[-3000:]
        assert proc.poll() is None, "the run ended while the page was built"
        dom = chromium(tmp_path, "--dump-dom", (work / "results/demo/main/live.html").as_uri()).stdout
        head = banner(dom)
        assert 'class="live-training"' in head and re.search(
            rf"In progress: epoch 1 \(of {EPOCHS}\) step \d/{STEPS}", head
        )
        assert f"1 of {EPOCHS} epoch(s) done; training ends in" in head
        assert learning_rows(dom) == ["0"]
    finally:
        kill_all(proc)
    assert json.loads((work / "results/demo/main/train/run.json").read_text())["finished"] is None
    venv = VENV_BIN.parent
    make = [
        "make",
        "-f",
        str(REPO / "Makefile"),
        "-o",
        f"{venv}/.installed",
        f"VENV={venv}",
        "live",
        "CONFIG=tiny.yaml",
    ]
    built = subprocess.run(make, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    dom = chromium(tmp_path, "--dump-dom", (work / "results/demo/main/live.html").as_uri()).stdout
    head = banner(dom)
    assert 'class="live-killed"' in head and re.search(rf"Killed at epoch 1 \(of {EPOCHS}\) step \d/{STEPS}", head)
    assert "no process on this host" in head and "of training left when it goes on" in head
    assert learning_rows(dom) == ["0"]
