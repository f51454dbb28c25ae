"""The training resolution of each epoch (train.progressive): FFCV's progressive resizing
(libffcv/ffcv-imagenet, train_imagenet.py get_resolution): min_res up to and including epoch
start_ramp, max_res from epoch end_ramp on, and in between the straight line from one to the other
rounded to the nearest multiple of 32 (half to even, as numpy rounds).  Without a schedule every
epoch trains at train.image_size.

A pure function of the epoch and train.image_size / train.progressive, so every rank computes the same value and a resumed
run continues at the resolution an uninterrupted run would have used."""

from __future__ import annotations

ROUND_TO = 32  # FFCV rounds the ramp to multiples of 32 px


def resolution_at(epoch: int, image_size: int, progressive: dict | None = None) -> int:
    """The training crop (px) of `epoch` (0-based) under the ramp `progressive` (train.progressive), else
    image_size."""
    if not progressive:
        return int(image_size)
    lo, hi = int(progressive["min_res"]), int(progressive["max_res"])
    start, end = progressive["start_ramp"], progressive["end_ramp"]
    if epoch <= start:
        return lo
    if epoch >= end:
        return hi
    exact = lo + (hi - lo) * (epoch - start) / (end - start)
    return round(exact / ROUND_TO) * ROUND_TO


def resolutions(image_size: int, progressive: dict | None, epochs: int) -> list[int]:
    """The training crop of every epoch of the run, in order."""
    return [resolution_at(epoch, image_size, progressive) for epoch in range(int(epochs))]


def largest(image_size: int, progressive: dict | None, epochs: int) -> int:
    """The largest training crop of the run: what the memory preflight and the batch plan must fit."""
    return max(resolutions(image_size, progressive, epochs))
