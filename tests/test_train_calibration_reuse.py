"""A resume on the same setup reuses the calibration of the run it continues, and says so
(rectrain.train.calibrate.reused_or_measured); another batch plan, or a fresh start, measures again."""

import json
import logging
from types import SimpleNamespace

import torch
from helpers.train_data import tiny_train_settings

from rectrain.distributed import Dist
from rectrain.train import batchplan, calibrate

MEASURED = {"skipped": None, "images_per_s": {"0": 100.0, "1": 98.0}, "steps": 5, "warmup_steps": 1, "seconds": 3.0}


def fake_run(batch=8):
    return SimpleNamespace(
        settings=tiny_train_settings(),
        d=Dist(0, 1, 0, 1, torch.device("cpu")),
        plan=batchplan.BatchPlan(batch, 1, 1),
        train_loader=SimpleNamespace(image_dtype="float32"),
    )


def test_a_resume_on_the_same_setup_reuses_the_calibration_and_says_so(tmp_path, monkeypatch, caplog):
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps({"calibration": MEASURED, "calibration_setup": calibrate.setup_key(fake_run())}))
    monkeypatch.setattr(calibrate, "calibrate_run", lambda run: {"measured": "again"})
    with caplog.at_level(logging.INFO):
        assert calibrate.reused_or_measured(fake_run(), run_json, resumed=True) == MEASURED
    assert f"calibration reused from {run_json} (198.0 img/s): the same devices" in caplog.text
    assert calibrate.reused_or_measured(fake_run(batch=4), run_json, resumed=True) == {"measured": "again"}
    assert calibrate.reused_or_measured(fake_run(), run_json, resumed=False) == {"measured": "again"}
    run_json.write_text(json.dumps({"calibration": MEASURED}))  # written before the setup was recorded
    assert calibrate.reused_or_measured(fake_run(), run_json, resumed=True) == {"measured": "again"}


def test_the_calibration_kept_in_the_telemetry_folder_is_reused_once_snakemake_removed_run_json(tmp_path, monkeypatch):
    """A stopped train job fails in Snakemake's eyes, which removes its run.json: the calibration the
    run kept beside its live telemetry is what the resume reads."""
    out = tmp_path / "train"
    info = {"calibration": MEASURED, "calibration_setup": calibrate.setup_key(fake_run()), "model": "resnet18"}
    calibrate.keep(out / calibrate.KEPT, info)
    assert not (out / "run.json").exists()
    monkeypatch.setattr(calibrate, "calibrate_run", lambda run: {"measured": "again"})
    assert calibrate.reused_or_measured(fake_run(), out / calibrate.KEPT, resumed=True) == MEASURED
