"""The calibration before the first epoch (rectrain.train.calibrate): it leaves the trained result
untouched, and with it the report tells an input-bound run from a compute-bound one by measurement."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.train_data import config_json, packed_dataset

from rectrain.train.checkpoint import load

# A small network with BatchNorm (running statistics) and Dropout (draws from the torch RNG), in fp32
# with one thread per rank: milliseconds per step on this CPU.
SMALL = {"model": "mobilenet_v3_small", "precision": "fp32", "image_size": 32}


def run_train(data, out, *extra, timeout=240, **cfg):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", config_json(**cfg), *data, "--out", str(out)]
    return subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_dataset(tmp_path_factory.mktemp("packed"))


def test_calibration_leaves_two_rank_training_bit_identical(data, tmp_path):
    """Same seed, 2 gloo ranks under DDP: with 6 calibration steps (synthetic gradients all-reduced,
    BatchNorm statistics and momentum moved, dropout drawn, the LR schedule stepped) the weights, BN
    buffers and momentum after the first epoch equal those of a run without calibration."""
    common = dict(SMALL, epochs=1, cpu_processes=2, momentum=0.9)
    runs = {}
    for steps in (0, 4):
        out = tmp_path / f"cal{steps}"
        proc = run_train(data, out, "--threads", "2", calibration_steps=steps, calibration_warmup_steps=2, **common)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[steps] = (load(out / "model.pt"), json.loads((out / "run.json").read_text()))

    (plain, plain_info), (calibrated, info) = runs[0], runs[4]
    assert plain_info["calibration"]["skipped"] == "train.calibration_steps is 0"
    cal = info["calibration"]
    assert cal["skipped"] is None and cal["steps"] == 4 and cal["warmup_steps"] == 2 and cal["batch_size"] == 8
    assert set(cal["images_per_s"]) == {"0", "1"} and all(v > 0 for v in cal["images_per_s"].values())
    assert 0 < cal["seconds"] < 60 and info["cores"] == 2
    assert plain["model"].keys() == calibrated["model"].keys()
    for k, v in plain["model"].items():
        assert torch.equal(v, calibrated["model"][k]), f"{k} differs after calibration"
    assert any("running_mean" in k for k in plain["model"]), "the model must have BatchNorm statistics"
    for i, s in plain["optimizer"]["state"].items():
        assert torch.equal(s["momentum_buffer"], calibrated["optimizer"]["state"][i]["momentum_buffer"])
    assert (
        plain["scheduler"]["last_epoch"] == calibrated["scheduler"]["last_epoch"] == 3
    )  # 3 steps of 2 x 8 cover 45 images
