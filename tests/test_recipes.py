"""The recipe presets (config/recipes/*.yaml) are the published recipes: each FFCV preset, merged over
the reference box's config as `--configfile config/imagenet-2gpu.yaml config/recipes/<preset>.yaml`
merges it (schema defaults filled), gives at every optimizer step of full ImageNet the LR, and at
every epoch the resolution, that FFCV's published config values give under FFCV's own formulas -
computed through rectrain's make_optimizer (the scheduler the trainer steps) and resolution_at.

The oracle: FFCV's formulas rewritten here from libffcv/ffcv-imagenet train_imagenet.py at commit
4dd291a (get_cyclic_lr, the per-iteration np.interp in train_loop, get_resolution), over the values
copied from its rn50_configs/*.yaml and rn18_configs/*.yaml at that commit (lr_peak_epoch is absent
from them: train_imagenet.py's default, 2). torchvision's classic ResNet-50 is checked against
torch's own StepLR, which its references/classification/train.py steps once per epoch."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import REPO, copy_workflow, snakemake
from helpers.config_edits import filled

from rectrain import settings
from rectrain.config import SCHEMA_PATH
from rectrain.report.projection import IMAGENET_TRAIN
from rectrain.snakefile.checks import check_config
from rectrain.train.optim import make_optimizer
from rectrain.train.resolution import resolution_at

RECIPES = REPO / "config" / "recipes"
REFERENCE = REPO / "config" / "imagenet-2gpu.yaml"
DEMO = REPO / "config" / "config.yaml"

# libffcv/ffcv-imagenet @ 4dd291a, {rn50,rn18}_configs/<arch>_<epochs>_epochs.yaml: the values the
# schedules and the recipe depend on, as published (batch_size is per GPU, dist.world_size GPUs).
RN50 = {
    "lr": 1.7,
    "batch_size": 512,
    "world_size": 8,
    "min_res": 160,
    "max_res": 192,
    "weight_decay": 0.0001,
    "momentum": 0.9,
    "label_smoothing": 0.1,
    "use_blurpool": 1,
    "val_resolution": 256,
    "lr_tta": True,
    "arch": "resnet50",
    "max_side": 500,
    "jpeg_quality": 90,  # the README's `./write_imagenet.sh 500 0.50 90` (max side, compress share, quality)
}
# jpeg_quality: the README states the write command for ResNet-50's data only; its quality is assumed here.
RN18 = {
    **RN50,
    "lr": 0.5,
    "batch_size": 1024,
    "world_size": 1,
    "weight_decay": 5e-5,
    "arch": "resnet18",
    "max_side": 400,
}
FFCV = {
    "rn50-16ep": {**RN50, "epochs": 16, "start_ramp": 11, "end_ramp": 13},
    "rn50-24ep": {**RN50, "epochs": 24, "start_ramp": 17, "end_ramp": 20},
    "rn50-32ep": {**RN50, "epochs": 32, "start_ramp": 23, "end_ramp": 27},
    "rn50-40ep": {**RN50, "epochs": 40, "start_ramp": 29, "end_ramp": 34},
    "rn50-88ep": {**RN50, "epochs": 88, "start_ramp": 65, "end_ramp": 76},
    "rn18-16ep": {**RN18, "epochs": 16, "start_ramp": 11, "end_ramp": 13},
    "rn18-88ep": {**RN18, "epochs": 88, "start_ramp": 65, "end_ramp": 76},
}
FFCV_LR_PEAK_EPOCH = 2  # train_imagenet.py: Param(int, 'Epoch at which LR peaks', default=2)
# The README's "Configurations" table (top_1, time in minutes on 8x / 1x A100).
FFCV_PUBLISHED = {
    "rn50-16ep": (0.738, 14.9),
    "rn50-24ep": (0.756, 21.7),
    "rn50-32ep": (0.766, 28.7),
    "rn50-40ep": (0.772, 35.6),
    "rn50-88ep": (0.784, 77.2),
    "rn18-16ep": (0.669, 35.0),
    "rn18-88ep": (0.724, 187.3),
}
ALL_PRESETS = sorted(p.stem for p in RECIPES.glob("*.yaml"))


def preset(name: str, base=REFERENCE) -> dict:
    return filled(base, RECIPES / f"{name}.yaml")


def ffcv_cyclic_lr(epoch: int, v: dict) -> float:
    """get_cyclic_lr: np.interp([epoch], [0, lr_peak_epoch, epochs], [1e-4 * lr, lr, 0])[0]."""
    return np.interp([epoch], [0, FFCV_LR_PEAK_EPOCH, v["epochs"]], [1e-4 * v["lr"], v["lr"], 0])[0]


def ffcv_step_lrs(v: dict, iters: int) -> np.ndarray:
    """train_loop: each epoch's iterations interpolate from get_lr(epoch) to get_lr(epoch + 1)."""
    per_epoch = [
        np.interp(np.arange(iters), [0, iters], [ffcv_cyclic_lr(e, v), ffcv_cyclic_lr(e + 1, v)])
        for e in range(v["epochs"])
    ]
    return np.concatenate(per_epoch)


def ffcv_resolution(epoch: int, v: dict) -> int:
    """get_resolution: min_res through start_ramp, max_res from end_ramp, else the interpolation
    rounded to the nearest multiple of 32."""
    if epoch <= v["start_ramp"]:
        return v["min_res"]
    if epoch >= v["end_ramp"]:
        return v["max_res"]
    interp = np.interp([epoch], [v["start_ramp"], v["end_ramp"]], [v["min_res"], v["max_res"]])
    return int(np.round(interp[0] / 32)) * 32


def our_step_lrs(train: dict, global_batch: int, steps_per_epoch: int) -> np.ndarray:
    """The LR of every optimizer step as the trainer gets it: make_optimizer's scheduler, stepped. The
    optimizer steps once (no gradients: a no-op), so torch knows the order; the LR does not depend on it."""
    model = torch.nn.Linear(2, 2)
    s = settings.train(train)
    optimizer, scheduler, _ = make_optimizer(
        s.optim, model, global_batch, steps_per_epoch, family=s.network.model, precision=s.network.precision
    )
    optimizer.step()
    lrs = np.empty(train["epochs"] * steps_per_epoch)
    for step in range(len(lrs)):
        lrs[step] = optimizer.param_groups[0]["lr"]
        scheduler.step()
    return lrs


@pytest.mark.parametrize("name", sorted(FFCV))
def test_ffcv_preset_lr_at_every_step_of_imagenet_equals_ffcvs_schedule(name):
    """At the preset's global batch (FFCV's: batch_size x world_size), FFCV's loader drops the last
    partial batch: 1,281,167 // global_batch iterations per epoch."""
    v, cfg = FFCV[name], preset(name)
    global_batch = v["batch_size"] * v["world_size"]
    assert cfg["train"]["global_batch"] == global_batch
    iters = IMAGENET_TRAIN // global_batch
    ours = our_step_lrs(cfg["train"], global_batch, iters)
    theirs = ffcv_step_lrs(v, iters)
    np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-12)
    epoch_starts = ours[::iters]
    assert epoch_starts[0] == pytest.approx(1e-4 * v["lr"])
    assert epoch_starts[FFCV_LR_PEAK_EPOCH] == pytest.approx(v["lr"])


@pytest.mark.parametrize("name", ["rn50-40ep", "rn18-16ep"])
def test_ffcv_preset_lr_at_another_global_batch_is_ffcvs_scaled_linearly(name):
    """The reference box trains what fits: at a global batch of 256 every epoch starts at FFCV's LR
    x 256 / FFCV's batch (train.lr is for 256 and scales linearly)."""
    v, cfg = FFCV[name], preset(name)
    iters = IMAGENET_TRAIN // 256
    ours = our_step_lrs(dict(cfg["train"], global_batch=256), 256, iters)[::iters]
    scale = 256 / (v["batch_size"] * v["world_size"])
    theirs = np.array([ffcv_cyclic_lr(e, v) for e in range(v["epochs"])]) * scale
    np.testing.assert_allclose(ours, theirs, rtol=1e-9)


@pytest.mark.parametrize("name", sorted(FFCV))
def test_ffcv_preset_resolution_of_every_epoch_equals_ffcvs_schedule(name):
    v, cfg = FFCV[name], preset(name)
    train = cfg["train"]
    ours = [resolution_at(e, train["image_size"], train["progressive"]) for e in range(train["epochs"])]
    theirs = [ffcv_resolution(e, v) for e in range(v["epochs"])]
    assert ours == theirs
    assert ours[0] == 160 and ours[-1] == 192, "the ramp must reach FFCV's max_res"


RAMP_COMMENT = re.compile(r"progressive:\s*# (\d+) px through epoch (\d+), (\d+) px from epoch (\d+) ")


@pytest.mark.parametrize("name", sorted(FFCV))
def test_ffcv_preset_ramp_comment_states_the_epochs_get_resolution_gives(name):
    """The comment on `progressive:` names the last epoch at min_res and the first at max_res; they are
    derived here from FFCV's get_resolution over the preset's values, so the comment cannot drift."""
    v, text = FFCV[name], (RECIPES / f"{name}.yaml").read_text()
    found = RAMP_COMMENT.search(text)
    assert found, f"{name}.yaml: the progressive: comment must read '<min> px through epoch N, <max> px from epoch M '"
    theirs = [ffcv_resolution(e, v) for e in range(v["epochs"])]
    last_min = max(e for e, px in enumerate(theirs) if px == v["min_res"])
    first_max = theirs.index(v["max_res"])
    assert tuple(int(g) for g in found.groups()) == (v["min_res"], last_min, v["max_res"], first_max)


@pytest.mark.parametrize("name", sorted(FFCV))
def test_ffcv_preset_sets_ffcvs_optimizer_model_and_test_values(name):
    v, cfg = FFCV[name], preset(name)
    train, ev = cfg["train"], cfg["evaluate"]
    assert (train["model"], train["epochs"], train["lr_schedule"]) == (v["arch"], v["epochs"], "linear")
    assert (train["momentum"], train["nesterov"], train["weight_decay"]) == (v["momentum"], False, v["weight_decay"])
    assert (train["label_smoothing"], train["blurpool"]) == (v["label_smoothing"], bool(v["use_blurpool"]))
    assert train["decay_norm_and_bias"] is False, "FFCV: bn_wd 0"
    assert (ev["resolutions"][0], ev["flip_tta"], train["val_resolution"]) == (v["val_resolution"], v["lr_tta"], 256)
    assert train["image_size"] == v["max_res"]
    # FFCV's written longest side (write_imagenet.sh); a 4:3 image's shorter side then stays above the
    # shorter side the test crop resizes to
    assert (cfg["pack"]["resize"], cfg["pack"]["max_side"]) == (0, v["max_side"])
    assert v["max_side"] * 3 / 4 >= round(v["val_resolution"] / 0.875), "the test crop's shorter side is never upscaled"
    assert cfg["pack"]["quality"] == v["jpeg_quality"]


@pytest.mark.parametrize("name", sorted(FFCV))
def test_ffcv_preset_recipe_block_states_the_published_top1_and_time(name):
    top1, minutes = FFCV_PUBLISHED[name]
    recipe = preset(name)["recipe"]
    assert (recipe["name"], recipe["published_top1"], recipe["reference_minutes"]) == (name, top1, minutes)
    assert recipe["epochs"] == FFCV[name]["epochs"] and "ffcv-imagenet" in recipe["source"]


def test_torchvision_preset_steps_the_lr_at_epochs_30_and_60_as_torch_steplr_does():
    """torchvision's train.py: StepLR(step_size=30, gamma=0.1), stepped once per epoch, from lr 0.1 at
    8 GPUs x batch 32; ours steps per optimizer step, so every step of epoch e has StepLR's epoch-e LR."""
    cfg = preset("tv-rn50-90ep")
    train = cfg["train"]
    assert (train["global_batch"], train["epochs"], train["lr_schedule"]) == (256, 90, "step")
    iters = IMAGENET_TRAIN // 256
    ours = our_step_lrs(train, 256, iters).reshape(90, iters)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    steplr = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.1)
    theirs = []
    for _ in range(90):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        steplr.step()
    np.testing.assert_allclose(ours, np.repeat(np.array(theirs)[:, None], iters, axis=1), rtol=1e-9)
    assert (train["warmup_epochs"], train["label_smoothing"], train["decay_norm_and_bias"]) == (0, 0.0, True)
    assert (cfg["evaluate"]["resolutions"], cfg["evaluate"]["flip_tta"]) == ([224], False)
    assert cfg["recipe"]["published_top1"] == 0.7613


@pytest.mark.parametrize("base", [REFERENCE, DEMO], ids=["imagenet-2gpu", "demo"])
@pytest.mark.parametrize("name", ALL_PRESETS)
def test_every_preset_validates_over_the_reference_and_the_demo_config(name, base, tmp_path):
    cfg = preset(name, base)  # fill_defaults raises ConfigError naming any bad key
    # every check the Snakefile makes (ConfigError naming each problem), the reference's HDD and SSD
    # paths, which this machine has not, replaced by ones it has
    here = copy.deepcopy(cfg)
    here["raw"], here["pack"]["fast_storage"] = None, str(tmp_path)
    check_config(here, SCHEMA_PATH, workdir=tmp_path)
    assert cfg["recipe"]["name"] == name and cfg["recipe"]["published_top1"] is not None
    assert cfg["raw"] == (None if base == DEMO else "/data/hdd/ILSVRC2012"), "a preset names no dataset"


def test_presets_cover_the_issues_list():
    """FFCV's and torchvision's (issue 30), today's (issue 49: tests/test_recipes_today.py)."""
    assert ALL_PRESETS == sorted([*FFCV, "tv-rn50-90ep", "rsb-a3-rn50", "deit-s", "convnext-t"])


# A preset shortened on the command line, as a user tries one on the demo before committing a box to it:
# 3 epochs, a 32 -> 64 px ramp, tiny demo data without planted defects (its few images would exceed the
# pack's skipped-share limit), batch 16 per device and a global batch of 64 (grad_accum 2, 2 processes),
# as the few_steps finding advises for a small set: at the preset's 1024 an epoch of 120 images is padded
# to one whole optimizer step of 1024 (issue 46), and that one step at the preset's peak LR of 0.5 sends a
# 5-class loss to 10 - a divergence the run rightly stops for (issue 51).
SHORTENED = [
    "train={epochs: 3, image_size: 64, val_resolution: 64, batch_size: 16, global_batch: 64,"
    " progressive: {min_res: 32, max_res: 64, start_ramp: 0, end_ramp: 2}}",
    "evaluate={resolutions: [64]}",
    "demo={classes: 5, train_per_class: 24, val_per_class: 4, bad_files: false}",
]


@pytest.mark.slow
def test_a_preset_shortened_on_the_command_line_runs_the_demo_and_reports_time_to_accuracy(tmp_path):
    """The workdir pattern of tests/test_pipeline_e2e.py (a copy of the workflow), one run."""
    work = copy_workflow(tmp_path / "work")
    proc = snakemake(
        "--directory", str(work), "--cores", "2", "results/report.html",
        "--configfile", "config/recipes/rn18-16ep.yaml", "--config", *SHORTENED,
        cwd=work, snakefile=work / "Snakefile", timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    html = (work / "results" / "report.html").read_text()
    panel = html[html.index('<section id="time-to-accuracy">') : html.index('<section id="diagnosis">')]
    assert "published top-1, 16 epochs<b>66.9 %</b>" in panel and "rn18_configs/rn18_16_epochs.yaml" in panel
    assert "not the recipe's 16" in panel, "3 epochs are not the published recipe: the panel says so"
    assert "projected: full ImageNet on this hardware, 3 epochs" in panel  # the demo's classes are WordNet ids
    assert '<table id="per-resolution">' in panel and "steady img/s (measured)" in panel
    epochs = pd.read_csv(work / "results" / "demo" / "main" / "train" / "epochs.csv")
    run = json.loads((work / "results" / "demo" / "main" / "train" / "run.json").read_text())
    assert len(epochs) == 3 and run["config"]["progressive"]["max_res"] == 64 and run["config"]["blurpool"]
    assert (
        epochs["resolution"].tolist()
        == [resolution_at(e, run["config"]["image_size"], run["config"]["progressive"]) for e in range(3)]
        == [32, 64, 64]
    )
    assert "32 px" in panel and "64 px" in panel
    assert (run["batch_size"], run["grad_accum"], run["global_batch"], run["recipe_global_batch"]) == (
        16,
        2,
        64,
        64,
    )
    assert "Global batch 64" in panel, "the global batch set on the command line is the run's recipe"
    assert 'id="finding-few_steps"' in html, "the Diagnosis says why the shortened preset's top-1 is no result"
