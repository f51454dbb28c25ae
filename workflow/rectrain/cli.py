"""The stage CLIs' one entry point: arguments, logging, the config, errors mapped to exit codes.

A stage module's `main` is

    def main(argv=None) -> int:
        return cli.main("index", "index", _arguments, _run, argv, errors={LayoutError: 1})

and `if __name__ == "__main__": cli.end(main())` (cli.end: why).  `cli.main` parses the command line (the
description is the docstring of the module that holds `run`; `--config-json` is added here),
sets up logging (rectrain.log.setup), completes the config - a block with
rectrain.config.stage_block, or the whole config (`block=WHOLE`, the report) with complete_config -
reads it once into the stage's frozen view (rectrain.settings: `settings.view(block, ...)`, the train
block's TrainSettings, or `settings.whole` for WHOLE), calls `run(args, view)`, and maps the errors a
user can fix to the stage's exit codes in one place: each is logged as one line `[<tag>] <error>` and
its code returned (ConfigError: 1 unless `errors` says otherwise); any other exception propagates with
its traceback.  A stage that may run itself again (under torchrun, srun) finds the command line as
given in `args.argv`.

Training's main fits the same shape: `@record` wraps its `main`, which calls `cli.main("train",
"train", ..., elapsed=True)`; its `run` relaunches under torchrun when not launched, and logs the
explained failure line before re-raising (exceptions other than the mapped ones pass through to
`@record` untouched).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from typing import Any, Callable, Mapping, NoReturn, Sequence

from rectrain import log as stage_log
from rectrain import settings
from rectrain.config import ConfigError, complete_config, stage_block

WHOLE = "*"  # `block`: the whole config (the report prints every block), completed with complete_config
# What a stage stopped by Ctrl-C leaves: its outputs appear only once it finished (written under temporary
# names, renamed last; the pack's *.partial are deleted by the next run), so there is nothing to keep.
NOTHING_PUBLISHED = "nothing published (outputs appear only when a stage finishes); rerun to start it over"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C

log = logging.getLogger(__name__)

Arguments = Callable[[argparse.ArgumentParser], Any]  # adds the stage's options
Run = Callable[[argparse.Namespace, Any], Any]  # run(args, view) -> exit code, or None for 0


def main(
    tag: str,
    block: str | None,
    arguments: Arguments,
    run: Run,
    argv: Sequence[str] | None = None,
    *,
    errors: Mapping[type[BaseException], int] | None = None,
    bare: bool = False,
    elapsed: bool = False,
    passthrough: bool = False,
    config_required: bool = True,
    doc: str | None = None,
    interrupted: str | None = NOTHING_PUBLISHED,
    command: str | None = None,
) -> int:
    """Run one stage's CLI; returns its exit code (0 when `run` returns None).

    tag: the stage, in `[tag]` before every log line and every mapped error.
    block: its config block ("pack"), WHOLE, or None (no --config-json).
    arguments(parser): adds the stage's own options.  run(args, view): the stage; `view` is its block's
      frozen view (rectrain.settings; WHOLE: the whole config's), None without a block.
    errors: exception type -> exit code, for errors whose message says what to fix (the most specific
      class of the error that is listed wins).
    bare: log lines without the tag (the pack's rule log reads as it always has); the error line keeps it.
    elapsed: `[tag 12.3s]` prefixes (training).
    passthrough: the arguments this stage does not know are the next program's (the launcher hands
      them to rectrain.train): parse_known_args and no -h of its own.
    config_required: without it --config-json defaults to '{}' (all defaults).
    doc: the --help description; default the docstring of run's module.
    interrupted: what a Ctrl-C (KeyboardInterrupt) leaves, said in one line on the log and the terminal
      instead of a traceback (exit status 130); None lets it propagate (training stops on SIGINT itself).
    command: the module a user runs, `python -m <command>` in --help and argument errors; default the
      module that defines `run` (a stage whose `run` lives elsewhere names its own)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(block, arguments, run, doc, passthrough, config_required, command=command)
    args = parser.parse_known_args(argv)[0] if passthrough else parser.parse_args(argv)
    args.argv = argv
    stage_log.setup("" if bare else tag, elapsed=elapsed, console_tag=tag)
    codes = {ConfigError: 1, **(errors or {})}
    try:
        view = None if block is None else typed(block, read_config(block, args.config_json))
        rc = run(args, view)
    except tuple(codes) as err:
        log.error("%s%s", f"[{tag}] " if bare else "", err)
        return next(codes[k] for k in type(err).__mro__ if k in codes)
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        # the progress logger: the one line a terminal shows besides the log (rectrain.log)
        logging.getLogger(stage_log.PROGRESS_LOGGER).error("%s interrupted: %s", tag, interrupted)
        return EXIT_INTERRUPTED
    return 0 if rc is None else rc


def end(code: int | None) -> NoReturn:
    """A stage process's exit with `code` (sys.exit's), without the garbage collections the interpreter
    runs as it shuts down: a process that imported torch spends 0.6-0.8 CPU-s and as long in wall time
    in them (bench/RESULTS.md), every rank of every run.  The rest of an exit still happens: atexit
    handlers (logging's flush), module teardown, every object freed by its reference count (files flush
    and close).  Only objects in reference cycles are left for the OS to reclaim with the process."""
    gc.freeze()
    sys.exit(code)


def read_config(block: str, text: str) -> dict:
    """--config-json completed from the schema: the stage's block, or (WHOLE) the whole config, so a
    partial config typed by hand works and a wrong key fails here, named; raises ConfigError."""
    if block != WHOLE:
        return stage_block(block, text)
    try:
        given = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f'--config-json is not valid JSON ({err}); pass the whole config, e.g. \'{{"dataset": "demo"}}\''
        ) from None
    if not isinstance(given, dict):
        raise ConfigError(f"--config-json must be a JSON object (the whole config), got {given!r}")
    return complete_config(given)


def typed(block: str, values: dict):
    """The completed `values` as the stage's one frozen view: the whole config's for WHOLE, else the
    block's (TrainSettings for train)."""
    return settings.whole(values) if block == WHOLE else settings.view(block, values)


def _parser(block, arguments: Arguments, run: Run, doc, passthrough: bool, config_required: bool, *, command):
    module = sys.modules.get(run.__module__)
    spec = getattr(module, "__spec__", None)
    name = command or (spec.name.removesuffix(".__main__") if spec else run.__module__)
    parser = argparse.ArgumentParser(
        prog=f"python -m {name}",
        description=doc if doc is not None else getattr(module, "__doc__", None),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=not passthrough,
    )
    if block is not None:
        what = "the whole config" if block == WHOLE else f"the config's {block} block"
        parser.add_argument(
            "--config-json",
            required=config_required,
            default=None if config_required else "{}",
            help=f"{what} as JSON; missing keys take the schema defaults"
            + ("" if config_required else " (default: all defaults)"),
        )
    arguments(parser)
    return parser
