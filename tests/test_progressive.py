"""train.progressive end to end on CPU: both loaders crop each epoch to the schedule's resolution, on
every rank, a resumed epoch too; the preflight and the batch plan size for the largest; epochs.csv,
run.json and the report carry the resolution."""

import json
import os
import subprocess
import sys
from collections import defaultdict
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from helpers import failure_text
from helpers.synthetic_run import REPORT_CFG, make_calibration, write_run
from helpers.train_data import (
    config_json,
    packed_dataset,
    rank_parts,
    rows,
    tiny_train_settings,
    train_loader_spec,
    write_rec,
)
from helpers.views import report_html

from rectrain.distributed import Dist
from rectrain.loaders import LoaderSpec
from rectrain.loaders.dali import DaliLoader
from rectrain.loaders.pytorch import TorchLoader
from rectrain.report import efficiency, load
from rectrain.train.batchplan import preflight_inputs
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle.status import EXIT_STOPPED
from rectrain.train.resolution import resolutions
from rectrain.train.run import make_model
from rectrain.train.telemetry import STEP_COLUMNS

LOADERS = {"dali": DaliLoader, "torch": TorchLoader}
# 3 epochs ramping 32 -> 96 px: FFCV's rounding puts epoch 1 on 64
RAMP = {"min_res": 32, "max_res": 96, "start_ramp": 0, "end_ramp": 2}
# Tiny and fast on a CPU; batch 4 over 2 ranks: 6 steps per epoch; 2 calibration steps after 1 warm-up
# fit in half of one epoch's steps, so every resolution is calibrated.
FAST = {
    "model": "squeezenet1_1",
    "precision": "fp32",
    "batch_size": 4,
    "epochs": 3,
    "progressive": RAMP,
    "calibration_steps": 2,
    "calibration_warmup_steps": 1,
}
SCHEDULE = resolutions(32, RAMP, 3)


def test_the_ramp_used_here_has_three_distinct_resolutions():
    assert SCHEDULE == [32, 64, 96]  # the tests below would prove less with a repeated one


@pytest.fixture(scope="module")
def id_rec(tmp_path_factory):
    return write_rec(tmp_path_factory.mktemp("ids"), list(range(23)))


def spec(rec, **kw):
    return LoaderSpec(*rec, batch_size=4, image_size=48, rank=1, world_size=2, workers=1, **kw)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_each_epoch_yields_crops_of_its_scheduled_size_and_validation_keeps_image_size(id_rec, kind):
    loader = LOADERS[kind](spec(id_rec, crops=tuple(SCHEDULE)))
    for epoch, size in enumerate(SCHEDULE):
        shapes = {tuple(x.shape[1:]) for x, _ in loader.epoch(epoch)}
        assert shapes == {(3, size, size)}, f"epoch {epoch}"
    val = LOADERS[kind](spec(id_rec, crops=tuple(SCHEDULE), train=False))
    assert {tuple(x.shape[1:]) for x, _ in val.epoch(2)} == {(3, 48, 48)}


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_schedule_at_image_size_yields_exactly_the_batches_of_no_schedule(id_rec, kind):
    plain = [(x, y) for x, y in LOADERS[kind](spec(id_rec)).epoch(1)]
    same = [(x, y) for x, y in LOADERS[kind](spec(id_rec, crops=(48, 48, 48))).epoch(1)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(plain, same, strict=True))


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_an_epoch_resumed_mid_way_yields_the_uninterrupted_batches_at_its_resolution(id_rec, kind):
    make = LOADERS[kind]
    crops = tuple(SCHEDULE)
    ref = [(x.clone(), y.clone()) for x, y in make(spec(id_rec, crops=crops)).epoch(1)]
    first = make(spec(id_rec, crops=crops))
    head = []
    for x, y in first.epoch(1):
        head.append((x.clone(), y.clone()))
        if len(head) == 2:
            break
    rest = [(x.clone(), y.clone()) for x, y in make(spec(id_rec, crops=crops)).epoch(1, 2, first.state())]
    got = head + rest
    assert len(got) == len(ref) == 3 and ref[0][0].shape[-1] == 64
    for k, ((xa, ya), (xb, yb)) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(ya, yb) and torch.equal(xa, xb), f"batch {k} differs after the resume"


def test_the_preflight_sizes_the_step_and_the_loaders_for_the_largest_resolution():
    """On a GPU rank (the device is only named: nothing is allocated) the trial step and the loaders'
    reservations of a 32 -> 96 px run equal those of a fixed 96 px run (validating at 32 px as the
    ramped run does), and not those of 32 px."""
    d = Dist(0, 2, 0, 2, torch.device("cuda:0"))

    def inputs(**over):
        cfg = tiny_train_settings(**over)
        model, loss, _ = make_model(cfg.network, 5, torch.device("cpu"))
        trial, held = preflight_inputs(d, rank_parts(cfg, model, loss, d), cfg.optim, cfg.network)
        return trial.image_size, [r.bytes(8) for r in held if r]

    ramped = inputs(image_size=32, epochs=3, progressive=RAMP)
    fixed = inputs(image_size=96, val_resolution=32)  # validation stays at image_size under a schedule
    assert ramped == fixed and ramped[0] == 96
    assert inputs(image_size=32)[1][0] < ramped[1][0], "the train loader's batches are larger at 96 px"


def test_the_train_loader_spec_carries_the_schedule_and_none_without_one():
    cfg = tiny_train_settings(image_size=32, epochs=3, progressive=RAMP)
    train = train_loader_spec(cfg, Dist(1, 2, 1, 2, torch.device("cpu")), "t.rec", "t.idx", workers=1)
    assert [train.crop_at(e) for e in range(3)] == SCHEDULE and train.largest_crop == 96
    assert train_loader_spec(tiny_train_settings(), Dist(0, 1, 0, 1, torch.device("cpu")), "", "", 1).crops == ()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_dataset(tmp_path_factory.mktemp("packed"))


def run_train(data, out, env_extra=None, **cfg):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", config_json(**{**FAST, **cfg}), *data]
    return subprocess.run(
        [*cmd, "--out", str(out), "--threads", "2"], env=env, capture_output=True, text=True, timeout=300
    )


def shapes_seen(folder):
    """{(rank, epoch): the set of (height, width) of its batches} from RECTRAIN_RECORD_SHAPES."""
    seen = defaultdict(set)
    for path in sorted(folder.glob("shapes_rank*.csv")):
        rank = int(path.stem.removeprefix("shapes_rank"))
        for line in path.read_text().splitlines():
            epoch, _step, h, w = map(int, line.split(","))
            seen[rank, epoch].add((h, w))
    return dict(seen)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """An uninterrupted 2-rank gloo run per loader, with the batch shapes each rank trained on."""
    done = {}
    for kind in sorted(LOADERS):
        root = tmp_path_factory.mktemp(f"run_{kind}")
        (root / "shapes").mkdir()
        proc = run_train(data, root / "t", {"RECTRAIN_RECORD_SHAPES": str(root / "shapes")}, loader=kind)
        assert proc.returncode == 0, failure_text(proc.stderr)
        done[kind] = SimpleNamespace(out=root / "t", shapes=shapes_seen(root / "shapes"), log=proc.stderr)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_every_rank_trains_each_epoch_at_the_schedules_resolution_and_the_outputs_record_it(runs, kind):
    run = runs[kind]
    want = {(rank, e): {(size, size)} for rank in (0, 1) for e, size in enumerate(SCHEDULE)}
    assert run.shapes == want
    assert [int(r["resolution"]) for r in rows(run.out / "epochs.csv")] == SCHEDULE
    info = json.loads((run.out / "run.json").read_text())
    assert info["loader"] == kind and info["resolutions"] == SCHEDULE and info["progressive"] == RAMP
    cal = info["calibration"]
    assert sorted(cal["by_resolution"], key=int) == ["32", "64", "96"] and not cal["skipped"]
    for rank, rate in cal["images_per_s"].items():  # the run's ceiling: the epochs' harmonic mean
        per_epoch = [cal["by_resolution"][str(r)]["images_per_s"][rank] for r in SCHEDULE]
        assert rate == pytest.approx(3 / sum(1 / v for v in per_epoch))
    assert "epoch 1 (64 px)" in run.log and "calibration at 96 px:" in run.log


@pytest.mark.slow
def test_a_run_stopped_mid_epoch_resumes_that_epoch_at_its_resolution_with_the_uninterrupted_weights(
    data, runs, tmp_path
):
    (tmp_path / "shapes").mkdir()
    env = {"RECTRAIN_SIGNAL_AT": "1:1:2", "RECTRAIN_RECORD_SHAPES": str(tmp_path / "shapes")}
    stopped = run_train(data, tmp_path / "t", env, loader="dali")
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    (tmp_path / "shapes" / "shapes_rank0.csv").unlink()
    (tmp_path / "shapes" / "shapes_rank1.csv").unlink()
    resumed = run_train(data, tmp_path / "t", {"RECTRAIN_RECORD_SHAPES": str(tmp_path / "shapes")}, loader="dali")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    seen = shapes_seen(tmp_path / "shapes")
    assert seen[0, 1] == seen[1, 1] == {(64, 64)} and seen[0, 2] == {(96, 96)} and (0, 0) not in seen
    assert [int(r["resolution"]) for r in rows(tmp_path / "t" / "epochs.csv")] == SCHEDULE
    ref, got = ckpt.load(runs["dali"].out / "model.pt"), ckpt.load(tmp_path / "t" / "model.pt")
    for k in ref["model"]:
        assert torch.equal(ref["model"][k], got["model"][k]), f"{k} differs from the uninterrupted run"


def test_the_report_shows_time_per_epoch_and_img_s_at_each_resolution(tmp_path):
    paths = write_run(tmp_path, epochs=3)
    train = paths["train"]
    epochs = pd.read_csv(train / "epochs.csv").assign(resolution=SCHEDULE[:2] + [64], wall_s=[10.0, 30.0, 50.0])
    epochs.to_csv(train / "epochs.csv", index=False)
    run = json.loads((train / "run.json").read_text())
    by = {str(r): make_calibration({0: 100.0 * k, 1: 100.0 * k}) for k, r in ((4, 32), (2, 64))}
    run["calibration"] = {**make_calibration({0: 1.0, 1: 1.0}), "by_resolution": by}
    (train / "run.json").write_text(json.dumps(run))
    data = load(train, paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    html = report_html(data, {"dataset": "demo", "report": dict(REPORT_CFG), "train": {}}, repo=tmp_path)
    times = html[html.index('id="per-resolution"') :].split("</table>")[0]
    cells = [row.split("</td>") for row in times.split("<tr>")[2:]]
    assert [c[0].rsplit(">", 1)[1] for c in cells] == ["32 px", "64 px"]
    assert [c[1].rsplit(">", 1)[1] for c in cells] == ["1", "2"]
    assert [c[3].rsplit(">", 1)[1] for c in cells] == ["10 s", "40 s"], "the mean epoch time at each"
    table = html[html.index('id="efficiency-per-resolution"') :].split("</table>")[0]
    cells = [row.split("</td>") for row in table.split("<tr>")[2:]]
    assert [c[0].rsplit(">", 1)[1] for c in cells] == ["32", "64"]
    assert [c[3].rsplit(">", 1)[1] for c in cells] == ["800.0", "400.0"], "each resolution's own calibration"


def test_each_epochs_input_efficiency_is_held_against_its_own_resolutions_calibration():
    by = {str(r): make_calibration({0: 100.0 * k}) for k, r in ((4, 32), (2, 64))}
    cal = {**make_calibration({0: 200.0}), "resolutions": [32, 64], "by_resolution": by}
    eff = efficiency.input_efficiency(pd.DataFrame(columns=STEP_COLUMNS), {"calibration": cal})
    assert [efficiency.epoch_ceiling(eff, e) for e in (0, 1)] == [400.0, 200.0]
    plain = efficiency.Efficiency((efficiency.RankRate(0, 50.0, 200.0),), None, make_calibration({0: 200.0}))
    assert efficiency.epoch_ceiling(plain, 1) == 200.0, "without a schedule: the run's calibration"
