"""Where the .rec lives: which block device, whether it spins, whether it has room.

A .rec on a spinning disk starves the GPUs once the page cache runs out (a user's second GPU idled
at 0-10 % with ~47 % iowait, and nothing told them why).  The pack preflight and the training
telemetry both ask this module which device holds the file and whether it is rotational.

Resolution goes through sysfs: st_dev -> /sys/dev/block/MAJ:MIN -> the whole disk (a partition's
parent), then down device-mapper/md ``slaves/`` and loop ``loop/backing_file`` to the physical
disks, whose ``queue/rotational`` decides. The sysfs root is injectable (argument or
RECTRAIN_SYSFS_ROOT) so tests can fake an HDD.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SYSFS_ENV = "RECTRAIN_SYSFS_ROOT"

# Bytes per record beyond the image: 24-byte IRHeader + 8-byte frame header + up to 3 pad bytes.
RECORD_OVERHEAD = 36
# Resized ImageNet JPEGs (shorter side N) average about this many bytes per pixel of N*N at q90;
# scaled linearly with quality, it is a deliberately high estimate (never above the source size).
RESIZED_BYTES_PER_PIXEL_Q90 = 0.45
SPACE_MARGIN = 1.05

ROTATIONAL_WARNING = (
    "WARNING: fast_storage {path} is on a rotational disk ({device}). Once the page cache is exhausted "
    "the GPUs wait on the disk (on one such setup a second GPU idled at 0-10 % with ~47 % iowait and 500 "
    "steps went from 70 s to 5 min). Training reads such a .rec in blocks (train.order: auto picks the "
    "quasi-random order: 2 GiB of host memory per GPU, some randomness given up), never faster than the "
    "disk streams; a full permutation would seek once per image. "
    "Fix: point pack.fast_storage at a directory on an SSD/NVMe."
)


class StorageError(RuntimeError):
    """fast_storage cannot take the pack; the message says how much is needed and what is free."""


def _sysfs_root(sysfs_root=None) -> Path:
    return Path(sysfs_root or os.environ.get(SYSFS_ENV) or "/sys")


def existing_ancestor(path) -> Path:
    """The path itself or its nearest existing parent (fast_storage may not exist yet)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _device_dir(path, sysfs: Path) -> Path | None:
    """sysfs directory of the whole disk (not the partition) holding ``path``."""
    st = os.stat(existing_ancestor(path))
    link = sysfs / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if not link.exists():
        return None  # overlay, tmpfs, NFS...: no block device behind st_dev
    dev = Path(os.path.realpath(link))
    if (dev / "partition").exists():
        dev = dev.parent
    return dev


def _rotational(dev: Path, sysfs: Path, seen: set) -> bool | None:
    """True if any physical disk under ``dev`` spins; None when nothing is known."""
    if dev in seen:
        return None
    seen.add(dev)
    backing = _read(dev / "loop" / "backing_file")
    if backing:
        try:
            inner = _device_dir(backing, sysfs)
        except OSError:
            inner = None
        if inner is not None:
            return _rotational(inner, sysfs, seen)
    slaves_dir = dev / "slaves"
    slaves = sorted(slaves_dir.iterdir()) if slaves_dir.is_dir() else []
    if slaves:
        answers = []
        for slave in slaves:
            slave_dev = Path(os.path.realpath(slave))
            if (slave_dev / "partition").exists():
                slave_dev = slave_dev.parent
            answers.append(_rotational(slave_dev, sysfs, seen))
        if any(a is True for a in answers):
            return True
        if answers and all(a is False for a in answers):
            return False
    flag = _read(dev / "queue" / "rotational")
    return None if flag is None else flag == "1"


def block_device_for(path, sysfs_root=None) -> str | None:
    """Kernel name of the disk holding ``path`` ('nvme0n1', 'sda', 'dm-0', 'vda'), as used by
    /proc/diskstats and psutil.disk_io_counters(perdisk=True); None if there is no block device."""
    dev = _device_dir(path, _sysfs_root(sysfs_root))
    return dev.name if dev is not None else None


def device_info(path, sysfs_root=None) -> dict:
    """{path, device, rotational} for the disk under ``path``; rotational is None when unknown."""
    sysfs = _sysfs_root(sysfs_root)
    dev = _device_dir(path, sysfs)
    rotational = _rotational(dev, sysfs, set()) if dev is not None else None
    return {"path": os.path.abspath(path), "device": dev.name if dev is not None else None, "rotational": rotational}


def jpeg_bytes_per_pixel(quality: int) -> float:
    """The estimate's JPEG bytes per output pixel at `quality` (high for photos; noise takes more)."""
    return RESIZED_BYTES_PER_PIXEL_Q90 * max(quality, 50) / 90


def estimate_needed_bytes(
    source_bytes: int, records: int, resize: int, quality: int, reencoded_extra: int = 0, *, max_side: int = 0
) -> int:
    """Space a pack will take: the sources themselves for pass-through, a resized estimate otherwise,
    plus `reencoded_extra`: what re-encoding the non-JPEG sources adds beyond their own size (a 32 KB
    PNG of 0.27 gigapixels came out as a 4.19 MB JPEG).

    A longest side `max_side` is estimated as the full max_side x max_side square: most ImageNet
    images are within 500 px and pass through untouched, at more bytes per pixel than a re-encode
    (500x375 originals average ~110 KB, the square at q90 ~112 KB)."""
    side = resize if resize > 0 else max_side
    if side > 0:
        per_image = side * side * jpeg_bytes_per_pixel(quality)
        payload = min(source_bytes, int(per_image * records))
    else:
        payload = source_bytes
    return int((payload + reencoded_extra + RECORD_OVERHEAD * records) * SPACE_MARGIN)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def preflight(path, needed_bytes: int, sysfs_root=None) -> dict:
    """Check fast_storage before any work: room for ``needed_bytes`` and a non-rotational disk.

    Raises StorageError naming both numbers when it does not fit; returns
    {path, device, rotational, free_bytes, needed_bytes, warning} (warning None unless rotational).
    """
    info = device_info(path, sysfs_root)
    free = shutil.disk_usage(existing_ancestor(path)).free
    if needed_bytes > free:
        raise StorageError(
            f"fast_storage {info['path']} has {human_bytes(free)} ({free} bytes) free but this pack needs about "
            f"{human_bytes(needed_bytes)} ({needed_bytes} bytes). Free space there or point pack.fast_storage "
            "at a larger SSD."
        )
    warning = None
    if info["rotational"]:
        warning = ROTATIONAL_WARNING.format(path=info["path"], device=info["device"])
    return {**info, "free_bytes": free, "needed_bytes": int(needed_bytes), "warning": warning}
