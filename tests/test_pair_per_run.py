"""Two runs in different working directories that name the same absolute pack.fast_storage and dataset:
the second is refused before any job starts (the Snakefile's onstart hook, rectrain.snakefile.prestart),
so Snakemake never deletes the first run's published pair to make room for its pack job."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import copy_workflow, job_headers, snakemake

pytestmark = pytest.mark.slow

DEMO = {"classes": 3, "train_per_class": 6, "val_per_class": 2, "min_size": 40, "max_size": 64, "bad_files": False}
PACKED = ["results/demo/pack/train.manifest.json", "results/demo/pack/val.manifest.json"]


def working_directory(root: Path, fast: Path) -> Path:
    copy_workflow(root)
    (root / "run.yaml").write_text(yaml.safe_dump({"demo": DEMO, "pack": {"fast_storage": str(fast)}}))
    return root


def pack(work: Path):
    return snakemake(
        "--cores", "2", *PACKED, "--configfile", str(work / "run.yaml"), cwd=work, snakefile=work / "Snakefile"
    )


def test_a_second_working_directory_sharing_a_pair_is_refused_before_snakemake_removes_it(tmp_path):
    fast = tmp_path / "ssd"  # absolute, as config/imagenet-2gpu.yaml writes it
    first = working_directory(tmp_path / "run1", fast)
    second = working_directory(tmp_path / "run2", fast)
    done = pack(first)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = fast / "demo" / "train.rec"
    before = {p.name: p.read_bytes() for p in (fast / "demo").glob("*.[ri][ed][cx]")}

    refused = pack(second)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert f"{rec} belongs to the run in {first.resolve()}" in said, said[-3000:]
    assert "Give this run a pack.fast_storage of its own" in said
    assert "pack" not in {rule for rule, _ in job_headers(said)}, "no pack job started"
    after = {p.name: p.read_bytes() for p in (fast / "demo").glob("*.[ri][ed][cx]")}
    assert after == before and len(after) == 4, "the first run's train and val pairs are untouched"
