"""The pack trusts nothing it finds (issue #26 items 1-3, #24 item 6): links planted in the fast storage,
sources swapped after the index, files too large to hold, decompression bombs under the old limit, and a
fast-storage disk that fills up during the pack. Victims are files under tmp_path."""

import errno
import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from helpers.packdata import REPO, jpeg, pack_args, photo, png_bytes, run_pack, write_dataset
from helpers.views import view
from PIL import Image

from rectrain.data import images, pack, rawfiles
from rectrain.data.images import Skip, prepare
from rectrain.recordio import RecordWriter, read_idx

ORDERS = ["shuffled", "storage"]


def _dataset(tmp_path, n=4):
    files = [(f"a/x{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(n)]
    return write_dataset(tmp_path, files, classes=1)


def _manifest(out, split="train"):
    return json.loads((out / "pack" / f"{split}.manifest.json").read_text())


def _victim(tmp_path, text=b"the victim's own line\n"):
    victim = tmp_path / "victim" / "authorized_keys"
    victim.parent.mkdir()
    victim.write_bytes(text)
    return victim


# ---- links planted in <fast_storage>/<dataset>/ --------------------------------------------------


def test_a_lock_planted_as_a_link_to_a_victim_is_refused_and_the_victim_is_untouched(tmp_path):
    raw, index = _dataset(tmp_path)
    victim = _victim(tmp_path)
    (tmp_path / "out/fast").mkdir(parents=True)
    (tmp_path / "out/fast/.train.rec.lock").symlink_to(victim)
    proc = run_pack(raw, index, tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert "lock" in proc.stderr and f"is a symbolic link (to {victim})" in proc.stderr
    assert "remove the link and rerun" in proc.stderr
    assert victim.read_bytes() == b"the victim's own line\n"


@pytest.mark.parametrize("order", ORDERS)
def test_a_dangling_partial_or_bucket_link_is_removed_and_never_written_through(tmp_path, order):
    raw, index = _dataset(tmp_path)
    victim = tmp_path / "victim" / "authorized_keys"  # does not exist: the link dangles
    victim.parent.mkdir()
    fast = tmp_path / "out/fast"
    fast.mkdir(parents=True)
    planted = [fast / "train.rec.partial.bucket0000", fast / "train.rec.partial", fast / "train.idx.partial"]
    for link in planted:
        link.symlink_to(victim)
    proc = run_pack(raw, index, tmp_path / "out", cfg={"read_order": order})
    assert proc.returncode == 0, proc.stderr
    assert not os.path.lexists(victim), "the pack wrote through a planted link"
    assert f"removing {planted[0]}, left by an interrupted pack" in proc.stderr
    assert sorted(k for k, _ in read_idx(fast / "train.idx")) == [0, 1, 2, 3]
    assert not any(os.path.islink(p) for p in fast.iterdir())


def test_a_name_planted_between_the_cleanup_and_the_create_fails_the_write_not_the_victim(tmp_path):
    victim = _victim(tmp_path)
    rec, idx = tmp_path / "x.rec.partial", tmp_path / "x.idx.partial"
    rec.symlink_to(victim)
    with pytest.raises(FileExistsError):
        RecordWriter(rec, idx, new=True)
    assert victim.read_bytes() == b"the victim's own line\n"


def test_a_pack_folder_of_another_user_is_refused_naming_its_owner_and_the_fix(tmp_path):
    raw, index = _dataset(tmp_path)
    fast = tmp_path / "out/fast"
    fast.mkdir(parents=True)
    os.chown(fast, 54321, 54321)  # the tests run as root; a normal user's folder is the same case
    proc = run_pack(raw, index, tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert f"the pack's folder {fast} belongs to uid 54321, not to you" in proc.stderr
    assert "set pack.fast_storage to a directory you own" in proc.stderr
    assert list(fast.iterdir()) == []


def test_a_pack_folder_that_is_a_link_is_refused(tmp_path):
    raw, index = _dataset(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out/fast").symlink_to(elsewhere)
    proc = run_pack(raw, index, tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert f"the pack's folder {tmp_path / 'out/fast'} is a symbolic link (to {elsewhere}" in proc.stderr
    assert list(elsewhere.iterdir()) == []


def test_a_pack_folder_writable_by_others_is_made_unwritable_to_them_before_anything_is_created(tmp_path):
    raw, index = _dataset(tmp_path)
    fast = tmp_path / "out/fast"
    fast.mkdir(parents=True)
    fast.chmod(0o777)
    proc = run_pack(raw, index, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert fast.stat().st_mode & 0o777 == 0o755
    assert "was writable by other users (mode 777): now 755" in proc.stderr


def test_a_pack_folder_in_a_parent_others_may_write_without_the_sticky_bit_is_refused(tmp_path):
    raw, index = _dataset(tmp_path)
    shared = tmp_path / "out"
    shared.mkdir()
    shared.chmod(0o777)
    proc = run_pack(raw, index, shared)
    assert proc.returncode == 2, proc.stderr
    assert f"the pack's folder {shared} (the folder it is created in) is writable by other users" in proc.stderr


# ---- sources swapped after the index ---------------------------------------------------------------


def _skips(out) -> dict:
    return {s["source"]: s["reason"] for s in _manifest(out)["skipped_files"]}


@pytest.mark.parametrize("order", ORDERS)
def test_an_image_swapped_for_a_link_outside_the_raw_root_after_indexing_is_skipped(tmp_path, order):
    raw, index = _dataset(tmp_path)
    secret = tmp_path / "secret.JPEG"
    secret.write_bytes(jpeg(photo(40, 30, 99)))  # a readable image: only the rule keeps it out
    (raw / "a/x1.JPEG").unlink()
    (raw / "a/x1.JPEG").symlink_to(secret)
    out = tmp_path / "out"
    proc = run_pack(raw, index, out, cfg={"read_order": order})
    assert proc.returncode == 0, proc.stderr
    assert _skips(out) == {"a/x1.JPEG": f"outside the raw root: a/x1.JPEG now resolves to {secret}"}
    assert _manifest(out)["packed"] == 3


def test_a_link_that_stays_inside_the_raw_root_is_still_packed(tmp_path):
    raw, index = _dataset(tmp_path)
    (raw / "a/x1.JPEG").rename(raw / "a/elsewhere.JPEG")
    (raw / "a/x1.JPEG").symlink_to(raw / "a/elsewhere.JPEG")  # as the index admits it
    out = tmp_path / "out"
    assert run_pack(raw, index, out).returncode == 0
    assert _manifest(out)["skipped"] == 0


@pytest.mark.parametrize("order", ORDERS)
def test_an_image_swapped_for_a_fifo_after_indexing_is_a_skip_not_a_hang(tmp_path, order):
    raw, index = _dataset(tmp_path)
    (raw / "a/x2.JPEG").unlink()
    os.mkfifo(raw / "a/x2.JPEG")  # nobody ever writes to it: a blocking open or read waits forever
    out = tmp_path / "out"
    proc = run_pack(raw, index, out, cfg={"read_order": order}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert _skips(out) == {"a/x2.JPEG": "not a regular file: a/x2.JPEG is now a named pipe (FIFO)"}


def test_a_file_deleted_after_indexing_is_a_skip_naming_it_and_the_counts_add_up(tmp_path):
    raw, index = _dataset(tmp_path, n=5)
    (raw / "a/x3.JPEG").unlink()
    out = tmp_path / "out"
    proc = run_pack(raw, index, out)
    assert proc.returncode == 0, proc.stderr
    reason = _skips(out)["a/x3.JPEG"]
    assert reason.startswith("missing since the index: a/x3.JPEG is no longer under the raw root")
    m = _manifest(out)
    assert (m["discovered"], m["packed"], m["skipped"]) == (5, 4, 1)


def test_a_file_that_changes_size_while_it_is_read_is_refused_naming_it(tmp_path, monkeypatch):
    raw, _ = _dataset(tmp_path)
    files = rawfiles.RawFiles(raw, 1 << 20)
    real_fstat = os.fstat
    monkeypatch.setattr(
        rawfiles.os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 100, *real_fstat(fd)[7:]))
    )
    with pytest.raises(rawfiles.Refused, match=r"^changed while read: a/x0.JPEG had 100 bytes when opened and more"):
        files.read(raw / "a/x0.JPEG")


@pytest.mark.parametrize("order", ORDERS)
def test_an_image_above_max_image_bytes_is_skipped_naming_the_limit(tmp_path, order):
    raw, index = _dataset(tmp_path)
    size = (raw / "a/x0.JPEG").stat().st_size
    out = tmp_path / "out"
    proc = run_pack(raw, index, out, cfg={"max_image_bytes": size - 1, "read_order": order})
    assert proc.returncode == 0, proc.stderr
    assert _skips(out)["a/x0.JPEG"] == (
        f"too large: a/x0.JPEG has {size} bytes, above pack.max_image_bytes = {size - 1} "
        "(no photo is that large; raise the limit if yours are)"
    )


# ---- bounded memory ----------------------------------------------------------------------------------

# Measured here with 2 threads: 264 MB peak in the shuffled order, 469 MB in the storage order (up to
# 256 MiB of read-ahead waits for the workers); today's code took 2.13 GB with one thread (issue #26).
PEAK_RSS_BOUND_MB = 700

# VmHWM, the peak of the pack process's own memory: ru_maxrss can carry the forking pytest's peak over
# exec (the whole suite's pytest holds GBs), which failed this test inside the full run only.
_MEASURE = """
import re, sys
from rectrain.data import pack
budget = int(sys.argv.pop(1))  # bytes in flight; 0 = the pack's own
if budget:
    pack.BATCH_BYTES, pack.IN_FLIGHT_BYTES = budget // 8, budget
status = pack.main(sys.argv[1:])
print("PEAK_KB", re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1), file=sys.stderr)
sys.exit(status)
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ORDERS)
def test_forty_sparse_50mb_images_are_all_skipped_within_a_bounded_peak_memory(tmp_path, order):
    files = [(f"a/big{i}.JPEG", 0, b"") for i in range(40)]
    raw, index = write_dataset(tmp_path, files, classes=1)
    for i in range(40):
        subprocess.run(["truncate", "-s", "50M", str(raw / f"a/big{i}.JPEG")], check=True)
    cfg = json.dumps({"max_skipped_share": 1.0, "read_order": order})
    proc, peak_mb = _peak_rss(raw, index, tmp_path / "out", cfg)
    assert proc.returncode == 4, proc.stderr  # all skipped: nothing to publish
    assert "all 40 images of split train were skipped" in proc.stderr
    assert "40 x not an image" in proc.stderr
    assert peak_mb < PEAK_RSS_BOUND_MB, f"peak RSS {peak_mb:.0f} MB"


def _peak_rss(raw, index, out, cfg_json: str, budget: int = 0) -> tuple[subprocess.CompletedProcess, float]:
    """Run the pack in a process of its own; (the process, its peak RSS in MB)."""
    cmd = [sys.executable, "-c", _MEASURE, str(budget), *pack_args(raw, index, out, cfg_json, threads=2)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return proc, int(proc.stderr.rsplit("PEAK_KB", 1)[1].split()[0]) / 1024


@pytest.mark.slow
@pytest.mark.parametrize("order", ORDERS)
def test_large_valid_images_in_flight_stay_within_the_byte_budget(tmp_path, order):
    rng = np.random.default_rng(0)
    big = jpeg(Image.fromarray(rng.integers(0, 256, (1400, 1800, 3), dtype=np.uint8)), quality=100)
    budget = 24 << 20
    peaks = {}
    for n in (2, 30):  # the same images, 2 of them (nothing to pile up) and 30 (~170 MB, 7x the budget)
        raw, index = write_dataset(tmp_path / str(n), [(f"a/big{i}.JPEG", 0, big) for i in range(n)], classes=1)
        cfg = json.dumps({"read_order": order, "check_scan_data": False})
        proc, peaks[n] = _peak_rss(raw, index, tmp_path / str(n) / "out", cfg, budget)
        assert proc.returncode == 0, proc.stderr
    print(f"{order}: {len(big) / 1e6:.1f} MB images, peak {peaks[2]:.0f} MB with 2, {peaks[30]:.0f} MB with 30")
    # the budget, plus per thread the image being worked on, its record, its frame and freed buffers the
    # allocator keeps (pack._keep_freed_memory), plus the batch being cut: measured 41-51 MB (shuffled)
    # and 41 MB (storage) more with 30 here; the code before took 248 MB more (shuffled). Storage order
    # also reads ahead on a thread of its own (readorder.ReadAhead): up to pack.BATCH_BYTES waiting and
    # the image in its hand - 74.6 MB more with 30 once in CI, over the bound that did not count it.
    ahead = pack.BATCH_BYTES + len(big) if order == "storage" else 0
    assert peaks[30] - peaks[2] < (budget + ahead + 10 * len(big)) / (1 << 20), peaks


def test_a_skip_result_holds_its_message_not_the_image_bytes(tmp_path):
    raw, _ = _dataset(tmp_path, n=1)
    (raw / "a/x0.JPEG").write_bytes(b"\0" * 100_000)
    packer = pack._Packer(str(raw), view("pack", resize=0, quality=90, check_scan_data=True, max_image_bytes=1 << 20))
    (result,) = packer.batch([(0, 0, "a/x0.JPEG", 0, None)])
    assert isinstance(result, Skip) and str(result).startswith("not an image")
    assert result.__traceback__ is None and result.__context__ is None


def _png_bomb(width: int, height: int) -> bytes:
    """A real grayscale PNG of zeros, compressed row by row: tens of KB that decode to width x height bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    z, row, parts = zlib.compressobj(9), b"\0" * (width + 1), []
    for _ in range(height):
        parts.append(z.compress(row))
    parts.append(z.flush())
    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


def test_a_png_bomb_under_the_old_gigapixel_limit_is_skipped_before_its_decode():
    bomb = _png_bomb(16000, 16000)  # 0.26 gigapixels; issue #26: 0.27 took 1.37 GB to decode
    assert len(bomb) < 1 << 20 and 16000 * 16000 < 1 << 30
    with pytest.raises(Skip, match=r"^decompression bomb guard: the PNG header says 16000x16000 \(256 megapixels\)"):
        prepare(bomb, 0, 90)
    assert images.MAX_PIXELS < 16000 * 16000


def _gradient_png(width: int, height: int) -> bytes:
    """A smooth gradient: a few KB as PNG, far more as the JPEG the pack re-encodes it to."""
    x = np.broadcast_to(np.arange(width) * 255 // (width - 1), (height, width))  # every row alike: PNG's Up filter
    rgb = np.stack([x, 255 - x, x // 2], -1)
    return png_bytes(Image.fromarray(rgb.astype(np.uint8)))


def test_the_free_space_estimate_allows_for_pngs_re_encoded_larger_than_their_source(tmp_path):
    files = [(f"a/flat{i}.png", 0, _gradient_png(1200 + 8 * i, 900)) for i in range(3)]
    raw, index = write_dataset(tmp_path, files, classes=1)
    out = tmp_path / "out"
    proc = run_pack(raw, index, out)
    assert proc.returncode == 0, proc.stderr
    m = _manifest(out)
    source = sum(len(data) for _, _, data in files)
    assert m["bytes_written"] > 2 * source, "the case: outputs well above the sources"
    assert m["storage"]["needed_bytes"] >= m["bytes_written"]


# ---- a fast-storage disk that fills up during the pack ----------------------------------------------


def _pack_here(raw, index, out, cfg):
    return pack.main(pack_args(raw, index, out, json.dumps({"max_skipped_share": 0.5, **cfg}), threads=2))


def _nothing_left(fast):
    return sorted(p.name for p in fast.iterdir()) == [".train.rec.lock"]


@pytest.mark.parametrize("order", ORDERS)
def test_a_write_failing_with_enospc_stops_the_pack_naming_what_it_wrote_and_needs(
    tmp_path, monkeypatch, capsys, order
):
    raw, index = _dataset(tmp_path, n=8)
    out, calls = tmp_path / "out", []
    real = RecordWriter.write_framed if order == "shuffled" else pack.readorder.Buckets.put
    owner = RecordWriter if order == "shuffled" else pack.readorder.Buckets

    def fills_up(self, *args):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args)

    monkeypatch.setattr(owner, "write_framed" if order == "shuffled" else "put", fills_up)
    assert _pack_here(raw, index, out, {"read_order": order}) == 2
    err = capsys.readouterr().err
    assert f"fast_storage {out / 'fast'} filled up during the pack of train (No space left on device)" in err
    assert "bytes written for 4 of 8 images; at that rate the split needs about" in err
    assert "nothing was published" in err
    assert _nothing_left(out / "fast") and not (out / "pack/train.manifest.json").exists()
    monkeypatch.undo()
    assert _pack_here(raw, index, out, {"read_order": order}) == 0


def _mount_tmpfs(where, size):
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}); the ENOSPC unit test covers it")


@pytest.mark.parametrize("order", ORDERS)
def test_a_real_full_disk_during_the_pack_publishes_nothing_and_a_rerun_after_freeing_space_completes(
    tmp_path, monkeypatch, capsys, order
):
    files = [(f"a/x{i}.JPEG", 0, jpeg(photo(160, 120, i), quality=95)) for i in range(40)]
    raw, index = write_dataset(tmp_path, files, classes=1)
    out = tmp_path / "out"
    out.mkdir()
    _mount_tmpfs(out / "fast", "2m")
    try:
        filler = out / "fast" / "another-job.bin"
        real_preflight = pack.storage.preflight

        def then_another_job_writes(path, needed, *args):
            result = real_preflight(path, needed, *args)  # the estimate fits: the disk fills after it
            free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
            filler.write_bytes(b"\1" * (free - needed // 4))
            return result

        monkeypatch.setattr(pack.storage, "preflight", then_another_job_writes)
        assert _pack_here(raw, index, out, {"read_order": order}) == 2
        assert "filled up during the pack of train (No space left on device)" in capsys.readouterr().err
        assert sorted(p.name for p in (out / "fast").iterdir()) == [".train.rec.lock", "another-job.bin"]
        monkeypatch.undo()
        filler.unlink()
        assert _pack_here(raw, index, out, {"read_order": order}) == 0
        assert len(read_idx(out / "fast/train.idx")) == 40
    finally:
        subprocess.run(["umount", str(out / "fast")], check=False)


# ---- a pair belongs to one run -------------------------------------------------------------------


def test_two_working_directories_sharing_a_pair_the_second_is_refused_naming_the_first(tmp_path):
    raw, index = _dataset(tmp_path)
    first, second = tmp_path / "run1", tmp_path / "run2"
    first.mkdir(), second.mkdir()
    out = tmp_path / "shared"  # an absolute fast_storage both runs name, as config/imagenet-2gpu.yaml does
    assert run_pack(raw, index, out, cwd=first).returncode == 0
    rec = out / "fast/train.rec"
    before = rec.read_bytes()
    proc = run_pack(raw, index, out, cwd=second)
    assert proc.returncode == 2, proc.stderr
    assert f"{rec} belongs to the run in {first} (packed on " in proc.stderr
    assert f"this run in {second} shares its pack.fast_storage" in proc.stderr
    assert "Give this run a pack.fast_storage of its own" in proc.stderr
    assert rec.read_bytes() == before and (out / "fast/train.idx").exists(), "the first run's pair is untouched"
    assert run_pack(raw, index, out, cwd=first).returncode == 0, "its own run repacks it"
    first.rmdir()  # that run is gone: its pair is no longer its own
    assert run_pack(raw, index, out, cwd=second).returncode == 0
