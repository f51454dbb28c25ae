"""bench/scale_data.py writes both raw layouts the index accepts, with ImageNet's 1000 classes and the
asked-for counts, and bench/scale_bench.py's table, growth factors and verdicts read right."""

import hashlib
import io
import shutil
import sys
from collections import Counter
from pathlib import PurePosixPath

import pytest
from helpers import REPO
from PIL import Image

from rectrain.data.index import discover

sys.path.insert(0, str(REPO / "bench"))
import scale_bench  # noqa: E402
import scale_data  # noqa: E402

N = 2_500  # 2 or 3 images per class


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    summary = scale_data.generate(N, out)
    return out, summary


@pytest.fixture(scope="module")
def found(tree):
    out, _ = tree
    return {layout: discover(out / layout) for layout in scale_data.LAYOUTS}


def test_counts_spread_n_over_the_classes_and_val_keeps_imagenets_ratio():
    counts = scale_data.per_class_counts(N)
    assert len(counts) == 1000 and sum(counts) == N and set(counts) == {2, 3}
    assert scale_data.val_count(1_281_167) == 50_000 and scale_data.val_count(N) == 1000


@pytest.mark.parametrize("layout", scale_data.LAYOUTS)
def test_each_layout_indexes_to_n_train_images_in_1000_classes(found, tree, layout):
    _, summary = tree
    f = found[layout]
    assert f.detected == {"train": layout, "val": layout}
    assert len(f.train) == N and len(f.val) == summary["val"] == 1000
    assert len(f.train.classes()) == 1000 and f.val.classes() == f.train.classes()
    assert f.unclassified == []
    per_class = Counter(w for _, w in f.train)
    assert sorted(per_class.values()) == sorted(scale_data.per_class_counts(N))


def test_archives_are_the_official_nested_tars_labelled_by_the_devkit(found):
    f = found["archives"]
    assert f.layout["train"] == "ILSVRC2012_img_train.tar (per-class tars, read in place)"
    assert "labelled by devkit ground truth (ILSVRC2012_devkit_t12.tar.gz)" in f.layout["val"]
    assert all(s.count("::") == 2 for s, _ in f.train) and all(s.count("::") == 1 for s, _ in f.val)


def test_both_layouts_give_each_image_name_the_same_class(found):
    def by_name(rows):
        return {PurePosixPath(s.split("::")[-1]).name: w for s, w in rows}

    for split in ("train", "val"):
        assert by_name(getattr(found["folders"], split)) == by_name(getattr(found["archives"], split))


def test_images_are_tiny_distinct_jpegs(tree):
    out, _ = tree
    files = sorted((out / "folders" / "train").rglob("*.JPEG"))[:200]
    datas = [p.read_bytes() for p in files]
    assert len({hashlib.sha1(d).digest() for d in datas}) == len(datas)
    assert max(map(len, datas)) < 1500
    for data in datas[:5]:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            assert img.format == "JPEG" and max(img.size) <= 40


def test_a_finished_layout_is_not_rewritten_but_a_deleted_one_is(tree):
    out, _ = tree
    assert scale_data.generate(N, out)["seconds"] == {}
    marker = out / "folders" / "train"
    shutil.rmtree(out / "folders")
    assert set(scale_data.generate(N, out, ("folders",))["seconds"]) == {"folders"} and marker.is_dir()


def stage(wall, peak, images, cpu=None, **detail):
    return {
        "wall_s": wall,
        "cpu_s": wall if cpu is None else cpu,
        "peak_mib": peak,
        "images": images,
        "us_per_image": 1e6 * wall / images,
        "detail": detail,
    }


def results():
    small = {"index": stage(1.0, 100, 100_000), "pack train": stage(10.0, 200, 100_000)}
    big = {
        "index": stage(12.8 * 1.1, 150, 1_280_000),
        "pack train": stage(128 * 1.5, 600, 1_280_000, cpu=128 * 1.3),
        "dry-run": stage(1.9, 130, 1_280_000, nothing_to_do=True),
        "dali": stage(2.0, 800, 10_000, first_batch_s=1.5),
    }
    return {
        ("folders", 100_000): {"layout": "folders", "images": 100_000, "stages": small},
        ("folders", 1_280_000): {"layout": "folders", "images": 1_280_000, "stages": big},
    }


def test_growth_is_the_ratio_of_time_per_image_and_of_peak_memory():
    (a, b, wall, cpu, peak), *_ = scale_bench.growth(results(), "folders", "pack train")
    assert (a, b) == (100_000, 1_280_000)
    assert (wall, cpu, peak) == (pytest.approx(1.5), pytest.approx(1.3), pytest.approx(3.0))


def test_table_rows_carry_sizes_and_growth_factors():
    table = scale_bench.format_table(results()).splitlines()
    assert table[0].startswith("| layout | stage | N (train) |")
    assert "| folders | index | 1,280,000 | 1,280,000 | 14.08 | 11.0 | 11.0 | 150 | 1.10 | 1.10 | 1.50 |" in table
    assert (
        "| folders | pack train | 1,280,000 | 1,280,000 | 192.00 | 150.0 | 130.0 | 600 | 1.50 | 1.30 | 3.00 |" in table
    )
    assert "| folders | index | 100,000 | 100,000 | 1.00 | 10.0 | 10.0 | 100 | - | - | - |" in table


def test_verdicts_flag_what_misses_issue_12s_targets():
    lines = scale_bench.verdicts(results())
    assert any(
        x.startswith("PASS folders index: time/img x1.10 CPU (x1.10 wall) from 100,000 to 1,280,000") for x in lines
    )
    assert any(x.startswith("FAIL folders pack train: time/img x1.30 CPU (x1.50 wall)") for x in lines)
    assert "FAIL folders pack train: peak 600 MiB at 1,280,000 (target < 512)" in lines
    assert any(x.startswith("PASS folders snakemake -n: median 1.90 s of 1 (runs 1.90-1.90 s)") for x in lines)
    assert any(x.startswith("PASS folders dali loader: first batch 1.50 s") for x in lines)


def test_dry_run_verdict_is_on_the_median_and_quotes_the_spread_and_snakemakes_own_start_up():
    def verdict(walls):
        median = sorted(walls)[len(walls) // 2]
        detail = {"nothing_to_do": True, "walls": walls, "version_walls": [2.0, 2.2, 1.9]}
        return scale_bench.dry_run_verdict("archives", 1_281_167, {"wall_s": median, "detail": detail})

    assert verdict([2.4, 3.9, 2.6]) == (
        "PASS archives snakemake -n: median 2.60 s of 3 (runs 2.40-3.90 s; Snakemake's own start-up, --version, "
        "median 2.00 s) at 1,281,167, nothing to do (target < 3.0 s, nothing to do)"
    )
    assert verdict([3.1, 2.5, 3.3]).startswith("FAIL archives snakemake -n: median 3.10 s of 3")


def test_stage_peak_is_the_commands_own_not_the_benchmarks(tmp_path):
    grow = "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096])"
    _, big, _ = scale_bench.run_stage([sys.executable, "-c", grow], tmp_path / "big.log")
    _, small, _ = scale_bench.run_stage([sys.executable, "-c", "pass"], tmp_path / "small.log")
    assert big > 200 and small < 50
