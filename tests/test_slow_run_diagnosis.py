"""A run slowed by another program gets a diagnosis naming it (issue 51): a real training of 5 epochs,
and while its epochs 2 and 3 train the test keeps the CPUs busy with busy loops of its own (bounded:
each ends by itself within a minute, and the test ends them as epoch 3's row is written).  The report's
diagnosis, from the run's own telemetry, names other processes' load during the slow epochs."""

import os
import re
import subprocess
import sys
import time

import pandas as pd
import psutil
import pytest
from helpers.synthetic_run import REPORT
from helpers.train_data import config_json, packed_dataset

from rectrain.report.slowdown import epoch_windows, other_processes

pytestmark = pytest.mark.slow

EPOCHS = 5
HOG = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"


def rows(path) -> int:
    return max(0, len(path.read_text().splitlines()) - 1) if path.is_file() else 0


def test_a_cpu_hog_during_epochs_2_and_3_is_named_by_the_diagnosis(tmp_path):
    data = packed_dataset(tmp_path / "data", n_train=120, n_val=10)
    out = tmp_path / "t"
    cfg = config_json(cpu_processes=1, epochs=EPOCHS, batch_size=8, model="resnet18", calibration_steps=0)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", cfg, *data, "--out", str(out), "--threads", "2"]
    train = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    epochs_csv, hogs = out / "telemetry" / "epochs.csv", []
    deadline = time.monotonic() + 600
    try:
        while rows(epochs_csv) < 2:  # epochs 0 and 1 at the machine's own pace
            assert train.poll() is None and time.monotonic() < deadline, train.stderr.read()[-3000:]
            time.sleep(0.05)
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(psutil.cpu_count() + 1)]
        while rows(epochs_csv) < 4:
            assert train.poll() is None and time.monotonic() < deadline, train.stderr.read()[-3000:]
            time.sleep(0.05)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert train.wait(timeout=600) == 0, train.stderr.read()[-3000:]
    steps = pd.read_csv(out / "steps.csv")
    system = pd.read_csv(out / "system.csv")
    finding = other_processes(steps, system, REPORT)
    rates = epoch_windows(steps)["rate"].round(1).to_dict()
    assert finding is not None, (rates, system[["time", "cpu_percent", "job_cpu_percent"]].to_string())
    assert finding.title.startswith("Other processes slowed training: epoch"), finding.title
    # the epochs the test's own busy loops slowed are named (on a machine others load too, maybe beside others)
    named = re.findall(r"(?:^|; )epochs? (\d+)(?:-(\d+))?: ", finding.measured)
    spans = [set(range(int(a), int(b or a) + 1)) for a, b in named]
    assert any(span & {2, 3} for span in spans), (finding.measured, rates)
