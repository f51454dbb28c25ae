"""The pack's read order (pack.read_order, rectrain.data.readorder): raw images read in storage order -
archive members by offset, folders by path and inode - while the .rec keeps the seeded global
shuffle, byte for byte the one shuffled reads write; which order ran and why in the manifest; bucket
files gone after a kill; progress lines with done of total, img/s and ETA."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time

import numpy as np
import pytest
from helpers.packdata import REPO, corrupt_scan, fake_sysfs, jpeg, pack_args, photo, run_pack, write_dataset

from rectrain import storage
from rectrain.config import stage_block
from rectrain.data import images, pack, readorder
from rectrain.data.archives import SourceReader
from rectrain.recordio import read_idx

CLASSES = 10
PER_CLASS = 160
WORLD = 8


def _tiny_jpegs(count: int) -> list[bytes]:
    return [jpeg(photo(8 + i % 5, 8 + i % 3, i)) for i in range(count)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """CLASSES folders of PER_CLASS tiny JPEGs, indexed in sorted source order (class by class)."""
    root = tmp_path_factory.mktemp("folders")
    blobs = _tiny_jpegs(16)
    files = [
        (f"train/n{c:08d}/img_{i:04d}.JPEG", c, blobs[(c + i) % len(blobs)])
        for c in range(CLASSES)
        for i in range(PER_CLASS)
    ]
    raw, index = write_dataset(root, files, classes=CLASSES)
    return root, raw, index


def _pack(raw, index, out, read_order, seed=0, env=None):
    proc = run_pack(raw, index, out, cfg={"shuffle_seed": seed, "read_order": read_order}, env=env)
    assert proc.returncode == 0, proc.stderr
    return (out / "fast/train.rec").read_bytes(), (out / "fast/train.idx").read_bytes(), proc.stderr


def _labels_in_file_order(out, index) -> list[int]:
    labels = {int(f[0]): int(f[2]) for f in (r.split("\t") for r in (index / "train.tsv").read_text().splitlines()[1:])}
    return [labels[key] for key, _ in read_idx(out / "fast/train.idx")]


def _every_shard_holds_every_class_evenly(labels: list[int], world: int, classes: int) -> bool:
    """Each contiguous 1/world slice (a DALI shard) holds every class within 3.5 binomial standard
    deviations of its even share."""
    shard = len(labels) // world
    for r in range(world):
        counts = np.bincount(labels[r * shard : (r + 1) * shard], minlength=classes)
        mean = shard / classes
        sd = (shard * (1 / classes) * (1 - 1 / classes)) ** 0.5
        if counts.min() == 0 or np.abs(counts - mean).max() > 3.5 * sd:
            return False
    return True


def test_storage_order_writes_the_same_rec_as_shuffled_reads_and_it_is_globally_shuffled(folders, tmp_path):
    root, raw, index = folders
    storage_rec, storage_idx, log = _pack(raw, index, tmp_path / "storage", "storage")
    shuffled_rec, shuffled_idx, _ = _pack(raw, index, tmp_path / "shuffled", "shuffled")
    assert "read order storage: pack.read_order: storage in the config" in log
    assert storage_rec == shuffled_rec and storage_idx == shuffled_idx, "the read order must not change the .rec"
    labels = _labels_in_file_order(tmp_path / "storage", index)
    assert sorted(labels) == sorted(c for c in range(CLASSES) for _ in range(PER_CLASS))
    assert _every_shard_holds_every_class_evenly(labels, WORLD, CLASSES)
    # the check bites: the order the images are read in (class by class) fails it
    assert not _every_shard_holds_every_class_evenly(sorted(labels), WORLD, CLASSES)


def test_storage_order_is_deterministic_per_seed_and_another_seed_shuffles_otherwise(folders, tmp_path):
    root, raw, index = folders
    first = _pack(raw, index, tmp_path / "a", "storage", seed=3)
    again = _pack(raw, index, tmp_path / "b", "storage", seed=3)
    other = _pack(raw, index, tmp_path / "c", "storage", seed=4)
    assert first[:2] == again[:2]
    assert [k for k, _ in read_idx(tmp_path / "a/fast/train.idx")] != [
        k for k, _ in read_idx(tmp_path / "c/fast/train.idx")
    ]
    assert sorted(first[0]) == sorted(other[0]), "the same records, in another order"


# ---- what is read when ------------------------------------------------------------------------


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _mixed_dataset(root):
    """An official-style nested train.tar whose inner tars and members lie out of name order, and a
    folder whose files were created in reverse name order; indexed in sorted source order."""
    blobs = _tiny_jpegs(12)
    inner = {}
    for c, wnid in enumerate(("n001", "n002", "n003")):
        names = [f"{wnid}_{i}.JPEG" for i in range(8)]
        stored = names[3:] + names[:3][::-1]  # neither name order nor its reverse
        inner[wnid] = _tar([(name, blobs[(c * 8 + i) % 12]) for i, name in enumerate(stored)])
    files = [(f"train.tar::{w}.tar::{w}_{i}.JPEG", c, None) for c, w in enumerate(inner) for i in range(8)]
    folder = [(f"extra/n004/x_{i}.JPEG", 3, blobs[i]) for i in range(8)]
    (root / "raw/extra/n004").mkdir(parents=True)
    for source, _, data in folder[::-1]:  # created in reverse name order: inode order is not name order
        (root / "raw" / source).write_bytes(data)
    raw, index = write_dataset(root, sorted(files + folder), classes=4)  # rewrites in place: same inodes
    (raw / "train.tar").write_bytes(_tar([(f"{w}.tar", inner[w]) for w in ("n003", "n001", "n002")]))
    return raw, index


def test_archive_members_are_read_in_offset_order_and_folder_files_by_inode_by_one_reader(tmp_path, monkeypatch):
    raw, index = _mixed_dataset(tmp_path)
    reads, readers = [], set()
    real_span, real_read = SourceReader.read_span, SourceReader.read

    def read_span(self, rel, start, size, source=""):
        reads.append(("archive", rel, start))
        readers.add(threading.current_thread().name)
        return real_span(self, rel, start, size, source)

    def read(self, source):
        reads.append(("file", source, os.stat(raw / source).st_ino))
        readers.add(threading.current_thread().name)
        return real_read(self, source)

    monkeypatch.setattr(SourceReader, "read_span", read_span)
    monkeypatch.setattr(SourceReader, "read", read)
    monkeypatch.setattr(pack, "BATCH", 4)  # 8 batches for 3 worker threads
    args = pack_args(raw, index, tmp_path / "out", json.dumps({"read_order": "storage"}), threads=3)
    assert pack.main(args) == 0
    # one stream of reads: worker threads reading their own batches would interleave on the disk; and
    # not the main thread, which hands batches to the workers and spools their records meanwhile
    assert readers == {readorder.READER_THREAD}, f"raw reads came from {sorted(readers)}"
    offsets = [start for kind, rel, start in reads if kind == "archive"]
    inodes = [ino for kind, _, ino in reads if kind == "file"]
    assert len(offsets) == 24 and len(inodes) == 8 and {r[1] for r in reads if r[0] == "archive"} == {"train.tar"}
    assert offsets == sorted(offsets), "archive offsets read must never go backwards"
    assert inodes == sorted(inodes), "a folder's files are read by inode"
    # the index's (sorted source) order would have jumped back and forth in the archive
    members = [r.split("\t")[1] for r in (index / "train.tsv").read_text().splitlines()[1:] if "::" in r]
    with SourceReader(raw) as reader:
        in_index_order = [reader.locate(s)[1] for s in members]
    assert in_index_order != sorted(in_index_order)
    shuffled = run_pack(raw, index, tmp_path / "direct", cfg={"read_order": "shuffled"})
    assert shuffled.returncode == 0, shuffled.stderr
    assert (tmp_path / "out/fast/train.rec").read_bytes() == (tmp_path / "direct/fast/train.rec").read_bytes()


@pytest.mark.parametrize("order", ["storage", "shuffled"])
def test_the_scan_check_runs_on_every_pack_thread_at_once_and_still_skips_corrupt_scan_data(
    tmp_path, monkeypatch, order
):
    """pack.threads workers check scan data side by side, never the reader or the main thread: a
    barrier of `threads` parties inside the check passes only when that many checks run at once
    (serialised checks would break it, and every image would become a skip). A JPEG whose scan
    data is corrupt is still skipped by the check, with its reason, in either read order."""
    threads = 3
    files = [(f"a/x{i:03d}.JPEG", 0, jpeg(photo(24 + i % 7, 16 + i % 5, i))) for i in range(47)]
    files.append(("a/bad.JPEG", 0, corrupt_scan(jpeg(photo(300, 200, 8)))))
    raw, index = write_dataset(tmp_path, files, classes=1)
    together = threading.Barrier(threads, timeout=20)
    checkers, real_check = set(), images.check_scan

    def check_scan(data, info):
        name = threading.current_thread().name
        if name not in checkers:
            checkers.add(name)
            together.wait()  # each worker's first check waits until all of them are inside one
        return real_check(data, info)

    monkeypatch.setattr(images, "check_scan", check_scan)
    monkeypatch.setattr(pack, "BATCH", 4)  # 12 batches for 3 worker threads
    out = tmp_path / "out"
    args = pack_args(raw, index, out, json.dumps({"read_order": order, "max_skipped_share": 0.5}), threads=threads)
    assert pack.main(args) == 0
    assert len(checkers) == threads and all(name.startswith("pack_") for name in checkers), sorted(checkers)
    manifest = json.loads((out / "pack/train.manifest.json").read_text())
    assert [(s["source"], s["reason"]) for s in manifest["skipped_files"]] == [
        (
            "a/bad.JPEG",
            "corrupt JPEG scan data: libjpeg-turbo reports 'Corrupt JPEG data: premature end of data segment'",
        )
    ]
    assert manifest["packed"] == 47 and manifest["read_order"]["used"] == order


class _Slow:
    """A SourceReader stand-in: `size` bytes per source, counting what was read."""

    def __init__(self, size: int):
        self.size, self.reads = size, 0

    def read(self, source):
        self.reads += 1
        return bytes(self.size)


def _rows(n: int, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("a bug in the storage order")
        yield i, i, f"a/{i}.JPEG", 0, None


def test_read_ahead_keeps_the_read_order_and_stays_within_its_byte_budget():
    reader = _Slow(1000)
    with readorder.ReadAhead(_rows(200), reader, max_bytes=10_000) as ahead:
        got = []
        for item in ahead:
            time.sleep(0.001)  # a slow consumer: the reader waits at the budget
            got.append(item[0])
            # what the reader holds for the consumer, plus the item just taken
            assert reader.reads - len(got) <= 10 + 1, (reader.reads, len(got))
            assert item[4] == bytes(1000)
    assert got == list(range(200))


def test_read_ahead_raises_the_readers_own_error_in_the_consumer_and_stops_when_left_early():
    with pytest.raises(RuntimeError, match="a bug in the storage order"):
        with readorder.ReadAhead(_rows(50, fail_at=20), _Slow(10), max_bytes=1 << 20) as ahead:
            assert [item[0] for item in ahead] == list(range(20))
    reader = _Slow(10)
    ahead = readorder.ReadAhead(_rows(10_000), reader, max_bytes=100)
    with ahead:
        next(iter(ahead))
    assert not ahead._thread.is_alive() and reader.reads < 10_000


# ---- choice, manifest, progress -----------------------------------------------------------------


@pytest.mark.parametrize(
    "requested, rotational, used, says",
    [
        ("auto", True, "storage", "is on a rotational disk (sdz)"),
        ("auto", False, "shuffled", "is on a non-rotational device (sdz)"),
        ("auto", None, "storage", "no block device found under the raw root"),
        ("shuffled", True, "shuffled", "pack.read_order: shuffled in the config"),
    ],
)
def test_manifest_records_the_read_order_why_and_the_raw_devices_rotational_flag(
    tmp_path, requested, rotational, used, says
):
    raw, index = write_dataset(tmp_path, [(f"a/x{i}.JPEG", 0, jpeg(photo(20, 16, i))) for i in range(4)], classes=1)
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    if rotational is not None:
        fake_sysfs(sysfs, raw, rotational=rotational)
    proc = run_pack(raw, index, tmp_path / "out", cfg={"read_order": requested}, env={storage.SYSFS_ENV: str(sysfs)})
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "out/pack/train.manifest.json").read_text())["read_order"]
    assert (got["requested"], got["used"], got["raw"]["rotational"]) == (requested, used, rotational)
    assert says in got["reason"] and f"read order {used}: {got['reason']}" in proc.stderr
    assert got["raw"]["path"] == str(raw) and (got["buckets"] >= 1) == (used == "storage")


def test_progress_lines_say_images_done_of_total_img_per_s_and_eta(folders, tmp_path):
    root, raw, index = folders
    n = CLASSES * PER_CLASS
    assert stage_block("pack", "{}")["progress_s"] == 10 and stage_block("pack", "{}")["read_order"] == "auto"
    cfg = json.dumps({"read_order": "storage", "progress_s": 0.0001})
    cmd = [sys.executable, "-m", "rectrain.data.pack", *pack_args(raw, index, tmp_path / "out", cfg, threads=1)]
    proc = subprocess.run(
        cmd,
        env=dict(os.environ, PYTHONPATH=str(REPO / "workflow")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for step in ("pack train: read", "pack train: assemble", "verify train"):
        line = rf"^{step} (\d+)/{n} images \([\d.]+ %\): [\d.]+ img/s, ETA \d+ (?:s|min \d\d s|h \d\d min|d \d\d h)"
        lines = re.findall(line, proc.stderr, re.M)
        assert len(lines) >= 2 and int(lines[-1]) == n, f"{step}: {lines}"


# ---- temporaries ------------------------------------------------------------------------------


def _buckets(out):
    return sorted(p.name for p in (out / "fast").glob("*.bucket*"))


def test_a_kill_mid_pack_leaves_bucket_files_that_the_next_run_removes(tmp_path):
    # Many rows over a few CMYK sources (each one re-encoded), so the read phase takes seconds.
    sources = [(f"a/img{i}.JPEG", i % 2, jpeg(photo(320, 240, i).convert("CMYK"))) for i in range(4)]
    raw, index = write_dataset(tmp_path, [sources[i % 4] for i in range(800)], classes=2)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rectrain.data.pack", *pack_args(raw, index, out, '{"read_order": "storage"}')]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(REPO / "workflow")), stderr=subprocess.DEVNULL)
    bucket = out / "fast/train.rec.partial.bucket0000"
    deadline = time.time() + 60
    while time.time() < deadline and not (bucket.exists() and bucket.stat().st_size > 0):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _buckets(out) == [bucket.name], "the kill came after the buckets were opened"
    rerun = run_pack(raw, index, out, cfg={"read_order": "storage"})
    assert rerun.returncode == 0, rerun.stderr
    assert f"removing {bucket}, left by an interrupted pack" in rerun.stderr
    assert _buckets(out) == [] and not (out / "fast/train.rec.partial").exists()
    assert len(read_idx(out / "fast/train.idx")) == 800


def test_a_failed_pack_leaves_no_bucket_files(tmp_path):
    files = [(f"a/x{i}.JPEG", 0, jpeg(photo(20, 16, i))) for i in range(3)] + [("a/gone.JPEG", 0, b"")]
    raw, index = write_dataset(tmp_path, files, classes=1)
    (raw / "a/gone.JPEG").unlink()
    proc = run_pack(raw, index, tmp_path / "out", cfg={"read_order": "storage", "max_skipped_share": 0.0})
    assert proc.returncode == 4 and "above pack.max_skipped_share" in proc.stderr
    assert _buckets(tmp_path / "out") == [] and not (tmp_path / "out/fast/train.rec").exists()
