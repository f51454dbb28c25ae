"""Block-device resolution through faked sysfs trees (partitions, device-mapper, loop) and the
fast_storage preflight."""

import os
import re

import pytest
from helpers.packdata import fake_sysfs

from rectrain import storage


def _dev_link(sysfs, path, target):
    st = os.stat(path)
    link = sysfs / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _disk(sysfs, name, rotational, bus="virtual"):
    d = sysfs / "devices" / bus / "block" / name
    (d / "queue").mkdir(parents=True)
    (d / "queue" / "rotational").write_text(f"{int(rotational)}\n")
    return d


def test_partition_resolves_to_its_disk_and_its_rotational_flag(tmp_path):
    sysfs = fake_sysfs(tmp_path / "sys", tmp_path, rotational=True)
    assert storage.block_device_for(tmp_path, sysfs) == "sdz"
    assert storage.device_info(tmp_path, sysfs)["rotational"] is True
    sysfs = fake_sysfs(tmp_path / "sys2", tmp_path, rotational=False, partition=False)
    assert storage.device_info(tmp_path, sysfs) == {"path": str(tmp_path), "device": "sdz", "rotational": False}


def test_env_var_selects_the_sysfs_root(tmp_path, monkeypatch):
    sysfs = fake_sysfs(tmp_path / "sys", tmp_path, rotational=True)
    monkeypatch.setenv(storage.SYSFS_ENV, str(sysfs))
    assert storage.device_info(tmp_path / "not" / "yet" / "created")["rotational"] is True


def test_device_mapper_over_an_hdd_is_rotational_even_if_dm_says_not(tmp_path):
    sysfs = tmp_path / "sys"
    hdd = _disk(sysfs, "sdb", True, bus="pci0000:00")
    (hdd / "sdb2").mkdir()
    (hdd / "sdb2" / "partition").write_text("2\n")
    ssd = _disk(sysfs, "nvme0n1", False, bus="pci0000:01")
    dm = _disk(sysfs, "dm-0", False)
    (dm / "slaves").mkdir()
    (dm / "slaves" / "sdb2").symlink_to(os.path.relpath(hdd / "sdb2", dm / "slaves"))
    (dm / "slaves" / "nvme0n1").symlink_to(os.path.relpath(ssd, dm / "slaves"))
    _dev_link(sysfs, tmp_path, dm)
    assert storage.device_info(tmp_path, sysfs) == {"path": str(tmp_path), "device": "dm-0", "rotational": True}
    (dm / "slaves" / "sdb2").unlink()
    assert storage.device_info(tmp_path, sysfs)["rotational"] is False


def test_loop_device_follows_its_backing_file(tmp_path):
    sysfs = tmp_path / "sys"
    loop = _disk(sysfs, "loop0", False)
    (loop / "loop").mkdir()
    (loop / "loop" / "backing_file").write_text("/proc/version\n")  # another filesystem than tmp_path
    hdd = _disk(sysfs, "sdc", True, bus="pci0000:00")
    _dev_link(sysfs, tmp_path, loop)
    _dev_link(sysfs, "/proc/version", hdd)
    info = storage.device_info(tmp_path, sysfs)
    assert info["device"] == "loop0" and info["rotational"] is True


def test_no_block_device_means_unknown_not_a_guess(tmp_path):
    empty = tmp_path / "sys"
    empty.mkdir()
    assert storage.device_info(tmp_path, empty)["rotational"] is None
    assert storage.block_device_for(tmp_path, empty) is None
    result = storage.preflight(tmp_path, 1, empty)
    assert result["warning"] is None and result["free_bytes"] > 0 and result["needed_bytes"] == 1


def test_real_sysfs_names_a_disk_psutil_knows():
    psutil = pytest.importorskip("psutil")
    name = storage.block_device_for("/", "/sys")
    if name is None:
        pytest.skip("the root filesystem has no block device here (overlay or tmpfs)")
    assert name in psutil.disk_io_counters(perdisk=True)


def test_preflight_refuses_an_impossible_size_naming_both_numbers(tmp_path):
    free = storage.shutil.disk_usage(tmp_path).free
    with pytest.raises(storage.StorageError) as err:
        storage.preflight(tmp_path / "fast", 10**18)
    reported = int(re.search(r"\((\d+) bytes\) free", str(err.value)).group(1))
    assert abs(reported - free) < 1 << 30  # other writers share the disk
    assert "needs about 888.2 PiB (1000000000000000000 bytes)" in str(err.value)
    assert not (tmp_path / "fast").exists()


def test_space_estimate_for_max_side_is_the_square_and_never_exceeds_the_sources():
    # 500x375 originals of ~110 KB mostly pass through a 500 px limit: the estimate must not fall below them
    capped = storage.estimate_needed_bytes(110_000 * 1000, 1000, 0, 90, max_side=500)
    assert 110_000 * 1000 <= capped <= storage.estimate_needed_bytes(110_000 * 1000, 1000, 0, 90)
    huge_sources = storage.estimate_needed_bytes(4_000_000 * 1000, 1000, 0, 90, max_side=500)
    assert huge_sources < 4_000_000 * 1000 / 20, "4 MB camera photos shrink to ~0.1 MB each"


def test_space_estimate_shrinks_with_resize_but_never_exceeds_the_sources():
    full = storage.estimate_needed_bytes(110_000 * 1000, 1000, 0, 90)
    resized = storage.estimate_needed_bytes(110_000 * 1000, 1000, 256, 90)
    tiny_sources = storage.estimate_needed_bytes(5_000 * 1000, 1000, 256, 90)
    assert full >= 110_000 * 1000 and resized < full / 2
    assert tiny_sources < 5_000 * 1000 * 1.2
