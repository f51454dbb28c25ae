"""CLI of the report rule:

python -m rectrain.report --config-json '<whole config>' --train-dir results/<ds>/train \
    --eval-dir results/<ds>/eval --pack-dir results/<ds>/pack --index-dir results/<ds>/index \
    --benchmarks benchmarks --out results/report.html
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rectrain import atomic
from rectrain.report import build, load


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rectrain.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config-json",
        required=True,
        help="the whole config (report block thresholds, and the rest shown under Provenance)",
    )
    ap.add_argument("--train-dir", required=True)
    ap.add_argument("--eval-dir", required=True)
    ap.add_argument("--pack-dir", required=True)
    ap.add_argument("--index-dir", required=True)
    ap.add_argument(
        "--benchmarks",
        nargs="*",
        default=["benchmarks"],
        help="benchmark TSV files, or folders holding <rule>/<dataset>.tsv",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    t = time.perf_counter()
    config = json.loads(args.config_json)
    data = load(args.train_dir, args.eval_dir, args.pack_dir, args.index_dir, args.benchmarks, config["dataset"])
    html = build(data, config)
    out = atomic.write_text(args.out, html)  # never a half-written report that looks complete
    print(f"report: {out} ({len(html) / 1e6:.2f} MB, {time.perf_counter() - t:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
