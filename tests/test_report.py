"""The report built from synthetic stage outputs: every section, escaped user data, no external URLs."""

import base64
import dataclasses
import html as html_module
import io
import json
import re
from html import unescape
from html.parser import HTMLParser

import pandas as pd
import pytest
from helpers.synthetic_run import REPORT_CFG, make_calibration, write_run
from helpers.views import report_html, view
from PIL import Image

from rectrain.recordio import IRHeader, RecordWriter, pack_record
from rectrain.report import load
from rectrain.report.__main__ import main as report_main
from rectrain.report.inputs import sample_image_sizes

SECTIONS = [
    "summary",
    "time-to-accuracy",
    "diagnosis",
    "throughput",
    "utilization",
    "learning",
    "classes",
    "data",
    "stages",
    "provenance",
]
TWO_GPUS = {0: (90.0, 7000.0, 11264.0), 1: (40.0, 7000.0, 11264.0)}


class Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.ids, self.urls = [], set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name == "id":
                self.ids.add(value)
            if name in ("src", "href", "action", "poster", "srcset", "data"):
                self.urls.append(value or "")


def config(ds="demo"):
    return {"dataset": ds, "report": dict(REPORT_CFG), "train": {"model": "resnet18", "epochs": 2}}


def render(tmp_path, **kw):
    paths = write_run(tmp_path, **kw)
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    return report_html(data, config(), repo=tmp_path)


@pytest.fixture(scope="module")
def problem_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("problem")
    return render(
        tmp,
        gpus=TWO_GPUS,
        wait_share={0: 0.02, 1: 0.60},
        iowait=45.0,
        rotational=True,
        skipped=[{"id": 7, "source": "train/n1/<b>bad</b>.JPEG", "reason": "truncated JPEG"}],
        repaired=[{"id": 9, "source": "train/n1/cmyk.JPEG", "reason": "CMYK converted to RGB"}],
    )


def test_every_section_is_present(problem_report):
    parsed = Tags()
    parsed.feed(problem_report)
    assert set(SECTIONS) <= parsed.ids
    for title in (
        "Summary",
        "Throughput",
        "Utilization",
        "Learning",
        "Classes",
        "Data",
        "Stages",
        "Diagnosis",
        "Provenance",
    ):
        assert f"<h2>{title}</h2>" in problem_report


def test_class_names_and_paths_from_data_are_escaped(problem_report):
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in problem_report
    assert "<script" not in problem_report.lower()
    assert "train/n1/&lt;b&gt;bad&lt;/b&gt;.JPEG" in problem_report
    assert "<b>bad</b>" not in problem_report


def test_report_is_self_contained(problem_report):
    parsed = Tags()
    parsed.feed(problem_report)
    assert parsed.urls, "expected embedded images and in-page links"
    for url in parsed.urls:
        assert url.startswith("data:image/png;base64,") or url.startswith("#"), url[:80]
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", problem_report)
    assert "link" not in parsed.tags and "script" not in parsed.tags and "iframe" not in parsed.tags


def test_embedded_plots_decode_as_png(problem_report):
    uris = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', problem_report)
    # throughput, step split, GPU, CPU/io, learning, worst and best classes, stages
    assert len(uris) == 7
    for b64 in uris:
        img = Image.open(io.BytesIO(base64.b64decode(b64)))
        img.load()
        assert img.width > 300 and img.height > 100


def test_diagnosis_shows_each_finding_with_numbers(problem_report):
    for fid in (
        "rank_imbalance",
        "input_bound",
        "high_iowait",
        "rec_on_rotational",
        "images_skipped",
        "images_repaired",
    ):
        assert f'id="finding-{fid}"' in problem_report
    assert "rank 1 waits on data 60.0 % of its step time, rank 0 2.0 %" in problem_report
    assert "iowait mean 45.0 %" in problem_report
    assert "No problems found" not in problem_report


def test_summary_data_and_stage_numbers(problem_report):
    assert "57.5 %" in problem_report  # metrics.json top-1
    assert 'id="top5-trivial"' in problem_report and "95.0 %" not in problem_report, "4 classes: no top-5"
    assert "cuda:0, cuda:1" in problem_report
    assert "pack train 20.0 s" in problem_report and "pack val 30.0 s" in problem_report  # per stage
    assert "150 s" in problem_report  # pipeline total
    # rank 1 computes 32 images in 0.4 x 0.5 s (160 img/s); rank 0's compute includes waiting for it
    assert '<td class="n">160.0</td>' in problem_report
    assert "320.0 img/s if the model never waited" in problem_report
    assert "NVIDIA GeForce RTX 2080 Ti" in problem_report and "535.54.03" in problem_report
    assert "truncated JPEG" in problem_report and "CMYK converted to RGB" in problem_report
    assert "<b>yes (HDD)</b>" in problem_report
    assert "data_wait_share: 0.2" in problem_report  # the config used


def test_data_section_says_how_each_split_was_stored(tmp_path):
    paths = write_run(tmp_path, wait_share={0: 0.01})
    train = paths["pack"] / "train.manifest.json"
    train.write_text(json.dumps({**json.loads(train.read_text()), "max_side": 500, "quality": 90}))
    html = report_html(
        load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo"),
        config(),
    )
    data = html[html.index('<section id="data">') :]
    assert "<td>longest side 500 px (larger ones re-encoded at q90)</td>" in data
    assert "<td>original size</td>" in data  # val: resize 0, no max_side


def test_an_existing_pair_with_a_kept_png_says_so_and_counts_its_records_per_format(tmp_path):
    paths = write_run(tmp_path, wait_share={0: 0.01})
    train = paths["pack"] / "train.manifest.json"
    existing = {
        "rec": "/data/train.rec",
        "idx": "/data/train.idx",
        "lst": None,
        "bytes": 1000,
        "checked_records": 36,
        "decode_ms_per_image": 0.5,
        "label_runs": 30,
        "expected_if_shuffled": 24.0,
        "published": "symlinked",
        "kept_unusual": [{"id": 17, "reason": "PNG content named as JPEG re-encoded as JPEG"}],
        "formats": {"JPEG": 35, "PNG": 1},
    }
    train.write_text(json.dumps({**json.loads(train.read_text()), "existing": existing}))
    html = report_html(
        load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo"),
        config(),
    )
    data = " ".join(html[html.index('id="existing-train"') :].split())
    assert "1 image(s) the pack would have re-encoded are kept as they are (DALI's decoder read each of them)" in data
    assert "e.g. record 17: PNG content named as JPEG re-encoded as JPEG." in data
    assert "Records per format: JPEG 35, PNG 1." in data


def test_a_resolution_sweep_shows_one_row_per_resolution_and_names_the_headline(tmp_path):
    paths = write_run(tmp_path)
    rows = [
        {"top1": 0.6125, "top5": 0.95, "loss": 1.05, "images": 40, "images_per_s": 300.0, "crop": 256, "resize": 293},
        {"top1": 0.5875, "top5": 0.925, "loss": 1.1, "images": 40, "images_per_s": 400.0, "crop": 224, "resize": 256},
    ]
    metrics = {
        **rows[0],
        "loader": "dali",
        "checkpoint": "model.pt",
        "flip_tta": True,
        "resolutions": rows,
        "num_classes": 10,
    }
    (paths["eval"] / "metrics.json").write_text(json.dumps(metrics))
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    html = report_html(data, config(), repo=tmp_path)
    assert "top-1 61.25 %, top-5 95.00 % on 40 val images at 256 px (shorter side 293, centre crop, flip TTA)" in html
    table = _between(html, '<table id="eval-resolutions">', "</table>")
    cells = [re.sub(r"\s+", " ", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", table)]
    assert cells == [
        *("256 px (headline)", "293", "61.25 %", "95.00 %", "1.0500", "40", "300"),
        *("224 px", "256", "58.75 %", "92.50 %", "1.1000", "40", "400"),
    ]
    # each epoch's validation is labelled as not the final protocol (issue 36)
    note = re.sub(r"\s+", " ", _between(html, '<p class="muted" id="epoch-val-protocol">', "</p>"))
    assert "one centre crop at 64 px (train.val_resolution), no flip TTA - not the final evaluation's protocol" in note
    assert "with its mirror's at 256 px" in note
    assert "<th>val top-1 (single view)</th>" in html


def test_one_resolution_is_named_in_the_summary_without_a_table(tmp_path):
    paths = write_run(tmp_path)
    row = {"top1": 0.575, "top5": 0.95, "loss": 1.1, "images": 40, "images_per_s": 400.0, "crop": 64, "resize": 73}
    metrics = {
        **row,
        "loader": "dali",
        "checkpoint": "model.pt",
        "flip_tta": False,
        "resolutions": [row],
        "num_classes": 10,
    }
    (paths["eval"] / "metrics.json").write_text(json.dumps(metrics))
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    html = report_html(data, config(), repo=tmp_path)
    assert "on 40 val images at 64 px (shorter side 73, centre crop) (dali loader" in html
    assert 'id="eval-resolutions"' not in html
    note = re.sub(r"\s+", " ", _between(html, '<p class="muted" id="epoch-val-protocol">', "</p>"))
    assert note.strip().endswith("one centre crop at 64 px (train.val_resolution), no flip TTA."), (
        "the final protocol's"
    )


def test_healthy_cpu_only_run_says_no_problems_and_has_no_gpu_plot(tmp_path):
    html = render(tmp_path, gpus=None, evil=False)
    assert "No problems found" in html
    assert "No GPU telemetry" in html
    assert len(re.findall(r'src="data:image/png', html)) == 6
    assert "unknown (not a git checkout)" in html  # tmp_path is no git checkout: tolerated


def test_benchmark_na_values_and_missing_system_rows_are_tolerated(tmp_path):
    paths = write_run(tmp_path)
    (paths["benchmarks"] / "demo_data").mkdir()
    (paths["benchmarks"] / "demo_data" / "demo.tsv").write_text(
        "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
        "0.4100\t0:00:00.41\tNA\tNA\tNA\tNA\tNA\tNA\tNA\tNA\n"
    )
    (paths["train"] / "system.csv").write_text("time,cpu_percent,iowait_percent,disk_read_mb_s,rss_mb\n")
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    assert set(data.benchmarks["rule"]) == {"demo_data", "index_raw", "pack train", "pack val", "train", "evaluate"}
    html = report_html(data, config(), repo=tmp_path)
    assert "demo_data 0.4 s" in html


def test_cli_writes_the_report(tmp_path):
    paths = write_run(tmp_path)
    out = tmp_path / "results" / "report.html"
    rc = report_main(
        [
            "--config-json",
            json.dumps(config()),
            "--train-dir",
            str(paths["train"]),
            "--eval-dir",
            str(paths["eval"]),
            "--pack-dir",
            str(paths["pack"]),
            "--index-dir",
            str(paths["index"]),
            "--benchmarks",
            str(paths["benchmarks"]),
            "--out",
            str(out),
        ]
    )
    assert rc == 0 and out.read_text().startswith("<!DOCTYPE html>")
    assert not [p.name for p in out.parent.iterdir() if ".tmp" in p.name], "a temporary file was left beside the report"


def _cli(paths, out, config_json: str) -> int:
    dirs = [f"--{k}-dir={paths[k]}" for k in ("train", "eval", "pack", "index")]
    return report_main(
        ["--config-json", config_json, *dirs, "--benchmarks", str(paths["benchmarks"]), "--out", str(out)]
    )


def test_cli_completes_a_partial_config_from_the_schema_and_names_a_wrong_key(tmp_path, capsys):
    paths = write_run(tmp_path)
    out = tmp_path / "report.html"
    assert _cli(paths, out, '{"dataset": "demo"}') == 0
    html = out.read_text()
    assert "<title>rectrain report - demo</title>" in html  # the schema's default title
    assert "input_efficiency: 0.9" in html  # defaults shown under the config used
    out.unlink()
    assert _cli(paths, out, '{"dataset": "demo", "report": {"input_eficiency": 0.8}}') == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "[report] invalid configuration" in err and "unknown config key 'report.input_eficiency'" in err


def test_missing_stage_output_names_the_stage(tmp_path):
    paths = write_run(tmp_path)
    (paths["eval"] / "metrics.json").unlink()
    with pytest.raises(FileNotFoundError, match="evaluate"):
        load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")


def test_provenance_names_the_pipeline_code_commit_wherever_the_workdir_is(tmp_path, monkeypatch):
    from rectrain.report.build import CODE_REPO

    if not (CODE_REPO / ".git").exists():
        pytest.skip(f"{CODE_REPO} is not a git checkout")
    paths = write_run(tmp_path)
    monkeypatch.chdir(tmp_path)  # like snakemake --directory elsewhere
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    html = report_html(data, config())
    assert re.search(r"git commit</th><td>[0-9a-f]{40}", html)


# --- input efficiency: the Throughput section's headline -----------------------------------------------


def test_throughput_headline_is_the_input_efficiency_per_rank_and_overall(tmp_path):
    # make_steps: 64.0 img/s per rank on real data; the calibration measured 80.0 on synthetic data
    calibration = make_calibration({0: 80.0, 1: 80.0})
    html = render(tmp_path, wait_share={0: 0.01, 1: 0.01}, run_overrides={"calibration": calibration})
    headline = html[html.index('id="efficiency-headline"') : html.index('<img class="plot" alt="images per second')]
    assert "<b>0.80</b>" in headline
    assert "128.0 img/s on real data / 160.0 img/s on synthetic data" in headline
    assert "data wait<b>1.0 %</b>" in headline
    assert "20 steps per rank after 5 warm-up steps at batch 128, 3.5 s" in html
    row = re.search(r"<tr><td>1</td>.*?</tr>", html, re.S).group(0)
    assert '<td class="n">64.0</td><td class="n">80.0</td><td class="n">0.80</td>' in row
    assert 'id="finding-contention"' in html  # 0.80 < 0.90 with no data wait


def test_report_of_a_run_without_calibration_says_not_measured(tmp_path):
    html = render(tmp_path)  # make_run writes no calibration, like run.json files before it existed
    headline = html[html.index('id="efficiency-headline"') :]
    assert "<b>not measured</b><small>not measured: run.json has no calibration" in headline
    assert "No problems found" in html


def test_resize_advice_quotes_the_pixels_of_images_sampled_from_the_rec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # manifest .rec paths are relative to the workdir, as in the pipeline
    rec = tmp_path / "results/fast_storage/demo/train.rec"
    rec.parent.mkdir(parents=True)
    with RecordWriter(rec, rec.with_suffix(".idx")) as w:
        for i, size in enumerate([(400, 300), (300, 400), (200, 150)]):
            buf = io.BytesIO()
            Image.new("RGB", size, (i * 60, 90, 160)).save(buf, "JPEG", quality=90)
            w.write(i, pack_record(IRHeader(0, float(i), i, 0), buf.getvalue()))
    assert sample_image_sizes({"rec": str(rec)}).values.tolist() == [[400, 300], [300, 400], [200, 150]]
    assert sample_image_sizes({"rec": "missing.rec"}) is None
    calibration = make_calibration({0: 80.0, 1: 80.0})
    html = render(tmp_path, wait_share={0: 0.01, 1: 0.01}, run_overrides={"calibration": calibration})
    # image_size 64 -> pack.resize 80: 0.12, 0.12, 0.03 Mpx -> 0.0085, 0.0085, 0.0085 Mpx
    assert "pack.resize: 80, now pass-through): the packed images average 0.09 Mpx (sample of 3)" in html
    assert "0.01 Mpx at 80 px on the shorter side, so about 91 % less decode work" in html


# --- a full ImageNet run stays readable: 90 epochs, 1000 classes -----------------------------------------

FULL_RUN_LIMIT_BYTES = 2_000_000


@pytest.fixture(scope="module")
def full_run_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    return render(tmp, epochs=90, steps=10, classes=1000, evil=False)


def test_full_run_report_stays_small(full_run_report):
    assert len(full_run_report.encode()) < FULL_RUN_LIMIT_BYTES


def test_long_run_plots_are_bands_per_epoch_and_short_runs_bands_over_time(full_run_report):
    from helpers.synthetic_run import make_steps, make_system

    from rectrain.report import plots

    long_steps = make_steps({0: 0.02, 1: 0.03}, epochs=90, steps=10)
    axis = plots.time_axis(long_steps, make_system(450))
    assert axis.label == "epoch"
    data = plots.throughput_over_time(long_steps, axis)
    # one row per (series, epoch): 90 epochs x (total, rank 0, rank 1), not 1,800 step points
    assert len(data) == 270 and sorted(data["x"].unique()) == list(range(90))
    assert set(data.columns) == {"series", "x", "lo", "mid", "hi"}
    total = data[data["series"] == "total"]
    assert (total["mid"] == 128.0).all() and (total["lo"] <= total["mid"]).all() and (total["mid"] <= total["hi"]).all()
    for alt in ("images per second per epoch", "data-wait share per epoch", "disk reads per epoch"):
        assert f"{alt} (median and 10-90th percentile band)" in full_run_report

    short = plots.time_axis(make_steps({0: 0.0}), make_system())
    assert short.label == "time since start (s)"
    assert plots.throughput_over_time(make_steps({0: 0.0}), short)["x"].nunique() <= 61


def _between(html: str, start: str, end: str) -> str:
    return html[html.index(start) : html.index(end, html.index(start))]


def test_full_run_epoch_table_is_a_summary_with_the_whole_table_behind_a_toggle(full_run_report):
    learning = _between(full_run_report, '<section id="learning">', "</section>")
    shown, rest = learning.split('<details id="all-epochs">')
    # first 3, every 15th, last 3 and the best (the last here): 11 rows, the 79 others behind the toggle
    epochs = re.findall(r"<tr(?: class=\"best\")?><td>(\d+)", shown)
    assert epochs == ["0", "1", "2", "14", "29", "44", "59", "74", "87", "88", "89"]
    assert shown.count('class="gap"') == 6 and "&hellip; 14 epoch(s) &hellip;" in shown
    assert "<summary>All 90 epochs</summary>" in rest
    assert len(re.findall(r"<tr(?: class=\"best\")?><td>\d+", rest)) == 90
    assert "89 (best val top-1)" in shown


def test_full_run_shows_worst_best_confused_and_a_finder_for_every_class(full_run_report):
    classes = _between(full_run_report, '<section id="classes">', "</section>")
    worst = _between(classes, 'id="worst-classes"', 'id="best-classes"')
    best = _between(classes, 'id="best-classes"', 'id="confused-pairs"')
    assert "Worst classes (10 of 1000)" in worst and "Best classes (10 of 1000)" in best
    acc = [[float(a) for a in re.findall(r'<td class="n">([\d.]+) %</td>', part)] for part in (worst, best)]
    assert len(acc[0]) == len(acc[1]) == 10
    assert acc[0] == sorted(acc[0]) and acc[1] == sorted(acc[1], reverse=True) and max(acc[0]) < min(acc[1])
    pairs = _between(classes, 'id="confused-pairs"', 'id="class-finder"')
    counts = [int(c) for c in re.findall(r'<td class="n">(\d+)</td><td class="n">[\d.]+ %</td>', pairs)]
    assert len(counts) == 10 and counts == sorted(counts, reverse=True) and counts[0] > 0
    finder = classes[classes.index('<details id="class-finder">') :]
    wnids = re.findall(r"<tr><td>\d+</td><td>(n\d{8})</td>", finder)
    assert len(wnids) == 1000 and wnids == sorted(wnids)


# --- the time projection: measured throughput -> this run and full ImageNet ---------------------------------


def test_time_projection_from_a_run_of_known_throughput(tmp_path):
    """2 ranks x 32 images per 0.5 s step; 2 epochs of 20 steps, 10 s each in epochs.csv: 128 img/s over the
    finished epochs' wall clock; evaluation 400 img/s on 40 images (helpers.synthetic_run); full ImageNet:
    1,281,167 train and 50,000 val images (its 4 classes are WordNet ids: a subset of ImageNet)."""
    from rectrain.report.projection import project

    paths = write_run(tmp_path)
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    p = project(data.steps, data.epochs, data.run, data.metrics)
    assert p.train_img_s == pytest.approx(128.0) and p.val_img_s == 400.0 and p.ranks == 2
    assert (p.run.train_images, p.run.val_images, p.run.epochs) == (1280, 40, 2)
    assert p.run.train_s == pytest.approx(10.0) and p.run.val_s == pytest.approx(0.1)
    assert p.run.run_s == pytest.approx(2 * 10.1)
    assert (p.imagenet.train_images, p.imagenet.val_images, p.imagenet.epochs) == (1_281_167, 50_000, 2)
    assert p.imagenet.train_s == pytest.approx(1_281_167 / 128) and p.imagenet.val_s == pytest.approx(125.0)
    assert p.imagenet.run_s == pytest.approx(2 * (1_281_167 / 128 + 125))  # 20,268.2 s
    assert p.measured_run_s == 20 * 60 and p.measured_train_s == 10.0 and p.wall_clock

    html = report_html(data, config(), repo=tmp_path)
    summary = html[html.index('<section id="summary">') : html.index('<section id="diagnosis">')]
    head = summary[summary.index('<div id="projection">') :]
    assert head.index("full ImageNet, 2 epochs<b>5 h 37 min</b><small>2 h 48 min per epoch") < head.index("<table>")
    assert "this run, 2 epochs<b>20 s</b><small>10 s per epoch" in head
    assert "At the measured <b>128.0 img/s</b> (the headline throughput: the finished epochs' wall clock" in head
    assert "the evaluate stage's 400.0 img/s" in head
    assert "(1,281,167 train and 50,000 val images)" in head
    assert "(2 h 46 min training, 2 min 05 s validation)" in head  # 10,009 s and 125 s


def test_one_headline_throughput_defined_on_the_page_and_the_projection_uses_the_epochs_wall_clock(tmp_path):
    """The steps ran at 128 img/s steady, but the epochs took 40 s each on the wall clock (another program
    ran: epochs.csv says so, 32 img/s): the headline, the projection and the time for full ImageNet all use
    32 img/s; the other rates are labelled for what they are."""
    from rectrain.report.projection import project

    paths = write_run(tmp_path)
    epochs_csv = paths["train"] / "epochs.csv"
    pd.read_csv(epochs_csv).assign(wall_s=40.0, images_per_s=1280 / 40.0).to_csv(epochs_csv, index=False)
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    p = project(data.steps, data.epochs, data.run, data.metrics)
    assert p.train_img_s == pytest.approx(32.0) and p.run.train_s == pytest.approx(40.0)
    assert p.imagenet.train_s == pytest.approx(1_281_167 / 32.0)
    html = report_html(data, config(), repo=tmp_path)
    summary = html[html.index('<section id="summary">') : html.index('<section id="time-to-accuracy">')]
    kpi = summary[summary.index('id="headline-throughput"') :]
    assert kpi.startswith('id="headline-throughput">training<b>32.0 img/s</b>')
    assert set(re.findall(r"<b>([\d.]+) img/s</b>", summary)) == {"32.0"}, "one throughput in bold: the headline"
    defined = unescape(summary[summary.index('id="throughput-defined"') :])
    assert "<b>32.0 img/s</b>: images trained per second of the finished epochs' wall clock" in defined
    assert "128.0 img/s steady (each epoch's first step left out" in defined
    assert "At the measured <b>32.0 img/s</b>" in summary and "steady training<b>" not in summary


def test_a_live_page_without_a_finish_time_or_finished_epochs_has_no_stray_dash(tmp_path):
    from rectrain.report.projection import project

    paths = write_run(tmp_path, run_overrides={"finished": None})
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    data = dataclasses.replace(data, epochs=data.epochs.iloc[:0])
    p = project(data.steps, data.epochs, data.run, data.metrics)
    assert not p.wall_clock and p.train_img_s == pytest.approx(128.0), "steady, until an epoch has finished"
    html = report_html(data, config(), repo=tmp_path)
    assert "(measured: -" not in html and "- from start to finish" not in html
    assert "steady, all 2 rank(s): no epoch has finished yet" in html


def test_no_imagenet_projection_for_a_run_of_imagenet_size(tmp_path):
    from rectrain.report.projection import project

    paths = write_run(tmp_path, epochs=1)
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    full = data.steps.assign(images=32_100)  # 2 ranks x 20 steps x 32,100 = 1,284,000 images per epoch
    p = project(full, data.epochs, data.run, data.metrics)
    assert p.run.train_images == 1_284_000 and p.imagenet is None


# --- time to accuracy: per-resolution rates and a preset's published top-1 beside the projection -----------

RN50_40 = {
    "name": "rn50-40ep",
    "published_top1": 0.772,
    "epochs": 40,
    "source": "FFCV (libffcv/ffcv-imagenet @ 4dd291a): README Configurations table, rn50_configs/rn50_40_epochs.yaml",
    "reference_hardware": "8x A100",
    "reference_minutes": 35.6,
}


def progressive_run(tmp_path):
    """4 epochs of 20 steps, 2 ranks x 32 images: epochs 0-1 at 160 px with 0.5 s steps (128 img/s),
    epochs 2-3 at 192 px with 0.75 s steps (85.3 img/s); epochs.csv's wall 10 s and 15 s."""
    paths = write_run(tmp_path, epochs=4)
    steps_csv, epochs_csv = paths["train"] / "steps.csv", paths["train"] / "epochs.csv"
    steps = pd.read_csv(steps_csv)
    steps.loc[steps["epoch"] >= 2, "wall_s"] = 0.75
    steps.to_csv(steps_csv, index=False)
    epochs = pd.read_csv(epochs_csv).assign(resolution=[160, 160, 192, 192], wall_s=[10.0, 10.0, 15.0, 15.0])
    epochs = epochs.assign(images_per_s=1280 / epochs["wall_s"])  # 2 ranks x 20 steps x 32 images an epoch
    epochs.to_csv(epochs_csv, index=False)
    run = json.loads((paths["train"] / "run.json").read_text())
    (paths["train"] / "run.json").write_text(json.dumps({**run, "epochs": 4, "image_size": 192}))
    return load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")


def test_time_per_epoch_at_each_resolution_is_measured_from_its_own_epochs(tmp_path):
    from rectrain.report.projection import per_resolution

    data = progressive_run(tmp_path)
    rows = per_resolution(data.steps, data.epochs, data.run)
    assert [(r.resolution, r.epochs) for r in rows] == [(160, 2), (192, 2)]
    assert rows[0].train_img_s == pytest.approx(128.0) and rows[1].train_img_s == pytest.approx(64 / 0.75)
    assert (rows[0].epoch_s, rows[1].epoch_s) == (10.0, 15.0)
    assert rows[1].imagenet_epoch_s == pytest.approx(1_281_167 / (64 / 0.75))


def test_without_a_resolution_column_every_epoch_counts_at_train_image_size(tmp_path):
    from rectrain.report.projection import per_resolution

    paths = write_run(tmp_path)
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    rows = per_resolution(data.steps, data.epochs, data.run)
    assert [(r.resolution, r.epochs, r.epoch_s) for r in rows] == [(64, 2, 10.0)]
    assert rows[0].train_img_s == pytest.approx(128.0)
    html = report_html(data, config(), repo=tmp_path)
    panel = html[html.index('<section id="time-to-accuracy">') : html.index('<section id="diagnosis">')]
    assert 'id="tta-no-recipe"' in panel and "train.image_size (epochs.csv records no resolution)" in panel


def test_a_preset_run_shows_the_published_top1_beside_full_imagenets_projected_time(tmp_path):
    """Full ImageNet: 2 epochs at 128 img/s and 2 at 85.3 img/s of 1,281,167 images = 50,046 s of
    training; 4 x 50,000 val images at the evaluate stage's 400 img/s = 500 s."""
    from rectrain.report.projection import per_resolution, time_to_accuracy

    data = progressive_run(tmp_path)
    rows = per_resolution(data.steps, data.epochs, data.run)
    t = time_to_accuracy(view("recipe", RN50_40), rows, data.epochs, data.run, data.metrics, like_imagenet=True)
    assert t.schedule == ((160, 2), (192, 2)) and t.note is None and t.shortened
    assert t.train_s == pytest.approx(2 * 1_281_167 / 128 + 2 * 1_281_167 * 0.75 / 64)
    assert t.val_s == pytest.approx(500.0) and t.total_s == pytest.approx(t.train_s + 500.0)

    html = report_html(data, {**config(), "recipe": RN50_40}, repo=tmp_path)
    panel = html[html.index('<section id="time-to-accuracy">') : html.index('<section id="diagnosis">')]
    assert "published top-1, 40 epochs<b>77.2 %</b>" in panel
    assert "projected: full ImageNet on this hardware, 4 epochs<b>14 h 02 min</b>" in panel  # 50,546 s
    assert "published time<b>35 min 36 s</b><small>on 8x A100" in panel
    assert "2 epoch(s) at 160 px, 2 epoch(s) at 192 px" in panel and "rn50_configs/rn50_40_epochs.yaml" in panel
    assert 'id="tta-shortened"' in panel and "not the recipe's 40" in panel
    assert "epochs.csv's resolution column" in panel
    table = panel[panel.index('<table id="per-resolution">') :]
    assert table.index("160 px") < table.index("192 px") and "85.3" in table and "128.0" in table


@pytest.mark.parametrize("ran, asked", [(512, 4096), (4096, 4096)])
def test_time_to_accuracy_says_plainly_when_the_global_batch_that_ran_is_not_the_recipes(tmp_path, ran, asked):
    data = progressive_run(tmp_path)
    data.run.update(global_batch=ran, recipe_global_batch=asked, batch_size=ran // 2, grad_accum=1)
    html = report_html(data, {**config(), "recipe": RN50_40}, repo=tmp_path)
    panel = html[html.index('<section id="time-to-accuracy">') : html.index('<section id="diagnosis">')]
    if ran != asked:
        assert "This run trained at a global batch of 512, not the recipe's 4096" in panel
        assert "256 per device x grad_accum 1 x 2 process(es)" in panel and "another recipe" in panel
    else:
        assert "Global batch 4096, the recipe's." in panel and "not the recipe's 4096" not in panel


def test_a_preset_on_a_dataset_not_like_imagenet_shows_the_published_top1_without_a_projection(tmp_path):
    from rectrain.report.projection import per_resolution, time_to_accuracy

    data = progressive_run(tmp_path)
    rows = per_resolution(data.steps, data.epochs, data.run, like_imagenet=False)
    t = time_to_accuracy(view("recipe", RN50_40), rows, data.epochs, data.run, data.metrics, like_imagenet=False)
    assert t.total_s is None and "not ImageNet-like" in t.note
    assert all(r.imagenet_epoch_s is None for r in rows) and rows[0].train_img_s == pytest.approx(128.0)


def test_a_schedule_resolution_without_a_measured_rate_is_named_instead_of_projected(tmp_path):
    """run.json says 5 epochs, epochs.csv has 4 (160/192 px): the fifth counts at image_size 224,
    where nothing was measured."""
    from rectrain.report.projection import per_resolution, time_to_accuracy

    data = progressive_run(tmp_path)
    run = {**data.run, "epochs": 5, "image_size": 224}
    t = time_to_accuracy(
        view("recipe", RN50_40),
        per_resolution(data.steps, data.epochs, run),
        data.epochs,
        run,
        data.metrics,
        like_imagenet=True,
    )
    assert t.train_s is None and t.note == "no steady training rate measured at 224 px"


def test_a_recipe_block_with_only_a_name_renders_with_the_missing_values_marked(tmp_path):
    data = progressive_run(tmp_path)
    html = report_html(data, {**config(), "recipe": {"name": "mine"}}, repo=tmp_path)
    panel = html[html.index('<section id="time-to-accuracy">') : html.index('<section id="diagnosis">')]
    assert "published top-1<b>- %</b>" in panel and "(source: not given)" in panel
    assert 'id="tta-shortened"' not in panel, "no published epoch count to differ from"


def test_the_summary_names_a_compiled_run_and_its_decode_path(tmp_path):
    """run.json's `compiled` and `decode_path` (train.compile, train.decode as it ran) reach the summary;
    an eager run with the torch loader (decode_path null) names neither."""
    html = render(tmp_path / "compiled", run_overrides={"compiled": True, "decode_path": "full"})
    assert "compiled (torch.compile: epochs and calibration)" in html
    assert "(train.decode: full)" in html
    html = render(tmp_path / "eager", run_overrides={"compiled": False, "decode_path": None})
    assert "compiled (torch.compile" not in html and "(train.decode:" not in html


def test_the_summary_names_the_augmentation_policy_and_what_ran_it(tmp_path):
    """run.json's `augment` (train.augment.policy as it ran) reaches the summary; a run.json without one
    (written before the key, or policy none) says crop and flip only."""
    from rectrain.loaders.augment import parse_policy, ran_as

    augment = ran_as(parse_policy("rand-m9-mstd0.5-inc1"), "dali", "gpu: DALI mixed decoder")
    html = render(tmp_path / "rand", run_overrides={"augment": augment})
    row = html_module.unescape(re.search(r'<tr id="augment">(.*?)</tr>', html, re.S).group(1))
    assert "<code>rand-m9-mstd0.5-inc1</code>: RandAugment: 2 op(s) per image of timm's increasing-severity ops" in row
    assert "each applied with p 0.5, magnitude 9 ± 0.5 of 10; ran as DALI's operators on the GPU" in row
    html = render(tmp_path / "none", run_overrides={"augment": ran_as(parse_policy("none"), "dali", "cpu: ...")})
    assert "random-resized-crop and flip only (train.augment.policy: none)" in html


def test_a_subset_run_says_so_projects_full_imagenet_and_keeps_the_published_top1_apart(tmp_path):
    """index.classes / index.per_class: the data table says which part of ImageNet, the projection is
    still full ImageNet's 1,281,167 images at the measured rates, and the preset's published top-1 is
    not set beside the subset's."""
    import dataclasses

    from rectrain.data import subset

    data = progressive_run(tmp_path)
    wnids = sorted(subset.resolve("imagenet100")[:4])
    data = dataclasses.replace(data, classes=pd.DataFrame({"label": range(4), "wnid": wnids, "name": [""] * 4}))
    index = {"classes": "imagenet100", "per_class": 260}
    html = report_html(data, {**config(), "recipe": RN50_40, "index": index}, repo=tmp_path)
    table = html[html.index('<section id="data">') :]
    assert (
        '<p id="subset"><b>A subset:</b> 4 of 1000 ImageNet classes, at most 260 images per class (training; '
        "validation whole)" in table
    )
    panel = html[html.index('<section id="time-to-accuracy">') : html.index('<section id="diagnosis">')]
    assert "projected: full ImageNet on this hardware, 4 epochs<b>14 h 02 min</b>" in panel, "full ImageNet's count"
    assert 'id="tta-subset"' in panel and "is not comparable with the published top-1" in panel
    assert "This run's own top-1" not in panel
    whole_set = report_html(data, {**config(), "recipe": RN50_40}, repo=tmp_path)
    assert 'id="subset"' not in whole_set and "This run's own top-1" in whole_set


def test_the_data_check_shows_in_the_summary_only_once_it_has_run(tmp_path, problem_report):
    """The check stage's report.json (rectrain.check), given with --check, is one summary row; a report
    built without it has none."""
    paths = write_run(tmp_path)
    verdict = {
        "weights": "torchvision:ResNet50_Weights.IMAGENET1K_V1",
        "verdict": "misaligned",
        "message": "near chance <b>",
    }
    (tmp_path / "check.json").write_text(json.dumps(verdict))
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo",
                check=tmp_path / "check.json")  # fmt: skip
    html = report_html(data, config(), repo=tmp_path)
    assert 'id="data-check"' in html and "ResNet50_Weights.IMAGENET1K_V1 through this val .rec (misaligned)" in html
    assert "near chance &lt;b&gt;" in html, "escaped"
    assert 'id="data-check"' not in problem_report


def test_the_recipe_as_it_ran_shows_what_each_mechanic_changed_and_each_parameter_groups_lr_and_decay(tmp_path):
    """Issue 46 item 10: run.json's recipe_as_run (rectrain.model.construct, rectrain.train.optim.recorded) on
    the page, not only the configuration asked for."""
    import torch

    from rectrain import model as models
    from rectrain.train import optim

    net, applied = models.construct("resnet18", 5, zero_init_residual=True)
    opt = torch.optim.SGD(
        [
            {"params": [net.fc.bias], "weight_decay": 0.0, "lr": 0.025},
            {"params": [net.fc.weight], "weight_decay": 5e-5, "lr": 0.025},
        ]
    )
    as_run = {"mechanics": applied, "optimizer": optim.recorded(opt, net)}
    html = render(tmp_path, run_overrides={"recipe_as_run": as_run})
    section = html[html.index('id="recipe-as-run"') : html.index("Configuration used")]
    assert 'train.zero_init_residual</td><td>on</td><td class="num">8</td>' in section
    assert "layer1.*.bn2.weight (2)" in section and "fc.bias (1)" in section
    assert '<td class="num">0.025</td><td class="num">5e-05</td>' in section
    assert 'id="recipe-as-run"' not in render(tmp_path / "old")  # a run.json from before: no section


def test_a_subset_of_the_demo_is_called_that_not_a_part_of_imagenets_1000_classes(tmp_path):
    """The demo's 10 classes are ImageNet wnids, yet a run of 4 of them is no part of full ImageNet: the
    page says 4 of the demo's 10 (index.classes a list); a list the raw set was not asked to be ImageNet
    for says only how many were chosen."""
    from rectrain.data import demo

    paths = write_run(tmp_path)
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    wnids = [w for w, _ in demo.class_list(10)][:4]
    data = dataclasses.replace(data, classes=pd.DataFrame({"label": range(4), "wnid": wnids, "name": [""] * 4}))
    html = report_html(data, {**config(), "demo": {"classes": 10}, "index": {"classes": wnids}}, repo=tmp_path)
    assert "<b>A subset:</b> 4 of the demo's 10 classes" in unescape(html) and "of 1000 ImageNet" not in html
    own = {**config(), "raw": str(tmp_path / "raw"), "index": {"classes": wnids}}
    assert "<b>A subset:</b> 4 classes chosen by index.classes" in report_html(data, own, repo=tmp_path)


def test_with_few_classes_the_worst_and_the_best_classes_share_no_row(tmp_path):
    """4 classes and classes_shown 10: the two worst and the two best, not all four twice."""
    html = render(tmp_path)
    worst = html[html.index('id="worst-classes"') : html.index('id="best-classes"')]
    best = html[html.index('id="best-classes"') : html.index('id="confused-pairs"')]
    rows = lambda part: set(re.findall(r"<tr><td>(\d+)</td>", part))  # noqa: E731
    assert "Worst classes (2 of 4)" in worst and "Best classes (2 of 4)" in best
    assert len(rows(worst)) == len(rows(best)) == 2 and not rows(worst) & rows(best)


def test_classes_at_equal_accuracy_are_split_between_the_worst_and_the_best_not_listed_twice():
    """The demo's 10 classes all at 100 %: the worst five and the best five are ten different classes."""
    from rectrain.report.build import class_views

    table = pd.DataFrame(
        {"label": range(10), "wnid": [f"n{i:08d}" for i in range(10)], "accuracy": 1.0, "images": 12}
    ).assign(most_confused_count=0)
    views = class_views(table, 10)
    assert views["worst"]["label"].tolist() == [0, 1, 2, 3, 4] and views["best"]["label"].tolist() == [5, 6, 7, 8, 9]
    ranked = class_views(table.assign(accuracy=[0.5, 1.0, 0.9, 1.0, 0.2, 1.0, 0.9, 0.7, 1.0, 0.1]), 3)
    assert ranked["worst"]["label"].tolist() == [9, 4, 0] and ranked["best"]["label"].tolist() == [1, 3, 5]


def test_a_rotational_fast_storage_is_one_storage_warning_not_warning_twice():
    from rectrain.report.build import storage_warnings
    from rectrain.storage import ROTATIONAL_WARNING

    said = ROTATIONAL_WARNING.format(path="/hdd/demo", device="sdb")
    manifests = {split: {"storage": {"warning": said}} for split in ("train", "val")} | {"x": {"storage": None}}
    assert storage_warnings(manifests) == [said.removeprefix("WARNING: ")]
    assert storage_warnings(manifests)[0].startswith("fast_storage /hdd/demo is on a rotational disk (sdb)")


def test_the_utilization_table_splits_the_busy_cpu_into_the_runs_processes_and_others(tmp_path):
    """system.csv's job_cpu_percent (the run's own processes) beside cpu_percent (the machine's); a
    system.csv written before the column existed shows no split."""
    paths = write_run(tmp_path)
    system_csv = paths["train"] / "system.csv"
    system = pd.read_csv(system_csv)
    system.assign(job_cpu_percent=20.0).to_csv(system_csv, index=False)
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    html = unescape(report_html(data, config(), repo=tmp_path))
    others = system["cpu_percent"].mean() - 20.0
    assert f'this run\'s processes / other processes (mean)</th><td class="n">20.0 % / {others:.1f} %' in html
    system.to_csv(system_csv, index=False)
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    assert 'id="cpu-split"' not in report_html(data, config(), repo=tmp_path)
