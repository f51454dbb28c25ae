"""Small custom datasets (issue 27): batch_size auto never plans a batch the dataset cannot fill, and
the calibration stays a small share of a short run, bounded in time and with progress lines."""

import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from helpers.train_data import config_json, packed_dataset, rows, train_settings

from rectrain.train import batchplan
from rectrain.train.calibrate import CALIBRATION_SHARE, Bounds

AUTO_256 = {"batch_size": "auto", "global_batch": 256, "grad_accum": 1}


def test_auto_batch_is_capped_to_what_a_small_dataset_fills_and_the_reason_names_the_numbers():
    """150 images on 2 processes with a global batch of 256 was one optimizer step per epoch."""
    plan = batchplan.plan(train_settings(AUTO_256).batch, 2, train_images=150)
    assert (plan.batch, plan.grad_accum, plan.global_batch) == (18, 1, 36)
    assert -(-75 // plan.batch) >= batchplan.MIN_STEPS_PER_EPOCH, "each rank's 75 images give the minimum steps"
    for words in ("capped to 18 per device", "global batch 36, not 256", "150 train images", "0.59 time(s)"):
        assert words in plan.reason and words in plan.capped


def test_auto_batch_on_a_dataset_large_enough_is_not_capped():
    plan = batchplan.plan(train_settings(AUTO_256).batch, 2, train_images=1_281_167)
    assert (plan.batch, plan.global_batch, plan.capped) == (128, 256, "")
    assert batchplan.plan(train_settings(AUTO_256).batch, 2).batch == 128, (
        "no image count (a preflight without data): no cap"
    )


def test_a_number_in_batch_size_is_used_as_given_even_on_a_small_dataset():
    plan = batchplan.plan(
        train_settings({"batch_size": 128, "global_batch": None, "grad_accum": 1}).batch, 2, train_images=150
    )
    assert (plan.batch, plan.capped) == (128, "")


def test_a_capped_batch_that_does_not_fit_still_accumulates_to_the_capped_global_batch():
    plan = batchplan.plan(train_settings(AUTO_256).batch, 2, fits=10, train_images=150)
    assert (plan.batch, plan.grad_accum, plan.global_batch) == (9, 2, 36)


@pytest.mark.parametrize(
    "run_steps, asked, expect",
    [
        (None, (20, 5), (20, 5)),  # unbounded (the bench)
        (100, (20, 5), (20, 5)),  # 25 steps of 100: within the share
        (20, (20, 5), (5, 5)),  # half of 20 is 10: 5 warm-up + 5 measured
        (8, (20, 5), (2, 2)),
        (3, (20, 5), (0, 0)),  # a run of 3 steps (a 1-step epoch, 3 epochs): skipped
    ],
)
def test_calibration_takes_at_most_its_share_of_a_short_run(run_steps, asked, expect):
    steps, warmup, why = Bounds(run_steps=run_steps).fit(*asked)
    assert (steps, warmup) == expect
    assert steps + warmup <= CALIBRATION_SHARE * (run_steps or 10**9)
    assert (why is None) == (expect == asked)
    if why:
        assert f"the run trains only {run_steps} steps" in why


@pytest.mark.slow
def test_reference_config_on_150_images_trains_with_the_capped_plan_and_a_bounded_calibration(tmp_path):
    """The issue's case at test size: 5 classes, 150 train images, batch_size auto with global_batch
    256 on 2 CPU processes. The capped plan trains several steps per epoch and learns; the calibration
    is cut to half the run, stops at train.calibration_max_s and logs its progress."""
    data = packed_dataset(tmp_path / "data", n_train=150, n_val=50, classes=5)
    cfg = dict(AUTO_256, epochs=6, calibration_steps=40, calibration_warmup_steps=2)
    cfg.update(calibration_max_s=3.0, progress_s=0.2)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = tmp_path / "train"
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", config_json(**cfg), *data, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((out / "run.json").read_text())
    assert (info["batch_size"], info["global_batch"]) == (18, 36)
    assert "capped to 18 per device" in proc.stderr, "the cap is said on the console, with its numbers"
    steps = rows(out / "steps.csv")
    assert {r["epoch"] for r in steps} == {str(e) for e in range(6)}
    assert sum(r["epoch"] == "0" and r["rank"] == "0" for r in steps) == 5, "75 images per rank in batches of 18"
    cal = info["calibration"]
    assert cal["skipped"] is None and cal["warmup_steps"] + cal["steps"] <= 15, "half of the run's 30 steps"
    assert "the run trains only 30 steps" in cal["shortened"]
    assert re.search(r"calibration \d+/\d+ images \(", proc.stderr), "a progress line while calibrating"
    epochs = rows(out / "epochs.csv")
    assert float(epochs[-1]["val_single_view_top1"]) >= 3 * 0.2, f"the capped plan learns (chance is 0.2): {epochs}"


class SlowNet(torch.nn.Module):
    """A linear layer whose forward takes at least 50 ms: a step of known least duration."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3 * 4 * 4, 3)

    def forward(self, x):
        time.sleep(0.05)
        return self.fc(x.flatten(1))


def slow_step():
    from rectrain.distributed import Dist
    from rectrain.train.step import Step

    net = SlowNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    d = Dist(0, 1, 0, 1, torch.device("cpu"))
    return Step(net, torch.nn.CrossEntropyLoss(), opt, sched, scaler, 1, "fp32", False, d), net


def test_calibration_stops_at_its_time_cap_with_progress_lines_and_says_so(caplog):
    from rectrain.train.calibrate import Shape, calibrate

    step, net = slow_step()
    with caplog.at_level(logging.INFO, logger="rectrain"):
        cal = calibrate(step, net, Shape(2, 4, 3), 100, 1, bounds=Bounds(max_s=0.6, progress_s=0.15))
    assert cal["skipped"] is None and 1 <= cal["steps"] < 12, "100 steps of >= 50 ms do not fit in 0.6 s"
    assert f"train.calibration_max_s = 0.6 s: {cal['steps']} of 100 steps measured" in cal["shortened"]
    assert cal["seconds"] < 0.6 + 0.5, "the cap ends it within about a step of its limit"
    lines = [m for m in caplog.messages if m.startswith("calibration ")]
    assert len(lines) >= 2 and all(re.match(r"calibration \d+/202 images \(", m) for m in lines), lines


def test_a_warm_up_longer_than_the_time_cap_is_cut_and_one_step_is_still_measured(caplog):
    from rectrain.train.calibrate import Shape, calibrate

    step, net = slow_step()
    with caplog.at_level(logging.INFO, logger="rectrain"):
        cal = calibrate(step, net, Shape(2, 4, 3), 10, 100, bounds=Bounds(max_s=0.4, progress_s=0.1))
    assert cal["steps"] == 1 and 1 <= cal["warmup_steps"] < 10 and cal["images_per_s"]["0"] > 0
    assert f"{cal['warmup_steps']} warm-up step(s), then one optimizer step of 10 measured" in cal["shortened"]
    assert any(m.startswith("calibration ") for m in caplog.messages), "the warm-up logs its progress too"
