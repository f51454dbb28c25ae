"""Stopping cleanly: a rank's signal handler only records a stop signal (`StopRequest`); after every optimizer
step each rank calls `Agreement.poll`, one all-reduce MAX (on a gloo group of CPU tensors: no GPU wait) of
the signal it got, rank 0's "periodic checkpoint due" (train.checkpoint_interval_min) and its divergence
detector, so every rank stops, checkpoints or diverges at the same step.  docs/architecture.md, "Follow one
stop signal"."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import sys
import time
from dataclasses import dataclass

from rectrain.distributed import Dist

log = logging.getLogger(__name__)

# A stop signal repeated this long after the first dumps the rank's stacks (StopRequest).
STUCK_S = 10.0


class Agreed(Exception):
    """Every rank ends here together, as the ranks agreed (a clean stop, a divergence)."""


class Stopped(Agreed):
    """Raised on every rank once its stop checkpoint is written; the job exits with EXIT_STOPPED."""


def signal_numbers(names: list[str]) -> list[signal.Signals]:
    """train.stop_signals' names ('SIGTERM' or 'TERM') as signals; an unknown name says which exist."""
    out = []
    for name in names:
        full = name if name.upper().startswith("SIG") else f"SIG{name}"
        try:
            out.append(signal.Signals[full.upper()])
        except KeyError:
            raise ValueError(
                f"train.stop_signals names {name!r}, which is no signal here: use names such as SIGTERM, SIGINT, SIGUSR1"
            ) from None
    return out


class StopRequest:
    """The stop signal this process got (0: none), acted on at the next step boundary.  One repeated STUCK_S
    after the first dumps this process's stacks (a rank that does not reach its next step: that says where)."""

    def __init__(self) -> None:
        self.signum, self.since = 0, 0.0

    def handle(self, signum, frame) -> None:
        # The same signal often comes twice at once (to the process group and forwarded by torchrun):
        # only a repeat long after the first means this rank is not getting to its next step.
        if self.signum and time.monotonic() - self.since > STUCK_S:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if not self.signum:
            self.signum, self.since = signum, time.monotonic()


@contextlib.contextmanager
def handling(names: list[str]):
    """Within: the signals `names` set the yielded StopRequest instead of ending the process."""
    request = StopRequest()
    previous = {sig: signal.signal(sig, request.handle) for sig in signal_numbers(names)}
    try:
        yield request
    except Agreed:
        # Ended by agreement (stopped and checkpointed, or diverged): a late copy of the signal (torchrun ending
        # the peers of the first rank to exit) must not turn this rank's exit status into a kill.
        previous = dict.fromkeys(previous, signal.SIG_IGN)
        raise
    finally:
        for sig, handler in previous.items():  # one installed outside Python (faulthandler) reads as None
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@dataclass(frozen=True)
class Decision:
    """What every rank does after a step: stop (the signal's number, 0: go on), checkpoint first or not, or
    stop as diverged (no checkpoint then)."""

    signum: int = 0
    checkpoint: bool = False
    diverged: bool = False

    @property
    def stop(self) -> bool:
        return self.signum > 0

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


class Agreement:
    """The ranks' common answer after each optimizer step (see the module doc)."""

    def __init__(self, d: Dist, request: StopRequest, interval_min: float):
        self.d, self.request = d, request
        self.interval_s = float(interval_min) * 60
        self.last_checkpoint = time.monotonic()
        self.group = None
        # torch here, not at the top: the launcher imports this module for EXIT_STOPPED and the signals
        # (rectrain.distributed says why)
        import torch.distributed as dist

        if d.world_size > 1 and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # CPU tensors: no wait for the GPU

    def _due(self) -> bool:
        return self.d.master and self.interval_s > 0 and time.monotonic() - self.last_checkpoint >= self.interval_s

    def poll(self, diverged: bool = False) -> Decision:
        """Every rank calls this after the same step (`diverged`: its divergence detector tripped); all
        get the same Decision."""
        signum, due, any_diverged = self.any_of(self.request.signum, int(self._due()), int(diverged))
        return Decision(signum, checkpoint=bool(signum or due) and not any_diverged, diverged=bool(any_diverged))

    def any_of(self, *values: int) -> tuple[int, ...]:
        """Each of `values` as the most over every rank (an all-reduce MAX; each rank passes its own)."""
        import torch
        import torch.distributed as dist

        flags = torch.tensor(values, dtype=torch.int64)
        if self.d.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(int(v) for v in flags)

    def all_true(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (rank 0's checkpoint written: its answer reaches all)."""
        return self.any_of(0 if ok else 1) == (0,)

    def checkpointed(self) -> None:
        self.last_checkpoint = time.monotonic()
