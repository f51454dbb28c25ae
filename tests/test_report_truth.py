"""The report tells the truth about small and custom runs (issue 27): findings when a run learned
nothing, and no tile that misleads - a full-ImageNet time for a 5-class dataset, top-5 of 5 classes,
an input efficiency above 1, a "wnid" column of folder names, a .png "named as JPEG", a resumed run
that does not say so."""

import re

import pandas as pd
import pytest
from helpers.synthetic_run import REPORT, REPORT_CFG, write_run, write_small_custom_run
from helpers.views import report_html

from rectrain.report import learning, load
from rectrain.report.inputs import repair_reason
from rectrain.report.projection import imagenet_like


def config():
    return {"dataset": "demo", "report": dict(REPORT_CFG), "train": {"model": "resnet18", "epochs": 4}}


def loaded(paths):
    return load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("small")
    data = loaded(write_small_custom_run(tmp))
    return data, report_html(data, config(), repo=tmp)


def section(html: str, name: str) -> str:
    start = html.index(f'<section id="{name}">')
    return html[start : html.index("</section>", start)]


def test_a_run_that_learned_nothing_gets_the_three_learning_findings_with_numbers_and_fixes(small):
    data, html = small
    found = {f.id: f for f in learning.findings(data, REPORT)}
    assert set(found) == {"few_steps", "chance_accuracy", "one_class_predicted"}
    steps = found["few_steps"]
    assert steps.severity == "critical" and "1 optimizer step(s) per epoch" in steps.measured
    assert "global batch 256 over 150 train images" in steps.measured and "106 images repeated" in steps.measured
    assert steps.threshold == "report.min_steps_per_epoch = 4 optimizer steps per epoch"
    assert "train.batch_size: 18" in steps.fix, "150 images / (2 processes x 4 steps)"
    chance = found["chance_accuracy"]
    assert "val top-1 20.0 % on 50 val images after 4 epoch(s); chance is 20.0 % (5 classes" in chance.measured
    assert "report.chance_factor = 1.5" in chance.threshold and "too few optimizer steps" in chance.fix
    one = found["one_class_predicted"]
    assert "answered cat for 50 of 50 val images (100.0 %); that class is 20.0 %" in one.measured
    assert "report.one_class_share = 50 %" in one.threshold and "train.lr" in one.fix
    diagnosis = section(html, "diagnosis")
    for fid in found:
        assert f'id="finding-{fid}"' in diagnosis
    assert 'id="finding-no_problems"' not in diagnosis


def test_a_run_with_a_set_global_batch_is_told_a_global_batch_the_dataset_fills(tmp_path):
    """train.global_batch set (a preset's 1024, say): a smaller batch_size would keep it (issue 36)."""
    data = loaded(write_small_custom_run(tmp_path, recipe_global_batch=256))
    steps = next(f for f in learning.findings(data, REPORT) if f.id == "few_steps")
    assert "Set train.global_batch: 36" in steps.fix, "150 images over 2 processes x 4 steps: 18 x 2"


@pytest.mark.parametrize("zero_init", [True, False])
def test_a_run_at_chance_with_zero_init_residual_is_told_the_value_to_try(tmp_path, zero_init):
    data = loaded(write_small_custom_run(tmp_path, config={"zero_init_residual": zero_init}))
    chance = next(f for f in learning.findings(data, REPORT) if f.id == "chance_accuracy")
    assert ("try train.zero_init_residual: false" in chance.fix) is zero_init


def test_a_run_that_learned_has_no_learning_findings(tmp_path):
    """The synthetic healthy run: 20 steps per epoch, top-1 57.5 % of 4 classes, predictions spread."""
    paths = write_run(tmp_path)
    data = loaded(paths)
    pc = data.per_class
    data.per_class = pc.assign(predicted=pc["images"])  # evaluate's column: each class predicted as often as it is
    assert learning.findings(data, REPORT) == []


def test_no_full_imagenet_projection_for_a_five_class_custom_dataset_and_every_time_is_labelled_projected(small):
    data, html = small
    assert not imagenet_like(data.classes)
    summary = section(html, "summary")
    assert "full ImageNet" not in summary.replace("No full-ImageNet projection", "")
    assert "No full-ImageNet projection: this dataset is not ImageNet-like" in summary
    assert "projected: this run, 4 epochs" in summary


def test_a_custom_dataset_gets_its_time_per_epoch_per_resolution_and_no_full_imagenet_column(small):
    _, html = small
    panel = section(html, "time-to-accuracy")
    assert "<th>training per epoch (measured)</th>" in panel and "full ImageNet training per epoch" not in panel
    assert "not shown: this dataset is not ImageNet-like" in panel


def test_imagenet_like_means_classes_named_by_wordnet_ids():
    wnids = pd.DataFrame({"wnid": [f"n{i:08d}" for i in range(1000)]})
    assert imagenet_like(wnids) and imagenet_like(wnids.head(10)), "ImageNet, or a subset of its classes"
    assert not imagenet_like(wnids.assign(wnid=[f"class{i}" for i in range(1000)]))
    assert not imagenet_like(pd.DataFrame({"wnid": ["cat", "dog", "n01440764"]})), "one folder name is enough"


def test_top5_of_five_classes_is_not_shown_as_a_result(small):
    _, html = small
    summary = section(html, "summary")
    assert 'id="top5-trivial"' in summary and "5 classes: 5 guesses hold (nearly) every class" in summary
    assert "100.0 %" not in summary, "metrics.json's top-5 of 1.0 is not quoted"
    assert "val top-5" not in section(html, "learning")


def test_efficiency_above_one_is_capped_in_the_headline_then_noise_with_the_spread_then_the_calibration(small):
    _, html = small
    # steady 2 x 128 images per 0.5 s = 512 img/s against 2 x 194 calibrated
    assert f"{512 / 388:.2f}" == "1.32"
    summary, throughput = section(html, "summary"), section(html, "throughput")
    assert "input efficiency<b>1.00</b><small>measured 1.32: noise</small>" in summary
    assert re.search(r'<div class="kpi headline">input efficiency\s*<b>1.00</b>', throughput)
    noise = throughput[throughput.index('id="efficiency-noise"') :]
    assert "Measured 1.32, shown as 1.00" in noise and "measurement noise" in noise
    assert "single epochs measured 1.32 to 1.32" in noise, "every synthetic epoch ran at the same speed"
    assert "1.32).</span> Calibration: " in noise, "the next sentence starts after a space"


def test_class_columns_are_named_for_what_they_hold(small, tmp_path):
    _, html = small
    classes = section(html, "classes")
    assert "<th>class (folder)</th>" in classes and "<th>wnid</th>" not in classes
    assert "<th>name</th>" not in classes, "every name is empty: no empty column"
    imagenet = report_html(loaded(write_run(tmp_path)), config(), repo=tmp_path)
    assert "<th>wnid</th><th>name</th>" in section(imagenet, "classes")


def test_repair_reasons_match_the_file_name():
    png_reason = "PNG content named as JPEG re-encoded as JPEG"
    assert repair_reason("train/owl/photo.png", png_reason) == "PNG file re-encoded as JPEG"
    assert repair_reason("train/n01/x.JPEG", png_reason) == png_reason, "a .JPEG holding a PNG is named as JPEG"
    assert repair_reason("a.tar::n01/x.jpg", png_reason) == png_reason
    assert repair_reason("train/owl/cmyk.png", "CMYK converted to RGB") == "CMYK converted to RGB"


def test_the_report_lists_a_real_png_as_a_png_file(small):
    _, html = small
    data = section(html, "data")
    assert "train/owl/photo.png</td><td>PNG file re-encoded as JPEG" in data
    assert "named as JPEG" not in html


def test_a_resumed_run_says_from_where(small, tmp_path):
    _, html = small
    assert (
        '<span id="resumed">(resumed: epochs 2 onwards trained by this job, continuing checkpoints/last.pt '
        "written after epoch 1)</span>" in section(html, "summary")
    )
    fresh = report_html(loaded(write_run(tmp_path)), config(), repo=tmp_path)
    assert 'id="resumed"' not in fresh


def test_a_run_resumed_after_stopping_on_divergence_says_where_it_diverged(tmp_path):
    """run.json's diverged_before (rectrain.train.lifecycle.divergence's diverged.json, carried by the resume)."""
    import json

    paths = write_run(tmp_path)
    run_json = paths["train"] / "run.json"
    diverged = {"where": "epoch 1 step 4 of 6", "epoch": 1, "step": 3, "lr": 1000000.0, "scale": None, "loss": "nan"}
    run_json.write_text(
        json.dumps({**json.loads(run_json.read_text()), "resumed_from_epoch": 1, "diverged_before": diverged})
    )
    html = section(report_html(loaded(paths), config(), repo=tmp_path), "summary")
    assert (
        '<span id="diverged">stopped on divergence before: at epoch 1 step 3 (lr 1e+06, loss nan), stopped at '
        "epoch 1 step 4 of 6; resumed from the last good checkpoint</span>" in html
    )


def test_a_run_whose_number_of_processes_changed_lists_each_with_its_epoch(tmp_path):
    import json

    paths = write_run(tmp_path)
    run_json = paths["train"] / "run.json"
    sizes = [
        {"epoch": 0, "world_size": 2, "batch_size": 4, "grad_accum": 1},
        {"epoch": 1, "world_size": 1, "batch_size": 4, "grad_accum": 2},
    ]
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "world_sizes": sizes}))
    html = section(report_html(loaded(paths), config(), repo=tmp_path), "summary")
    assert (
        '<span id="world-sizes">(the number of processes changed, the global batch kept: epoch 0: 2 process(es), '
        "4 x grad_accum 1; epoch 1: 1 process(es), 4 x grad_accum 2)</span>" in html
    )
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "world_sizes": sizes[:1]}))
    assert 'id="world-sizes"' not in report_html(loaded(paths), config(), repo=tmp_path), "unchanged: not said"


def test_stage_cpu_and_memory_come_from_the_stages_own_processes(tmp_path):
    """The pack's manifest, run.json and metrics.json carry rectrain.usage's numbers; Snakemake's
    benchmark (CPU 8.0 s and RSS 500-504 MB in helpers.synthetic_run) stays only for index_raw."""
    import json

    from rectrain import usage

    paths = write_run(tmp_path)
    own = {"cpu_s": 123.4, "max_rss_mb": 876.5, "processes": 1, "measured_by": usage.WHAT}
    for f in (paths["pack"] / "train.manifest.json", paths["train"] / "run.json", paths["eval"] / "metrics.json"):
        f.write_text(json.dumps({**json.loads(f.read_text()), "usage": own}))
    html = report_html(loaded(paths), config(), repo=tmp_path)
    rows = dict(re.findall(r"<tr><td>([a-z_ ]+)</td>(.*?)</tr>", section(html, "stages"), flags=re.S))
    for stage in ("pack train", "train", "evaluate"):
        assert '<td class="n">123.4</td>' in rows[stage] and "876.5" in rows[stage] and "getrusage" in rows[stage]
    assert "Snakemake benchmark (samples every 30 s)" in rows["index_raw"] and "123.4" not in rows["index_raw"]
    assert "Snakemake benchmark" in rows["pack val"], "the val manifest here records no usage"


def test_usage_of_this_process_is_measured_and_ranks_combine():
    from rectrain import usage

    me = usage.own()
    assert me["cpu_s"] > 0 and me["max_rss_mb"] > 10 and me["processes"] == 1
    both = usage.combined([me, me])
    assert both["cpu_s"] == pytest.approx(2 * me["cpu_s"]) and both["processes"] == 2
    assert "summed over the ranks" in both["measured_by"]
