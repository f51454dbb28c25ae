"""Honest per-step timing without a per-step host sync.

On a GPU the host only queues work; timing a step on the host needs torch.cuda.synchronize() every
step, which drains the queue and leaves the GPU idle while the host fetches the next batch and
queues the next step.  Instead each step drops CUDA events at three points - end of the previous
step, data ready, end of this step - and its times are read one step later, when the event has long
completed, while the GPU is busy with the next step:

    wall      = end[k-1] -> end[k]        (GPU timeline)
    data wait = end[k-1] -> data[k]       GPU idle because step k's batch was not there yet
                                          (includes decode kernels queued by the loader)
    compute   = data[k]  -> end[k]

so wall = data wait + compute exactly.  On CPU the same marks are perf_counter readings (CPU work is
synchronous, nothing to defer).  The host stays at most one step ahead of the GPU.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            # One sync per clock (per epoch) anchors GPU event times to wall-clock time.
            torch.cuda.synchronize(device)
            self._anchor = self._event()
            self._anchor.synchronize()
        else:
            self._anchor = time.perf_counter()
        self._anchor_unix = time.time()

    def _event(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def mark(self):
        """A point on the device's timeline (a recorded CUDA event, or a perf_counter reading)."""
        return self._event() if self.cuda else time.perf_counter()

    def wait(self, mark) -> None:
        """Block until the device has reached `mark` (no-op on CPU)."""
        if self.cuda:
            mark.synchronize()

    def seconds(self, a, b) -> float:
        """Seconds from mark a to mark b; b must have been waited for."""
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a

    def unix_time(self, mark) -> float:
        """Wall-clock time (unix seconds) at which the device reached `mark`."""
        return self._anchor_unix + self.seconds(self._anchor, mark)
