"""summary.txt and gpu_check.tar.gz for bench/gpu_check.sh: what ran on which GPU, how fast, whether the
GPU waited, the report's diagnosis (rectrain.report.diagnosis on the same telemetry), the efficiency table
and the 11 GB check; and one archive of the logs, report, telemetry and JSON tables, capped in size so it
comes back from a lent GPU machine (a returned file may have 16 MiB).

    python bench/gpu_summary.py --dataset gpudemo --results results --work . --tables T --out bench/out/gpu
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tarfile
import zlib
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from rectrain.report import diagnosis  # noqa: E402
from rectrain.snakefile.checks import check_config  # noqa: E402


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def summary(results: Path, tables: Path) -> str:
    lines = []
    train = results / "main" / "train"  # the run's folder (run: main)
    run = json.loads(_read(train / "run.json") or "{}")
    if not run:
        lines.append(f"pipeline: no {train / 'run.json'} - training did not finish (see logs/ in this folder)")
    else:
        gpus = (
            ", ".join(
                f"{g.get('name')} ({g.get('memory_total_mb')} MB, driver {g.get('driver')})"
                for g in run.get("gpus") or []
            )
            or "none"
        )
        lines += [
            f"GPUs: {gpus}; torch {run.get('torch')}, CUDA {run.get('cuda')}, DALI {run.get('dali')}",
            f"train: {run.get('model')} @{run.get('image_size')}px {run.get('precision')}, batch "
            f"{run.get('batch_size')} x accum {run.get('grad_accum')} x {run.get('world_size')} ranks, "
            f"loader {run.get('loader')} (requested {run.get('loader_requested')}), decode: {run.get('decode')}",
            f"preflight: {run.get('preflight')}",
        ]
        if run.get("loader_note"):
            lines.append(f"loader note: {run['loader_note']}")
        steps = pd.read_csv(train / "steps.csv")
        system = pd.read_csv(train / "system.csv")
        epochs = pd.read_csv(train / "epochs.csv")
        wait = diagnosis.overall_data_wait_share(steps)
        util = diagnosis.gpu_util_mean(system)
        lines.append(
            "epochs: "
            + "; ".join(
                f"{int(r.epoch)}: {r.images_per_s:.0f} img/s, val top-1 {r.val_single_view_top1:.3f}"
                for r in epochs.itertuples()
            )
        )
        lines.append(f"data-wait share (steady steps, all ranks): {wait:.3f}" if wait is not None else "no steps")
        lines.append(
            "GPU util mean: " + (", ".join(f"GPU {i}: {u:.0f} %" for i, u in util.items()) or "no GPU columns")
        )
        manifests = {
            p.name.split(".")[0]: json.loads(p.read_text()) for p in (results / "pack").glob("*.manifest.json")
        }
        report_cfg = check_config({"dataset": "x"}, REPO / "config" / "schema.yaml", workdir=REPO)["report"]
        lines.append("diagnosis:")
        for f in diagnosis.diagnose(steps, system, run, manifests, report_cfg):
            lines.append(f"  [{f.severity}] {f.title}: {f.measured} -> {f.fix}")
    metrics = _read(results / "main" / "eval" / "metrics.json")
    lines.append(f"eval: {metrics.strip() if metrics else 'missing'}")
    lines.append("efficiency (bench/gpu_efficiency.py):")
    lines.append(_read(tables / "gpu_efficiency.md") or "  missing (see gpu_check.log)")
    lines.append("11 GB cap (bench/oom_cap.py):")
    lines.append(_read(tables / "oom_cap.txt") or "  missing (see gpu_check.log)")
    lines.append("decoder memory (bench/decoder_memory.py):")
    lines.append(_read(tables / "decoder_memory.md") or "  missing (see gpu_check.log)")
    return "\n".join(lines) + "\n"


def archive_members(results: Path, work: Path, tables: Path, out: Path) -> list[tuple[Path, str]]:
    """(file, name in the archive) of everything worth bringing back, most useful first."""
    found = [(out / "gpu_check.log", "gpu_check.log")]
    found += [(p, f"tables/{p.name}") for p in sorted(tables.glob("*")) if p.is_file()]
    for sub in ("main/eval", "main/train", "pack"):
        found += [(p, f"{sub}/{p.name}") for p in sorted((results / sub).glob("*")) if p.suffix in (".json", ".csv")]
    for folder in ("logs", "benchmarks"):
        found += [(p, str(p.relative_to(work))) for p in sorted((work / folder).rglob("*")) if p.is_file()]
    found.append((results.parent / "report.html", "report.html"))
    return [(p, name) for p, name in found if p.is_file()]


def _gzip_size(path: Path) -> int:
    """Bytes `path` takes once gzip'd (what it adds to the archive), computed without writing it."""
    z, n = zlib.compressobj(6, zlib.DEFLATED, 31), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            n += len(z.compress(chunk))
    return n + len(z.flush())


def pack(members: list[tuple[Path, str]], dest: Path, cap_bytes: int) -> list[str]:
    """Write the members into dest (tar.gz) in order, leaving out any that would take it past cap_bytes;
    returns the names left out.  A tar header and gzip's buffer take a few KiB: kept under a 64 KiB margin."""
    left_out = []
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for path, name in members:
            room = cap_bytes - 65536 - raw.tell()
            size = path.stat().st_size
            if size > room and (size > 8 * cap_bytes or _gzip_size(path) > room):
                left_out.append(f"{name} ({size / 2**20:.1f} MiB)")
                continue
            tar.add(path, arcname=name)
            gz.flush(zlib.Z_SYNC_FLUSH)  # so raw.tell() counts what this member added
    os.replace(tmp, dest)
    return left_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="gpudemo")
    ap.add_argument("--results", type=Path, default=REPO / "results", help="the pipeline's results folder")
    ap.add_argument("--work", type=Path, default=REPO, help="the pipeline's working folder (logs/, benchmarks/)")
    ap.add_argument("--tables", type=Path, required=True, help="where the benches wrote their tables")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--archive-cap-mb", type=float, default=12.0)
    args = ap.parse_args(argv)
    results = args.results / args.dataset
    text = summary(results, args.tables)
    members = archive_members(results, args.work, args.tables, args.out)
    left_out = pack(members, args.out / "gpu_check.tar.gz", int(args.archive_cap_mb * 2**20))
    text += f"archive: gpu_check.tar.gz, {len(members) - len(left_out)} files"
    text += f"; left out to stay under {args.archive_cap_mb:g} MiB: {', '.join(left_out)}\n" if left_out else "\n"
    (args.out / "summary.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
