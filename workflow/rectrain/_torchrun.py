"""torchrun (`torch.distributed.run`), run as `python -m rectrain._torchrun <torchrun's arguments>`, so
that a stop ends it in one line.  On a stop signal torchrun's agent shuts the workers down and raises
SignalException; when the ranks stop on their own (EXIT_STOPPED, after their stop checkpoint) it
raises ChildFailedError with a table of their exit statuses.  torchrun's `main` lets either escape:
every Ctrl-C, SIGTERM or SLURM warning printed a 40-line traceback per node after the ranks had
already said what they saved.  Everything else - arguments, rendezvous, exit statuses, real failures
and their report - is torchrun's own."""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

from rectrain import cli
from rectrain.train.lifecycle.status import EXIT_STOPPED

# A stopped rank's status, and those of the ranks the agent ended after it (SIGTERM, then SIGKILL)
STOP_STATUSES = {EXIT_STOPPED, -signal.SIGTERM, -signal.SIGKILL}


def only_stopped(err: ChildFailedError) -> bool:
    """Every failure is a rank that stopped (EXIT_STOPPED) or one ended after it, and one did stop."""
    statuses = {f.exitcode for f in err.failures.values()}
    return EXIT_STOPPED in statuses and statuses <= STOP_STATUSES


def run(argv: list[str] | None = None) -> int:
    """torchrun's main; 1 (the status it exits with then) after a stop, in one line."""
    try:
        main(argv)
    except SignalException as err:
        print(f"[torchrun] {signal.Signals(err.sigval).name}: the workers were shut down", file=sys.stderr)
        return 1
    except ChildFailedError as err:
        if not only_stopped(err):
            raise
        print(
            f"[torchrun] the ranks stopped (exit status {EXIT_STOPPED}): their lines above say what was saved",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    cli.end(run())
