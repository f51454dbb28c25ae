"""The report built from synthetic stage outputs: every section, escaped user data, no external URLs."""

import base64
import io
import json
import re
from html.parser import HTMLParser

import pytest
from helpers.synthetic_run import REPORT_CFG, write_run
from PIL import Image

from rectrain.report import build, load
from rectrain.report.__main__ import main as report_main

SECTIONS = ["summary", "diagnosis", "throughput", "utilization", "learning", "data", "stages", "provenance"]
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
    return build(data, config(), repo=tmp_path)


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
    for title in ("Summary", "Throughput", "Utilization", "Learning", "Data", "Stages", "Diagnosis", "Provenance"):
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
    # throughput, step split, GPU, CPU/io, learning, worst classes, stages
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
    assert "57.5 %" in problem_report and "95.0 %" in problem_report  # metrics.json top-1 / top-5
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
    html = build(data, config(), repo=tmp_path)
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
    assert not out.with_suffix(".html.tmp").exists()


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
    html = build(data, config())
    assert re.search(r"git commit</th><td>[0-9a-f]{40}", html)
