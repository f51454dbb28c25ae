"""Today's backbone recipes (issue 49 item 8): config/recipes/rsb-a3-rn50.yaml, deit-s.yaml and convnext-t.yaml
hold their sources' values - ResNet strikes back's A3 column (arXiv 2110.00476, Table 1), DeiT's main.py
defaults and README command, ConvNeXt's TRAINING.md command and main.py defaults, copied below - and
the peak LR each gives at its source's global batch, through the trainer's make_optimizer, is the source's.
Then each preset, shortened on the command line, runs the demo through Snakemake on two CPU processes:
trained, evaluated (the raw and the EMA weights where train.ema is on) and reported with its recipe; the
three share one working directory, so the demo is generated, indexed and packed once."""

from __future__ import annotations

import io
import json
import math

import pandas as pd
import pytest
import torch
from helpers import REPO, copy_workflow, snakemake
from helpers.config_edits import filled
from markupsafe import escape

from rectrain import settings
from rectrain.train.optim import make_optimizer

RECIPES = REPO / "config" / "recipes"
REFERENCE = REPO / "config" / "imagenet-2gpu.yaml"

# The sources' values (their flag names), as published.
SOURCES = {
    "rsb-a3-rn50": {
        "model": "timm:resnet50",
        "epochs": 100,
        "batch": 2048,
        "opt": "lamb",
        "lr": 8e-3,
        "weight_decay": 0.02,
        "warmup_epochs": 5,
        "smoothing": 0.0,
        "bce": True,
        "bce_target_thresh": 0.2,
        "mixup": 0.1,
        "cutmix": 1.0,
        "aa": "rand-m6-mstd0.5-inc1",
        "reprob": 0.0,
        "drop_path": None,
        "ema": 0.0,
        "train_size": 160,
        "test_size": 224,
        "crop_pct": 0.95,
        "repeats": 1,  # Table 1: repeated augmentation in A1 and A2, not A3
        "top1": 0.781,
    },
    "deit-s": {
        "model": "timm:deit_small_patch16_224",
        "epochs": 300,
        "batch": 4 * 256,
        "opt": "adamw",
        "lr": 5e-4 * 4 * 256 / 512,  # main.py: args.lr x batch x world size / 512
        "weight_decay": 0.05,
        "warmup_epochs": 5,
        "smoothing": 0.1,
        "bce": False,
        "bce_target_thresh": None,
        "mixup": 0.8,
        "cutmix": 1.0,
        "aa": "rand-m9-mstd0.5-inc1",
        "reprob": 0.25,
        "drop_path": 0.1,
        "ema": 0.99996,
        "train_size": 224,
        "test_size": 224,
        "crop_pct": 0.875,
        "repeats": 3,  # --repeated-aug, on by default; samplers.py's RASampler: 3 copies
        "top1": 0.798,
    },
    "convnext-t": {
        "model": "timm:convnext_tiny",
        "epochs": 300,
        "batch": 8 * 128 * 4,  # TRAINING.md: 8 GPUs x --batch_size 128 x --update_freq 4
        "opt": "adamw",
        "lr": 4e-3,
        "weight_decay": 0.05,
        "warmup_epochs": 20,
        "smoothing": 0.1,
        "bce": False,
        "bce_target_thresh": None,
        "mixup": 0.8,
        "cutmix": 1.0,
        "aa": "rand-m9-mstd0.5-inc1",
        "reprob": 0.25,
        "drop_path": 0.1,
        "ema": 0.9999,
        "train_size": 224,
        "test_size": 224,
        "crop_pct": 0.875,
        "repeats": 1,  # main.py: torch's DistributedSampler
        "top1": 0.821,
    },
}
# Which weights each published top-1 is of: RSB A3 has no EMA, DeiT evaluates its trained weights, the
# ConvNeXt README's weights are the EMA's (convnext_tiny_1k_224_ema.pth).
RESULT = {"rsb-a3-rn50": "raw", "deit-s": "raw", "convnext-t": "ema"}


def preset(name: str) -> dict:
    return filled(REFERENCE, RECIPES / f"{name}.yaml")


def peak_lr(train: dict, global_batch: int) -> float:
    """The peak LR the trainer's optimizer gets at this global batch (make_optimizer's groups' initial_lr)."""
    s = settings.train(train)
    optimizer = make_optimizer(
        s.optim, torch.nn.Linear(2, 2), global_batch, 10, family=s.network.model, precision=s.network.precision
    )[0]
    return optimizer.param_groups[0]["initial_lr"]


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_preset_holds_its_sources_values_and_its_peak_lr_at_the_sources_batch(name):
    v, cfg = SOURCES[name], preset(name)
    train, ev = cfg["train"], cfg["evaluate"]
    assert (train["model"], train["epochs"], train["global_batch"], train["optimizer"]) == (
        v["model"],
        v["epochs"],
        v["batch"],
        v["opt"],
    )
    assert peak_lr(train, v["batch"]) == pytest.approx(v["lr"], rel=1e-12)
    assert (train["weight_decay"], train["warmup_epochs"], train["lr_schedule"]) == (
        v["weight_decay"],
        v["warmup_epochs"],
        "cosine",
    )
    assert train["label_smoothing"] == v["smoothing"] and (train["loss"] == "bce") == v["bce"]
    assert train["bce_target_threshold"] == v["bce_target_thresh"]
    assert (train["mixup"]["mixup_alpha"], train["mixup"]["cutmix_alpha"]) == (v["mixup"], v["cutmix"])
    assert (train["mixup"]["prob"], train["mixup"]["switch_prob"], train["mixup"]["mode"]) == (1.0, 0.5, "batch")
    assert train["augment"]["policy"] == v["aa"] and train["augment"]["reprob"] == v["reprob"]
    assert train["augment"]["remode"] == "pixel" and train["augment"]["recount"] == 1
    assert train["model_args"].get("drop_path_rate") == v["drop_path"]
    assert train["ema"]["decay"] == v["ema"] and (train["ema"]["result"] == "ema") == (RESULT[name] == "ema")
    assert train["image_size"] == v["train_size"] and train["progressive"] is None
    assert train["repeated_aug"] == v["repeats"]
    crop = ev["crop"] or ev["resolutions"][0]
    resize = ev["resize"] or round(crop / 0.875)
    assert crop == v["test_size"] and resize == round(v["test_size"] / v["crop_pct"]) and not ev["flip_tta"]
    assert (cfg["recipe"]["name"], cfg["recipe"]["published_top1"], cfg["recipe"]["epochs"]) == (
        name,
        v["top1"],
        v["epochs"],
    )


def test_rsb_a3s_lr_scales_with_the_square_root_of_the_global_batch_as_timm_scales_lamb():
    """At the reference box's batch of 256 the preset's LAMB runs at 8e-3 / sqrt(8), timm's rule for LAMB;
    DeiT's and ConvNeXt's AdamW at theirs scaled linearly, as DeiT scales it."""
    assert peak_lr(preset("rsb-a3-rn50")["train"], 256) == pytest.approx(8e-3 / math.sqrt(8))
    assert peak_lr(preset("deit-s")["train"], 256) == pytest.approx(1e-3 / 4)
    assert peak_lr(preset("convnext-t")["train"], 256) == pytest.approx(4e-3 / 16)


# Each preset shortened on the command line: 1 epoch at 32 px, a global batch of 16 (8 per process, 2
# processes), no calibration, a demo of 4 classes x 12 images without planted defects; each network its
# family at about 0.5 M parameters through timm's own constructor arguments (ResNet-50's bottlenecks one
# per stage at a quarter of the widths, ConvNeXt-T's blocks one per stage, DeiT-S two of its twelve blocks
# at 32 px, 2 x 2 patches): the recipe's optimizer, loss, batch augmentation and EMA see a network of the
# same kinds of parameters, without the 22-28 M that cost this module most of its minutes in checkpoints;
# the test crop 32 px from a shorter side of 34 (RSB's 0.95 ratio). What the run shows is the recipe's
# mechanics, not its accuracy.
SHORT = {
    "rsb-a3-rn50": "{layers: [1, 1, 1, 1], channels: [16, 32, 64, 128], stem_width: 16}",
    "deit-s": "{drop_path_rate: 0.1, img_size: 32, depth: 2}",
    "convnext-t": "{drop_path_rate: 0.1, depths: [1, 1, 1, 1], dims: [24, 48, 96, 192]}",
}


def shortened(name: str) -> list[str]:
    train = (
        "train={epochs: 1, image_size: 32, val_resolution: 32, batch_size: 8, global_batch: 16, calibration_steps: 0,"
        f" warmup_epochs: 0, model_args: {SHORT[name]}}}"
    )
    demo = "demo={classes: 4, train_per_class: 12, val_per_class: 4, bad_files: false}"
    return [train, "evaluate={crop: 32, resize: 34, resolutions: [null]}", demo]


OUTPUTS = ("report.html", "train/run.json", "train/epochs.csv", "eval/metrics.json", "train/weights.json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{preset: {output name: its text}} after each preset's run, one after the other in one working
    directory (the pack is shared: every preset packs the same way), with the weights files each run left."""
    work = copy_workflow(tmp_path_factory.mktemp("today"))
    results = {}
    for name in SOURCES:
        proc = snakemake(
            "--directory", str(work), "--cores", "2", "results/report.html",
            "--configfile", f"config/recipes/{name}.yaml", "--config", *shortened(name),
            cwd=work, snakefile=work / "Snakefile", timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        demo = work / "results" / "demo" / "main"  # the run named main (issue 50)
        results[name] = {out: (demo / out).read_text() for out in OUTPUTS}
        results[name]["weights files"] = sorted(p.name for p in (demo / "train").glob("weights*.safetensors"))
        results[name]["rec written"] = (work / "results" / "fast_storage" / "demo" / "train.rec").stat().st_mtime_ns
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_preset_shortened_on_the_command_line_trains_evaluates_and_reports_the_demo_with_its_recipe(runs, name):
    out, v = runs[name], SOURCES[name]
    run = json.loads(out["train/run.json"])
    as_run = run["recipe_as_run"]
    assert run["model"] == v["model"] and as_run["optimizer"]["class"] == {"lamb": "Lamb", "adamw": "AdamW"}[v["opt"]]
    assert ("BinaryCrossEntropy" in as_run["loss"]) == v["bce"] and "Mixup alpha" in as_run["batch_augment"]["mixup"]
    assert (as_run["batch_augment"]["random_erasing"] is None) == (v["reprob"] == 0)
    rule = "sqrt" if name == "rsb-a3-rn50" else "linear"
    assert (
        as_run["optimizer"]["lr_scaling"].startswith(rule) and "at global batch 16" in as_run["optimizer"]["lr_scaling"]
    )
    html = out["report.html"]
    assert f"published top-1, {v['epochs']} epochs<b>{100 * v['top1']:.1f} %</b>" in html
    assert 'id="recipe-training"' in html and "rand-m" in html
    assert escape(as_run["optimizer"]["lr_scaling"]) in html and escape(as_run["ema"] or "off") in html
    # deit-s's 3 repeats on the shortened demo's 48 records (under 256: all of them, 3 steps of 16 an epoch)
    assert (as_run["repeated_aug"] is not None) == (v["repeats"] > 1) and run["batches_per_epoch"] == 3
    assert f"<th>train.repeated_aug</th><td>{escape(as_run['repeated_aug'] or 'off')}</td>" in html
    metrics = json.loads(out["eval/metrics.json"])
    epochs = pd.read_csv(io.StringIO(out["train/epochs.csv"]))
    if v["ema"]:
        assert out["weights files"] == ["weights-ema.safetensors", "weights-raw.safetensors", "weights.safetensors"]
        variants = metrics["variants"]
        assert {k: variants[k]["result"] for k in variants} == {
            "raw": RESULT[name] == "raw",
            "ema": RESULT[name] == "ema",
        }
        assert variants[RESULT[name]]["top1"] == metrics["top1"], "the headline is weights.safetensors, the result"
        weights_json = json.loads(out["train/weights.json"])
        assert weights_json["variant"]["weights"] == RESULT[name] and set(weights_json["variants"]) == {"raw", "ema"}
        assert epochs["ema_val_single_view_top1"].notna().all(), "the EMA validated each epoch"
        assert 'id="eval-variants"' in html and "<th>EMA's val top-1</th>" in html
    else:
        assert out["weights files"] == ["weights.safetensors"] and "variants" not in metrics
        assert epochs["ema_val_single_view_top1"].isna().all()


@pytest.mark.slow
def test_the_three_presets_share_one_pack_of_the_demo(runs):
    assert len({runs[name]["rec written"] for name in SOURCES}) == 1, "packed once, by the first preset's run"
