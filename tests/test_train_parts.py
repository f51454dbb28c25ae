"""Small parts of the training stage: schedule, checkpoint files, telemetry CSVs, resume decisions."""

import csv
import random
import time

import numpy as np
import psutil
import pytest
import torch

from rectrain.train import checkpoint as ckpt
from rectrain.train import telemetry
from rectrain.train.trainer import lr_factor, resumable


def test_lr_warms_up_linearly_then_decays_to_zero_by_cosine():
    f = [lr_factor(s, warmup_steps=10, total_steps=110) for s in range(110)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[60] == pytest.approx(0.5)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False)) and f[-1] < 1e-3


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    ckpt.save_atomic({"rng": ckpt.rng_state()}, tmp_path / "c.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    ckpt.set_rng_state(ckpt.load(tmp_path / "c.pt")["rng"])  # load() uses weights_only=True
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"], "no temporary file left behind"


def test_checkpoint_loading_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        ckpt.load(tmp_path / "evil.pt")


def test_resume_is_refused_when_the_run_changed():
    cfg = {"lr": 0.1, "epochs": 4, "workers": 2}
    state = {"config": dict(cfg), "data": {"rec_bytes": 1}, "world_size": 2}
    assert resumable(state, cfg, {"rec_bytes": 1}, 2) is None
    assert resumable(state, dict(cfg, workers=8), {"rec_bytes": 1}, 2) is None, "workers do not change the maths"
    assert "config changed (epochs)" in resumable(state, dict(cfg, epochs=5), {"rec_bytes": 1}, 2)
    assert ".rec/.idx changed" in resumable(state, cfg, {"rec_bytes": 2}, 2)
    assert "2 processes" in resumable(state, cfg, {"rec_bytes": 1}, 1)
    state["code"] = {"train.py": "aa", "loaders/dali.py": "bb"}
    assert resumable(state, cfg, {"rec_bytes": 1}, 2, dict(state["code"])) is None
    edited = dict(state["code"], **{"loaders/dali.py": "cc"})
    assert "training code changed (loaders/dali.py)" in resumable(state, cfg, {"rec_bytes": 1}, 2, edited)


def test_step_log_on_resume_drops_the_interrupted_epoch(tmp_path):
    log = telemetry.step_log(tmp_path, rank=0, start_epoch=0)
    for epoch in range(3):
        log.write(
            rank=0,
            epoch=epoch,
            step=0,
            time=1.7e9,
            wall_s=1.0,
            data_wait_s=0.25,
            compute_s=0.75,
            images=8,
            loss=1.0,
            lr=0.1,
        )
    log.close()
    telemetry.step_log(tmp_path, rank=0, start_epoch=2).close()
    with open(tmp_path / "steps_rank0.csv", newline="") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["0", "1"]


def test_merge_steps_concatenates_ranks_with_the_contract_columns(tmp_path):
    for r in range(2):
        log = telemetry.step_log(tmp_path, rank=r, start_epoch=0)
        log.write(
            rank=r,
            epoch=0,
            step=0,
            time=1795996715.869,
            wall_s=1.0,
            data_wait_s=0.25,
            compute_s=0.75,
            images=8,
            loss=1.0,
            lr=0.1,
        )
        log.close()
    dest = telemetry.merge_steps(tmp_path, tmp_path / "steps.csv", 2)
    with open(dest, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == telemetry.STEP_COLUMNS and [r["rank"] for r in rows] == ["0", "1"]
    assert rows[0]["time"] == "1795996715.869", "timestamps keep millisecond precision"


def test_system_sampler_has_gpu_columns_only_for_visible_gpus(tmp_path):
    s = telemetry.SystemSampler(tmp_path / "system.csv", 0.05, None, [psutil.Process()])
    s.start()
    time.sleep(0.3)
    s.stop()
    with open(tmp_path / "system.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # The visible GPUs as CUDA counts them, not as the sampler's own NVML inventory does.
    gpus = [f"gpu{i}_{k}" for i in range(torch.cuda.device_count()) for k in ("util", "mem_used_mb", "mem_total_mb")]
    assert rows and list(rows[0]) == telemetry.SYSTEM_BASE_COLUMNS + gpus
    assert rows[0]["disk_read_mb_s"] == "" and float(rows[0]["rss_mb"]) > 10
