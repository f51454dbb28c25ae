"""Read every stage's outputs (formats: docs/architecture.md) into one RunData for the report.

Missing optional pieces (a CPU-only run has no GPU columns, a run too short for the sampler has an
empty system.csv) become empty tables, never errors; missing required files name the stage to rerun.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rectrain.data.images import Skip, read_jpeg_header
from rectrain.recordio import RecordIOError, scan_records, unpack_record
from rectrain.tables import read_classes
from rectrain.train.telemetry import EPOCH_COLUMNS, STEP_COLUMNS, SYSTEM_BASE_COLUMNS

log = logging.getLogger(__name__)

# Packed images whose JPEG headers are read for the resize advice: the .rec is globally shuffled, so
# its first records are a random sample; 256 headers are a few MB of reading.
SIZE_SAMPLE = 256
# Snakemake writes "NA" when the job ended before its first sample and "-" for None.
BENCH_NA = ["NA", "-"]


@dataclass
class RunData:
    steps: pd.DataFrame
    system: pd.DataFrame
    epochs: pd.DataFrame
    run: dict
    metrics: dict
    per_class: pd.DataFrame
    manifests: dict[str, dict]
    classes: pd.DataFrame
    benchmarks: pd.DataFrame  # one row per rule: rule, s, max_rss, io_in, io_out, cpu_time, mean_load
    paths: dict[str, str] = field(default_factory=dict)
    image_sizes: pd.DataFrame | None = None  # width, height of a sample of the packed train images
    check: dict | None = None  # the check stage's report.json, once it has run (rectrain.check)


# The pack's reason for a non-JPEG payload ("PNG content named as JPEG re-encoded as JPEG"), true only
# when the file's name says JPEG.
NAMED_AS_JPEG = re.compile(r"\b(\w+) content named as JPEG")
JPEG_SUFFIXES = (".jpg", ".jpeg")


def repair_reason(source: str, reason: str) -> str:
    """The repair reason as true for this file: a `.png` holding a PNG is a PNG file re-encoded, not
    PNG content named as JPEG (the last member of an archive path decides)."""
    name = str(source).rsplit("::", 1)[-1]
    if Path(name).suffix.lower() in JPEG_SUFFIXES:
        return reason
    return NAMED_AS_JPEG.sub(lambda m: f"{m.group(1)} file", str(reason))


def _true_reasons(manifest: dict) -> dict:
    repaired = [
        {**r, "reason": repair_reason(r.get("source", ""), r.get("reason", ""))} for r in manifest.get("repaired") or []
    ]
    return {**manifest, "repaired": repaired}


def _csv(path: Path, columns: list[str], stage: str, **kw) -> pd.DataFrame:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: rerun the {stage} stage (snakemake ... --forcerun {stage})")
    if path.stat().st_size == 0:
        return pd.DataFrame(columns=columns)
    return pd.read_csv(path, **kw)


def _classes(path: Path) -> pd.DataFrame:
    """classes.tsv through the one reader (rectrain.tables.read_classes: every value a string, so a class
    called "NA" is a name, not a missing value), labels as integers."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: rerun the index_raw stage (snakemake ... --forcerun index_raw)")
    return pd.DataFrame(read_classes(path), columns=["label", "wnid", "name"]).astype({"label": int})


def _json(path: Path, stage: str) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: rerun the {stage} stage (snakemake ... --forcerun {stage})")
    return json.loads(path.read_text())


def benchmark_files(paths: list[Path | str], dataset: str) -> list[Path]:
    """Expand the CLI's --benchmarks arguments: files as given; a folder to its <rule>/<dataset>.tsv
    and <rule>/<dataset>_<part>.tsv files (pack writes one per split)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted({*p.glob(f"*/{dataset}.tsv"), *p.glob(f"*/{dataset}_*.tsv")})
        elif p.exists():
            out.append(p)
    return out


def stage_name(path: Path, dataset: str) -> str:
    """benchmarks/pack/demo_train.tsv -> 'pack train'; benchmarks/train/demo.tsv -> 'train'; a run's
    own, benchmarks/train/demo/<run>.tsv -> 'train'."""
    if path.parent.name == dataset:
        return path.parent.parent.name
    part = path.stem[len(dataset) :].lstrip("_") if path.stem.startswith(dataset) else path.stem
    return f"{path.parent.name} {part}".strip()


def read_benchmarks(files: list[Path], dataset: str = "") -> pd.DataFrame:
    """One row per benchmark file (stage); repeated measurements in one file are averaged."""
    rows = []
    for f in files:
        df = pd.read_csv(f, sep="\t", na_values=BENCH_NA)
        if df.empty:
            continue
        numeric = df.drop(columns=["h:m:s"], errors="ignore").select_dtypes("number").mean()
        rows.append({"rule": stage_name(f, dataset), **numeric.to_dict()})
    cols = ["rule", "s", "max_rss", "max_vms", "max_uss", "max_pss", "io_in", "io_out", "mean_load", "cpu_time"]
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=cols)


def sample_image_sizes(manifest: dict | None, n: int = SIZE_SAMPLE) -> pd.DataFrame | None:
    """width, height of the first n JPEGs of the manifest's .rec; None when it cannot be read (moved,
    deleted after training, on another machine): the report then gives the resize advice without
    numbers rather than failing."""
    rec = Path((manifest or {}).get("rec") or "")
    if not rec.is_file():
        return None
    sizes = []
    try:
        for _, payload in itertools.islice(scan_records(rec), n):
            info = read_jpeg_header(unpack_record(payload)[1])
            if info is not None and info.width and info.height:
                sizes.append((info.width, info.height))
    except (OSError, RecordIOError, Skip) as err:
        log.warning("could not sample image sizes from %s (%s): the resize advice will have no numbers", rec, err)
        return None
    return pd.DataFrame(sizes, columns=["width", "height"]) if sizes else None


def read_complete_csv(path: Path, columns: list[str]) -> pd.DataFrame:
    """A CSV a running process is still appending to (the live telemetry): only its complete lines - a
    row being written has no line end yet - with the header's number of fields; an empty table with
    `columns` when it is missing or has no header yet."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return pd.DataFrame(columns=columns)
    lines = raw[: raw.rfind(b"\n") + 1].splitlines()
    if not lines:
        return pd.DataFrame(columns=columns)
    width = lines[0].count(b",")
    rows = [line for line in lines[1:] if line.count(b",") == width]
    return pd.read_csv(io.BytesIO(b"\n".join([lines[0], *rows])))


@dataclass
class Upstream:
    """What the stages before training wrote: the pack manifests, classes, benchmarks, image sizes."""

    manifests: dict[str, dict]
    classes: pd.DataFrame
    benchmarks: pd.DataFrame
    image_sizes: pd.DataFrame | None


def load_upstream(pack_dir, index_dir, benchmarks: list, dataset: str) -> Upstream:
    pack_dir, index_dir = Path(pack_dir), Path(index_dir)
    manifests = {}
    for split in ("train", "val"):
        p = pack_dir / f"{split}.manifest.json"
        if p.exists():
            manifests[split] = _true_reasons(json.loads(p.read_text()))
    if not manifests:
        raise FileNotFoundError(f"no pack manifests in {pack_dir}: rerun the pack stage")
    return Upstream(
        manifests=manifests,
        classes=_classes(index_dir / "classes.tsv"),
        benchmarks=read_benchmarks(benchmark_files(benchmarks, dataset), dataset),
        image_sizes=sample_image_sizes(manifests.get("train")),
    )


def load(train_dir, eval_dir, pack_dir, index_dir, benchmarks: list, dataset: str, *, check=None) -> RunData:
    """Every stage's outputs; eval_dir None: a dataset without a val split, so no evaluation (metrics {});
    check: the check stage's report.json when it has run, else None."""
    train_dir = Path(train_dir)
    up = load_upstream(pack_dir, index_dir, benchmarks, dataset)
    metrics, per_class = {}, pd.DataFrame()
    if eval_dir is not None:
        eval_dir = Path(eval_dir)
        metrics = _json(eval_dir / "metrics.json", "evaluate")
        per_class = _csv(
            eval_dir / "per_class.csv",
            [],
            "evaluate",
            keep_default_na=False,
            dtype={"wnid": str, "name": str, "most_confused_wnid": str},
        )
    return RunData(
        steps=_csv(train_dir / "steps.csv", STEP_COLUMNS, "train"),
        system=_csv(train_dir / "system.csv", SYSTEM_BASE_COLUMNS, "train"),
        epochs=_csv(train_dir / "epochs.csv", EPOCH_COLUMNS, "train"),
        run=_json(train_dir / "run.json", "train"),
        metrics=metrics,
        per_class=per_class,
        manifests=up.manifests,
        classes=up.classes,
        benchmarks=up.benchmarks,
        paths=stage_paths(train_dir, eval_dir, pack_dir, index_dir),
        image_sizes=up.image_sizes,
        check=_json(Path(check), "check") if check else None,
    )


def stage_paths(train_dir, eval_dir, pack_dir, index_dir) -> dict[str, str | None]:
    return {
        "train": str(train_dir),
        "eval": str(eval_dir) if eval_dir else None,
        "pack": str(pack_dir),
        "index": str(index_dir),
    }
