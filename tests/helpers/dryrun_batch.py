"""Many Snakemake dry-runs in one interpreter: reads a JSON list of argument lists on stdin, runs
`snakemake -n ARGS...` for each in the working directory, and prints a JSON list of {"ok", "out"}.

Most of a small dry-run is Snakemake's own import (~0.9 s of ~1.4 s on the 2-core CI machine); the
DAG and the persistence checks take ~0.1-0.3 s. Tests that ask many questions of one finished run
(every config key edited alone: ~130 dry-runs) start Snakemake once this way instead of once each.
Each dry-run still builds its own workflow from the Snakefile and its arguments, as the command does.
"""

import contextlib
import io
import json
import sys

from snakemake.cli import args_to_api, parse_args


def dryrun(args: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            parser, parsed = parse_args(["-n", *args])
            ok = bool(args_to_api(parsed, parser))
        except SystemExit as e:  # argparse's and Snakemake's own exits
            ok = e.code in (0, None)
        except Exception as e:  # what snakemake.cli.main prints before it exits 1
            print(f"{type(e).__name__}: {e}")
            ok = False
    return {"ok": ok, "out": out.getvalue()}


if __name__ == "__main__":
    json.dump([dryrun(args) for args in json.load(sys.stdin)], sys.__stdout__)
