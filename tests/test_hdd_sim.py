"""The simulated hard disk's cost model (bench/hdd_sim.py): what the HDD benchmark's numbers rest on."""

import os
import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import hdd_sim  # noqa: E402

DISK = hdd_sim.Disk(seek_s=0.0127, near_s=0.0052, bytes_per_s=100e6, skip_bytes=1 << 20, near_bytes=64 << 20)


def test_reading_on_costs_transfer_only_and_a_small_forward_gap_is_passed_over():
    head = hdd_sim.Head(DISK)
    head.at = 1000
    assert head.cost([(1000, 100_000)]) == pytest.approx(100_000 / 100e6)
    assert head.cost([(101_000 + 500_000, 100_000)]) == pytest.approx(600_000 / 100e6)
    assert head.stats["seeks"] == head.stats["short_seeks"] == 0


def test_a_jump_back_or_far_ahead_costs_a_seek_by_distance():
    head = hdd_sim.Head(DISK)
    head.at = 200 << 20
    assert head.cost([((200 << 20) - 4096, 0)]) == pytest.approx(DISK.near_s)  # 4 KiB back: short seek
    assert head.cost([(10 << 30, 0)]) == pytest.approx(DISK.seek_s)  # 10 GiB away: average seek
    assert (head.stats["short_seeks"], head.stats["seeks"]) == (1, 1)


def test_a_files_bytes_map_onto_its_extents():
    layout = [(0, 10_000, 4096), (4096, 90_000, 8192)]  # (logical, physical, length)
    assert hdd_sim.physical_spans(layout, 0, 4096) == [(10_000, 4096)]
    assert hdd_sim.physical_spans(layout, 4000, 200) == [(10_000 + 4000, 96), (90_000, 104)]
    assert hdd_sim.physical_spans(layout, 20_000, 10) == []


def test_a_file_of_several_extents_is_read_at_each_extents_own_place(tmp_path):
    """The FIEMAP records are 56 bytes (struct fiemap_extent): read 8 bytes short, every extent after the
    first was garbage, and a multi-extent .rec cost seeks it would not on a disk."""
    path = tmp_path / "holes.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    for k in range(3):
        os.pwrite(fd, bytes([k + 1]) * 8192, k << 20)  # three pieces with holes between them
    os.fsync(fd)
    os.close(fd)
    try:
        found = hdd_sim.extents(str(path))
    except OSError:
        pytest.skip("this file system has no FIEMAP")
    assert [(logical, length) for logical, _, length in found] == [(k << 20, 8192) for k in range(3)]
    assert len({physical for _, physical, _ in found}) == 3
