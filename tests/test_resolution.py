"""train.progressive: the per-epoch training resolution equals FFCV's get_resolution."""

import numpy as np
import pytest

from rectrain.train.resolution import largest, resolution_at, resolutions


def ffcv_resolution(epoch, min_res, max_res, end_ramp, start_ramp):
    # FFCV's formula as its train_imagenet.py states it (numpy interp, numpy round to 32 px)
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    return int(np.round(np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])[0] / 32)) * 32


@pytest.mark.parametrize(
    "epochs, ramp",
    [
        (88, dict(min_res=160, max_res=192, start_ramp=65, end_ramp=76)),
        (16, dict(min_res=160, max_res=192, start_ramp=11, end_ramp=13)),
        (40, dict(min_res=160, max_res=256, start_ramp=5, end_ramp=35)),
        (10, dict(min_res=96, max_res=96, start_ramp=2, end_ramp=2)),
    ],
)
def test_the_resolution_of_every_epoch_equals_ffcvs_get_resolution(epochs, ramp):
    cfg = {"image_size": 224, "epochs": epochs, "progressive": ramp}
    expected = [ffcv_resolution(e, **ramp) for e in range(epochs)]
    assert resolutions(cfg["image_size"], cfg["progressive"], cfg["epochs"]) == expected
    assert largest(cfg["image_size"], cfg["progressive"], cfg["epochs"]) == max(expected)


def test_without_a_schedule_every_epoch_trains_at_image_size():
    cfg = {"image_size": 176, "epochs": 5, "progressive": None}
    assert resolutions(cfg["image_size"], cfg["progressive"], cfg["epochs"]) == [176] * 5
    assert resolution_at(3, 64) == 64
