"""CLI of the report rule:

python -m rectrain.report --config-json '<whole config>' --train-dir results/<ds>/train \
    --eval-dir results/<ds>/eval --pack-dir results/<ds>/pack --index-dir results/<ds>/index \
    --benchmarks benchmarks --out results/report.html
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from rectrain import atomic, log
from rectrain.config import ConfigError, complete_config
from rectrain.report import build, load

logger = logging.getLogger(__name__)


def read_config(text: str) -> dict:
    """The whole config from --config-json, checked and completed from the schema, so a partial
    config typed by hand works and a wrong key is named here."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f'--config-json is not valid JSON ({err}); pass the whole config, e.g. \'{{"dataset": "demo"}}\''
        ) from None
    if not isinstance(given, dict):
        raise ConfigError(f"--config-json must be a JSON object (the whole config), got {given!r}")
    return complete_config(given)


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
    ap.add_argument("--eval-dir", help="the evaluate stage's folder; omitted when the dataset has no val split")
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
    log.setup("report")

    t = time.perf_counter()
    try:
        config = read_config(args.config_json)
    except ConfigError as err:
        logger.error("%s", err)
        return 2
    data = load(args.train_dir, args.eval_dir, args.pack_dir, args.index_dir, args.benchmarks, config["dataset"])
    html = build(data, config)
    out = atomic.write_text(args.out, html)  # never a half-written report that looks complete
    logger.info("%s (%.2f MB, %.1f s)", out, len(html) / 1e6, time.perf_counter() - t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
