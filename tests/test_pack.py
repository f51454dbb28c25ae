"""The packer: shuffled ids/labels, pass-through bytes, repairs and skips, resize, verification,
atomic publishing under SIGKILL, storage warnings and the space preflight."""

import io
import json
import os
import signal
import time
from pathlib import Path

import cv2
import numpy as np
import psutil
import pytest
from helpers.packdata import (
    EXPECTED,
    fake_sysfs,
    jpeg,
    kinds,
    kinds_dataset,
    pack_args,
    photo,
    png_bytes,
    run_pack,
    write_dataset,
)
from PIL import Image

from rectrain import cli, storage
from rectrain.data import images, pack
from rectrain.data.images import Skip, prepare, read_jpeg_header
from rectrain.data.verify import main as verify_main
from rectrain.recordio import IndexedRecordReader, read_idx, unpack_record


def _records(out):
    reader = IndexedRecordReader(out / "fast" / "train.rec", out / "fast" / "train.idx")
    return reader, {key: unpack_record(payload) for key, payload in reader}


def _manifest(out):
    return json.loads((out / "pack" / "train.manifest.json").read_text())


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    raw, index, kind_of = kinds_dataset(root)
    proc = run_pack(raw, index, root / "out")
    assert proc.returncode == 0, proc.stderr
    return root / "out", raw, index, kind_of, proc.stderr


def test_every_index_row_is_packed_or_skipped_and_counts_add_up(packed):
    out, _, index, kind_of, _ = packed
    m = _manifest(out)
    n_rows = len((index / "train.tsv").read_text().splitlines()) - 1
    assert m["discovered"] == n_rows == m["packed"] + m["skipped"]
    reader, records = _records(out)
    skipped = {s["id"] for s in m["skipped_files"]}
    assert set(reader.keys) | skipped == set(range(n_rows)) and not set(reader.keys) & skipped
    assert m["bytes_written"] == os.path.getsize(out / "fast" / "train.rec")
    assert m["images_per_s"] > 0 and m["mb_per_s"] > 0 and m["wall_s"] > 0


def test_records_carry_index_ids_and_labels_in_shuffled_order(packed):
    out, _, index, _, _ = packed
    labels = {
        int(line.split("\t")[0]): int(line.split("\t")[2])
        for line in (index / "train.tsv").read_text().splitlines()[1:]
    }
    reader, records = _records(out)
    for key, (header, _) in records.items():
        assert header.id == key and header.flag == 0 and header.label == labels[key]
    assert reader.keys != sorted(reader.keys), "records must be written in shuffled order"


def test_same_seed_gives_identical_files_and_another_seed_another_order(packed, tmp_path):
    out, raw, index, _, _ = packed
    again = run_pack(raw, index, tmp_path / "same")
    other = run_pack(raw, index, tmp_path / "other", cfg={"shuffle_seed": 1})
    assert again.returncode == 0 and other.returncode == 0
    assert (tmp_path / "same/fast/train.rec").read_bytes() == (out / "fast/train.rec").read_bytes()
    assert (tmp_path / "same/fast/train.idx").read_bytes() == (out / "fast/train.idx").read_bytes()
    order = [k for k, _ in read_idx(out / "fast/train.idx")]
    assert [k for k, _ in read_idx(tmp_path / "other/fast/train.idx")] != order


def test_clean_jpegs_pass_through_byte_for_byte(packed):
    out, _, _, kind_of, _ = packed
    _, records = _records(out)
    content = kinds()
    for rid, kind in kind_of.items():
        if EXPECTED[kind] == "keep":
            assert records[rid][1] == content[kind], f"{kind} was re-encoded"


def test_defects_are_repaired_as_rgb_or_skipped_with_reasons(packed):
    out, _, _, kind_of, log = packed
    m = _manifest(out)
    _, records = _records(out)
    repaired = {r["id"]: r["reason"] for r in m["repaired"]}
    skipped = {s["id"]: s["reason"] for s in m["skipped_files"]}
    by_kind = {kind: rid for rid, kind in kind_of.items()}
    assert set(repaired) == {by_kind[k] for k, v in EXPECTED.items() if v == "repair"}
    assert set(skipped) == {by_kind[k] for k, v in EXPECTED.items() if v == "skip"}
    assert "CMYK" in repaired[by_kind["cmyk"]]
    assert "PNG" in repaired[by_kind["png"]]
    assert "EXIF orientation 6" in repaired[by_kind["exif_rotated"]]
    assert "truncated" in skipped[by_kind["truncated"]]
    assert "empty" in skipped[by_kind["zero_byte"]]
    assert "not an image" in skipped[by_kind["not_image"]]
    for rid in repaired:
        with Image.open(io.BytesIO(records[rid][1])) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
    # orientation 6 stored a 90x120 rotated image: applied, it is the original 120x90 again
    assert Image.open(io.BytesIO(records[by_kind["exif_rotated"]][1])).size == (120, 90)
    for rid, reason in {**repaired, **skipped}.items():
        assert f"id {rid} " in log and reason in log


def test_resize_sets_the_shorter_side_and_never_upscales(tmp_path):
    big_wide, big_tall, small = photo(200, 150, 1), photo(150, 300, 2), photo(50, 40, 3)
    files = [
        ("a/wide.JPEG", 0, jpeg(big_wide)),
        ("a/tall.JPEG", 1, jpeg(big_tall)),
        ("a/small.JPEG", 0, jpeg(small)),
        ("a/cmyk_small.JPEG", 1, jpeg(small.convert("CMYK"))),
    ]
    raw, index = write_dataset(tmp_path, files, classes=2)
    proc = run_pack(raw, index, tmp_path / "out", cfg={"resize": 64, "quality": 80})
    assert proc.returncode == 0, proc.stderr
    _, records = _records(tmp_path / "out")
    sizes = {rid: Image.open(io.BytesIO(img)).size for rid, (_, img) in records.items()}
    assert sizes == {0: (85, 64), 1: (64, 128), 2: (50, 40), 3: (50, 40)}
    assert records[2][1] == files[2][2], "a clean JPEG already small enough is stored as is"
    # colours survive the YCbCr decode -> shrink -> encode path
    stored = np.asarray(Image.open(io.BytesIO(records[0][1])).convert("RGB"), dtype=float)
    reference = np.asarray(big_wide.resize((85, 64), Image.Resampling.BILINEAR), dtype=float)
    assert np.abs(stored - reference).mean() < 6
    assert Image.open(io.BytesIO(records[3][1])).mode == "RGB"
    assert _manifest(tmp_path / "out")["resize"] == 64


def test_max_side_sets_the_longest_side_and_passes_smaller_images_through(tmp_path):
    wide, tall, inside = photo(400, 300, 1), photo(150, 300, 2), photo(120, 90, 3)
    files = [
        ("a/wide.JPEG", 0, jpeg(wide)),
        ("a/tall.JPEG", 1, jpeg(tall)),
        ("a/inside.JPEG", 0, jpeg(inside)),  # longest side 120 < 128: untouched
        ("a/png_big.png", 1, png_bytes(photo(256, 64, 4))),  # the Pillow path (a repair) honours it too
    ]
    raw, index = write_dataset(tmp_path, files, classes=2)
    proc = run_pack(raw, index, tmp_path / "out", cfg={"max_side": 128, "quality": 80})
    assert proc.returncode == 0, proc.stderr
    _, records = _records(tmp_path / "out")
    sizes = {rid: Image.open(io.BytesIO(img)).size for rid, (_, img) in records.items()}
    assert sizes == {0: (128, 96), 1: (64, 128), 2: (120, 90), 3: (128, 32)}
    assert records[2][1] == files[2][2], "a clean JPEG within max_side is stored as is"
    stored = np.asarray(Image.open(io.BytesIO(records[0][1])).convert("RGB"), dtype=float)
    reference = np.asarray(wide.resize((128, 96), Image.Resampling.BILINEAR), dtype=float)
    assert np.abs(stored - reference).mean() < 6
    m = _manifest(tmp_path / "out")
    assert (m["max_side"], m["resize"], m["quality"]) == (128, 0, 80)


def test_resize_and_max_side_together_are_refused_naming_both_keys(tmp_path):
    raw, index = write_dataset(tmp_path, [("a/x.JPEG", 0, jpeg(photo(64, 48, 1)))], classes=1)
    proc = run_pack(raw, index, tmp_path / "out", cfg={"resize": 64, "max_side": 128})
    assert proc.returncode == 2, proc.stderr
    assert "'pack.resize' = 64 and 'pack.max_side' = 128 are both set" in proc.stderr
    assert not (tmp_path / "out" / "fast" / "train.rec").exists()


def test_verify_refuses_a_record_above_the_max_side_it_was_packed_with(tmp_path):
    raw, index = write_dataset(tmp_path, [("a/x.JPEG", 0, jpeg(photo(200, 100, 1)))], classes=1)
    assert run_pack(raw, index, tmp_path / "out").returncode == 0
    fast = tmp_path / "out" / "fast"
    args = ["--rec", str(fast / "train.rec"), "--idx", str(fast / "train.idx"), "--index", str(index)]
    assert verify_main([*args, "--split", "train", "--max-side", "200"]) == 0
    assert verify_main([*args, "--split", "train", "--max-side", "150"]) == 1


def test_resized_records_are_byte_identical_whatever_the_worker_count(tmp_path):
    # draft-decoded (source >= 2x the target), directly shrunk, repaired and kept-as-is images
    shapes = [(400, 300), (300, 520), (120, 90), (200, 150), (60, 50), (90, 160)] * 3
    files = [(f"a/p{i:02d}.JPEG", i % 2, jpeg(photo(w, h, i))) for i, (w, h) in enumerate(shapes)]
    files.append(("a/q_cmyk.JPEG", 1, jpeg(photo(200, 150, 9).convert("CMYK"))))
    shorter = [min(64, w, h) for w, h in shapes] + [64]  # ids follow the sorted source names
    raw, index = write_dataset(tmp_path, files, classes=2)
    cfg = {"resize": 64, "quality": 85}
    one = run_pack(raw, index, tmp_path / "one", cfg=cfg, threads=1)
    three = run_pack(raw, index, tmp_path / "three", cfg=cfg, threads=3)
    assert one.returncode == 0 and three.returncode == 0, one.stderr + three.stderr
    for name in ("train.rec", "train.idx"):
        assert (tmp_path / "one/fast" / name).read_bytes() == (tmp_path / "three/fast" / name).read_bytes()
    _, records = _records(tmp_path / "three")
    assert {rid: min(Image.open(io.BytesIO(img)).size) for rid, (_, img) in records.items()} == dict(enumerate(shorter))


def _rgb(data):
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=float)


def test_simplejpeg_resize_matches_the_pillow_path_and_decodes_reduced_when_it_can(monkeypatch):
    pytest.importorskip("simplejpeg")
    decoded = []
    decode = images.simplejpeg.decode_jpeg

    def spy(*args, **kwargs):
        pixels = decode(*args, **kwargs)
        decoded.append(pixels.shape)
        return pixels

    monkeypatch.setattr(images.simplejpeg, "decode_jpeg", spy)
    # to a shorter side of 128: decoded at full size (150), 1/2 (150 of 300), 1/8 (138 of 1100), gray
    sources = {
        "wide": jpeg(photo(200, 150, 4)),
        "tall": jpeg(photo(300, 600, 5)),
        "big": jpeg(photo(1100, 1200, 6)),
        "gray": jpeg(photo(300, 200, 7).convert("L")),
    }
    fast = {name: prepare(data, 128, 90) for name, data in sources.items()}
    assert decoded == [(150, 200, 3), (300, 150, 3), (150, 138, 3), (200, 300, 3)]
    monkeypatch.setattr(images, "simplejpeg", None)
    pillow = {name: prepare(data, 128, 90) for name, data in sources.items()}
    for name in sources:
        assert fast[name][1] is None and pillow[name][1] is None, "a clean JPEG is not a repair"
        ours, theirs = _rgb(fast[name][0]), _rgb(pillow[name][0])
        assert ours.shape == theirs.shape and min(ours.shape[:2]) == 128, name
        mse = np.mean((ours - theirs) ** 2)
        assert mse < 255**2 / 10**3.8, f"{name}: the two decoders disagree (PSNR under 38 dB, MSE {mse:.1f})"


@pytest.mark.parametrize("width", [375, 1000])  # the ratio left after a DCT reduction; a PNG's
def test_shrink_suppresses_moire_like_an_area_average_where_bilinear_does_not(width):
    stripes = np.zeros((200, width, 3), np.uint8)
    stripes[:, ::2] = 255  # the finest detail an image holds: it must average out, not alias
    size = (256, 150)
    ours = images.shrink(stripes, size).astype(float)
    area = cv2.resize(stripes, size, interpolation=cv2.INTER_AREA).astype(float)
    bilinear = cv2.resize(stripes, size, interpolation=cv2.INTER_LINEAR).astype(float)
    assert ours.shape == (150, 256, 3) and abs(ours.mean() - 127.5) < 2
    assert ours.std() <= 1.1 * area.std() + 1, "no more moire than an area average"
    assert ours.std() < 0.6 * bilinear.std(), "plain bilinear (im2rec's filter) aliases; ours must not"


def test_shrink_leaves_an_axis_it_does_not_scale_unblurred():
    stripes = np.zeros((300, 200, 3), np.uint8)
    stripes[:, ::2] = 255  # detail along x only; only y shrinks
    out = images.shrink(stripes, (200, 200))
    assert np.array_equal(out[:, ::2], np.full((200, 100, 3), 255)) and not out[:, 1::2].any()


def test_without_opencv_the_pack_still_resizes_to_the_same_picture(monkeypatch):
    sources = [jpeg(photo(300, 200, 11)), jpeg(photo(200, 150, 12).convert("CMYK"))]  # fast path, repair
    with_cv2 = [prepare(data, 128, 90) for data in sources]
    monkeypatch.setattr(images, "cv2", None)
    without = [prepare(data, 128, 90) for data in sources]
    for (ours, why), (theirs, why_too) in zip(with_cv2, without, strict=True):
        assert why == why_too and _rgb(ours).shape == _rgb(theirs).shape
        mse = np.mean((_rgb(ours) - _rgb(theirs)) ** 2)
        assert mse < 255**2 / 10**3.5, f"Pillow's antialiased bilinear differs by more than 35 dB (MSE {mse:.1f})"


def test_jpeg_header_checks_do_not_decode():
    data = kinds()["progressive"]
    info = read_jpeg_header(data)
    assert info.sof == 0xC2 and info.components == 3 and info.complete and (info.width, info.height) == (120, 90)
    assert read_jpeg_header(b"\x89PNG\r\n\x1a\n") is None
    with pytest.raises(Skip, match="inside the header"):
        prepare(data[:40], 0, 90)
    assert prepare(data, 0, 90) == (data, None)


def test_verify_cli_names_the_record_whose_label_disagrees_with_the_index(packed, tmp_path, capsys):
    out, _, index, _, _ = packed
    rows = (index / "train.tsv").read_text().splitlines()
    first = next(k for k, _ in read_idx(out / "fast/train.idx"))
    fields = rows[first + 1].split("\t")
    fields[2] = str((int(fields[2]) + 1) % 3)
    rows[first + 1] = "\t".join(fields)
    bad_index = tmp_path / "index"
    bad_index.mkdir()
    (bad_index / "train.tsv").write_text("\n".join(rows) + "\n")
    (bad_index / "classes.tsv").write_bytes((index / "classes.tsv").read_bytes())
    args = [
        "--rec",
        str(out / "fast/train.rec"),
        "--idx",
        str(out / "fast/train.idx"),
        "--split",
        "train",
        "--manifest",
        str(out / "pack/train.manifest.json"),
    ]
    assert verify_main(args + ["--index", str(index)]) == 0
    assert verify_main(args + ["--index", str(bad_index)]) == 1
    assert f"record id {first}: label" in capsys.readouterr().err


def test_rotational_fast_storage_is_warned_in_log_and_manifest(tmp_path):
    raw, index = write_dataset(tmp_path, [("a/x.JPEG", 0, jpeg(photo(40, 30, 0)))], classes=1)
    (tmp_path / "out").mkdir()
    hdd = fake_sysfs(tmp_path / "sys_hdd", tmp_path / "out", rotational=True)
    ssd = fake_sysfs(tmp_path / "sys_ssd", tmp_path / "out", rotational=False)
    proc = run_pack(raw, index, tmp_path / "out", env={storage.SYSFS_ENV: str(hdd)})
    assert proc.returncode == 0, proc.stderr
    m = _manifest(tmp_path / "out")
    assert m["storage"]["rotational"] is True and m["storage"]["device"] == "sdz"
    assert "rotational" in m["storage"]["warning"] and "iowait" in m["storage"]["warning"]
    assert m["storage"]["warning"] in proc.stderr
    proc = run_pack(raw, index, tmp_path / "out", env={storage.SYSFS_ENV: str(ssd)})
    assert proc.returncode == 0, proc.stderr
    m = _manifest(tmp_path / "out")
    assert m["storage"]["rotational"] is False and m["storage"]["warning"] is None
    assert "WARNING" not in proc.stderr


def test_space_preflight_fails_before_writing_anything(tmp_path, monkeypatch, capsys):
    raw, index = write_dataset(tmp_path, [("a/x.JPEG", 0, jpeg(photo(40, 30, 0)))], classes=1)
    real = storage.shutil.disk_usage
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: real(p)._replace(free=100))
    out = tmp_path / "out"
    rc = pack.main(pack_args(raw, index, out))
    err = capsys.readouterr().err
    assert rc == 2
    assert "has 100 B (100 bytes) free but this pack needs about" in err and "pack.fast_storage" in err
    # nothing written but the lock that keeps a second pack of this pair out
    assert [p.name for p in (out / "fast").iterdir()] == [".train.rec.lock"] and not (out / "pack").exists()


def pack_writing(fast: Path) -> bool:
    """The pack has opened its .partial or, in storage read order (a rotational disk, which `auto`
    picks), the bucket files it reads into first: it is under way."""
    return any(fast.glob("train.rec.partial*"))


def test_sigkill_mid_pack_leaves_no_trusted_pair_and_rerun_verifies(tmp_path):
    # Many rows over a few CMYK sources (each one re-encoded), so the pack takes seconds on one worker.
    sources = [(f"a/img{i}.JPEG", i % 2, jpeg(photo(320, 240, i).convert("CMYK"))) for i in range(4)]
    files = [sources[i % 4] for i in range(800)]
    raw, index = write_dataset(tmp_path, files, classes=2)
    out = tmp_path / "out"
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "rectrain.data.pack", *pack_args(raw, index, out)]
    env = dict(os.environ, PYTHONPATH=str(pack.__file__).rsplit("/rectrain/", 1)[0])
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and not pack_writing(out / "fast"):
        time.sleep(0.01)
    assert pack_writing(out / "fast"), "pack never started writing"
    workers = psutil.Process(proc.pid).children()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "fast/train.rec").exists() and not (out / "fast/train.idx").exists()
    assert not (out / "pack/train.manifest.json").exists()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "pack workers outlived the killed parent"

    rerun = run_pack(raw, index, out, threads=2)
    assert rerun.returncode == 0, rerun.stderr
    assert not list((out / "fast").glob("train.rec.partial*"))
    reader = IndexedRecordReader(out / "fast/train.rec", out / "fast/train.idx")
    assert len(reader) == 800 and sorted(reader.keys) == list(range(800))
    assert _manifest(out)["packed"] == 800 and "verified and published" in rerun.stderr


def test_a_keyboard_interrupt_mid_pack_ends_the_cli_in_one_line_with_130_and_publishes_nothing(
    tmp_path, monkeypatch, capsys
):
    """The same ending as Ctrl-C, without racing a subprocess: the interrupt arrives while the 30th
    image is prepared (what SIGINT raises in the main thread, here from the pack's own work)."""
    raw, index = write_dataset(tmp_path, [(f"a/x{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(60)], classes=1)
    out = tmp_path / "out"
    real, calls = pack.prepare, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 30:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(pack, "prepare", interrupted)
    args = ["--config-json", "{}", *pack_args(raw, index, out)[2:]]
    assert pack.main(args) == cli.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line for line in err.splitlines() if "interrupted" in line] == [
        "pack interrupted: " + cli.NOTHING_PUBLISHED
    ], err[-3000:]
    assert not (out / "fast/train.rec").exists() and not (out / "pack/train.manifest.json").exists()
