"""Hangs end: a watchdog thread per rank that ends the job when it stops making progress.

Training and evaluation mark progress (`beat`) at every batch fetched, every step computed and every
phase (preflight, calibration, validation, checkpoint).  When a rank has made none for `timeout_s`
(train.watchdog_s) its watchdog logs which rank stalled and where, dumps the Python stacks of all its
threads (faulthandler) to the log and exits the process with STALL_EXIT; torchrun then ends the other
ranks, which dump their stacks too (SIGTERM is registered with faulthandler while watching).

Why a watchdog beside the collective timeout: a rank stalled in data loading (a hung network
filesystem) leaves its peers blocked in the next all-reduce, which the collective timeout ends - but
when every rank stalls in data loading, or in a single-process run, no collective is pending and
nothing would ever end the job.

Which rank stalled: with several ranks each watchdog publishes its progress (last beat, what it was
doing, its innermost frame) to <dir>/progress_rank<r>.json every few seconds.  A stalled rank waits
for input while its peers wait for it in a collective, so the ranks waiting for input are named, or,
when none is, the rank whose last progress is oldest.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from rectrain import atomic

log = logging.getLogger(__name__)

STALL_EXIT = 86
WAITING_FOR_INPUT = "from the loader"  # the phrase that marks a wait for input (see watched)
_active: Watchdog | None = None


def beat(what: str) -> None:
    """Progress on this rank, doing `what` now (no-op without an active watchdog)."""
    if _active is not None:
        _active.beat(what)


def watched(batches, what: str):
    """The batches, marking progress before each fetch (a wait for input) and after it."""
    it = iter(batches)
    i = 0
    while True:
        beat(f"{what}: waiting for batch {i} {WAITING_FOR_INPUT}")
        try:
            item = next(it)
        except StopIteration:
            return
        beat(f"{what}: computing batch {i}")
        yield item
        i += 1


def where(thread_id: int | None = None) -> str:
    """file:line in function of a thread's innermost rectrain frame (else its innermost frame)."""
    frame = sys._current_frames().get(thread_id or threading.main_thread().ident)
    if frame is None:
        return "unknown"
    stack = traceback.extract_stack(frame)
    ours = [f for f in stack if f"{os.sep}rectrain{os.sep}" in f.filename] or stack
    f = ours[-1]
    inner = stack[-1]
    tail = f" (innermost: {Path(inner.filename).name}:{inner.lineno} in {inner.name})" if inner is not f else ""
    return f"{_short(f.filename)}:{f.lineno} in {f.name}{tail}"


def _short(filename: str) -> str:
    parts = Path(filename).parts
    return "/".join(parts[parts.index("rectrain") :]) if "rectrain" in parts else filename


class Watchdog:
    def __init__(self, timeout_s: float, rank: int = 0, world_size: int = 1, progress_dir: Path | None = None):
        self.timeout_s, self.rank, self.world_size = float(timeout_s), rank, world_size
        self.progress_dir = Path(progress_dir) if progress_dir and world_size > 1 else None
        self.interval_s = max(0.05, min(5.0, self.timeout_s / 4))
        self._last, self._last_unix, self._what = time.monotonic(), time.time(), "starting"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rectrain-watchdog", daemon=True)

    def beat(self, what: str) -> None:
        self._last, self._last_unix, self._what = time.monotonic(), time.time(), what

    def __enter__(self) -> Watchdog:
        global _active
        if self.progress_dir:
            self.progress_dir.mkdir(parents=True, exist_ok=True)
        faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
        _active = self
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
        self._stop.set()
        self._thread.join()
        faulthandler.unregister(signal.SIGTERM)

    def _progress_file(self, rank: int) -> Path:
        return self.progress_dir / f"progress_rank{rank}.json"

    def _publish(self) -> None:
        state = {"rank": self.rank, "what": self._what, "last_progress": self._last_unix, "where": where()}
        with atomic.replacing(self._progress_file(self.rank), sync=False, mode="w") as f:  # rewritten every few s
            f.write(json.dumps(state))

    def _peers(self) -> list[dict]:
        peers = []
        for r in range(self.world_size) if self.progress_dir else ():
            try:
                peers.append(json.loads(self._progress_file(r).read_text()))
            except (OSError, ValueError):
                pass  # not written yet, or mid-replace: that rank is not known
        return peers

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.progress_dir:
                try:
                    self._publish()
                except OSError as err:
                    log.warning("watchdog: cannot write progress to %s: %s", self.progress_dir, err)
            idle = time.monotonic() - self._last
            if idle > self.timeout_s and not self._stop.is_set():
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        try:
            here = {"rank": self.rank, "what": self._what, "last_progress": self._last_unix, "where": where()}
            peers = {p["rank"]: p for p in self._peers()} | {self.rank: here}
            log.error(stall_report(self.rank, idle, self.timeout_s, list(peers.values())))
        except Exception:  # noqa: BLE001 - the report is best effort; the stacks and the exit are not
            log.exception("watchdog on rank %d: no progress for %.0f s; could not describe it", self.rank, idle)
        finally:
            for h in logging.getLogger().handlers:
                h.flush()
            print(f"Python stacks of rank {self.rank}, every thread:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            os._exit(STALL_EXIT)


def stalled_ranks(peers: list[dict]) -> list[dict]:
    """The ranks that stalled first: those waiting for input, else the one with the oldest progress."""
    waiting = [p for p in peers if WAITING_FOR_INPUT in p["what"]]
    return sorted(waiting, key=lambda p: p["rank"]) or [min(peers, key=lambda p: p["last_progress"])]


def stall_report(rank: int, idle: float, timeout_s: float, peers: list[dict]) -> str:
    """The log line a firing watchdog leaves: the stalled rank(s), what and where, and every rank seen."""
    now = time.time()
    stalled = stalled_ranks(peers)
    names = "; ".join(f"rank {p['rank']}, {p['what']}, at {p['where']}" for p in stalled)
    seen = "; ".join(
        f"rank {p['rank']}: {now - p['last_progress']:.0f} s since '{p['what']}'"
        for p in sorted(peers, key=lambda p: p["rank"])
    )
    return (
        f"watchdog on rank {rank}: no progress for {idle:.0f} s (train.watchdog_s = {timeout_s:g}); "
        f"stalled: {names}. Ranks: {seen}. Ending the job (exit {STALL_EXIT}); a stalled filesystem read "
        "or loader is the usual cause - the stacks below show where each thread was"
    )
