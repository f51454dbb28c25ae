"""CLI of the report rule:

python -m rectrain.report --config-json '<whole config>' --train-dir results/<ds>/train \
    --eval-dir results/<ds>/eval --pack-dir results/<ds>/pack --index-dir results/<ds>/index \
    --benchmarks benchmarks --out results/report.html
"""

from __future__ import annotations

import argparse
import logging
import time

from rectrain import atomic, cli, settings
from rectrain.config import ConfigError
from rectrain.report import build, load

logger = logging.getLogger(__name__)


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--train-dir", required=True)
    ap.add_argument("--eval-dir", help="the evaluate stage's folder; omitted when the dataset has no val split")
    ap.add_argument("--pack-dir", required=True)
    ap.add_argument("--index-dir", required=True)
    ap.add_argument(
        "--benchmarks",
        nargs="*",
        default=["benchmarks"],
        help="benchmark TSV files, or folders holding <rule>/<dataset>.tsv",
    )
    ap.add_argument("--check", help="the check stage's report.json, when it has run")
    ap.add_argument("--out", required=True)


def _run(args: argparse.Namespace, config: settings.WholeSettings) -> None:
    """`config`: the whole config's view (the report reads several blocks and shows them all)."""
    t = time.perf_counter()
    data = load(
        args.train_dir, args.eval_dir, args.pack_dir, args.index_dir, args.benchmarks, config.dataset, check=args.check
    )
    html = build(
        data,
        config.report,
        recipe=config.recipe,
        index=config.index,
        dataset=config.dataset,
        shown=config.as_dict(),
    )
    out = atomic.write_text(args.out, html)  # never a half-written report that looks complete
    logger.info("%s (%.2f MB, %.1f s)", out, len(html) / 1e6, time.perf_counter() - t)


def main(argv=None) -> int:
    """The whole config as --config-json (report block thresholds, and the rest shown under Provenance)."""
    return cli.main("report", cli.WHOLE, _arguments, _run, argv, errors={ConfigError: 2})


if __name__ == "__main__":
    cli.end(main())
