"""Hostile inputs for the packer: each test builds its own small bad dataset and asserts what the pack
does with it and what it says: a format that would start a program, bomb headers, corrupt scan data,
pixels that a naive conversion destroys, failures of one image, too many skips, and packs that race
or were killed."""

import io
import json
import os
import re
import stat
import struct
import subprocess
import zlib

import numpy as np
import pytest
import yaml
from helpers.packdata import (
    REPO,
    animated_gif,
    corrupt_scan,
    gray16_png,
    jpeg,
    photo,
    png_bytes,
    postscript,
    run_pack,
    transparent_png,
    with_jpeg_size,
    write_dataset,
)
from PIL import Image

from rectrain import config, recordio
from rectrain.data import demo, images, pack
from rectrain.data.images import Skip, prepare, read_jpeg_header
from rectrain.recordio import IndexedRecordReader, read_idx, unpack_record


def _skip_reason(data: bytes, resize: int = 0) -> str:
    with pytest.raises(Skip) as caught:
        prepare(data, resize, 90)
    return str(caught.value)


def _manifest(out):
    return json.loads((out / "pack" / "train.manifest.json").read_text())


def _pack_in_process(raw, index, out, cfg=None, split="train"):
    """pack.main in this process (so a test can monkeypatch it); returns the exit status."""
    args = ["--config-json", json.dumps(cfg or {"max_skipped_share": 0.5}), "--index", str(index)]
    args += ["--raw", str(raw), "--split", split, "--threads", "2"]
    args += ["--rec", str(out / "fast" / f"{split}.rec"), "--idx", str(out / "fast" / f"{split}.idx")]
    return pack.main(args + ["--manifest", str(out / "pack" / f"{split}.manifest.json")])


def _leftovers(out):
    return sorted(p.name for p in out.rglob("*") if p.name.endswith(".partial") or ".tmp" in p.name)


# ---- formats that start programs --------------------------------------------------------------


def test_postscript_named_jpeg_is_skipped_and_no_program_is_started(tmp_path):
    # Ghostscript stand-in first on PATH: if anything runs it, the marker appears.
    bin_dir, marker = tmp_path / "bin", tmp_path / "gs-was-run"
    bin_dir.mkdir()
    fake = bin_dir / "gs"
    fake.write_text(f'#!/bin/sh\necho "$@" > {marker}\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    files = [("a/drawing.JPEG", 0, postscript())] + [(f"a/ok{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(3)]
    raw, index = write_dataset(tmp_path, files, classes=1)
    proc = run_pack(raw, index, tmp_path / "out", env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), f"the pack started Ghostscript: {marker.read_text()}"
    (skip,) = _manifest(tmp_path / "out")["skipped_files"]
    assert skip["source"] == "a/drawing.JPEG"
    assert skip["reason"].startswith("unsupported format: PostScript content is never opened")
    assert skip["reason"] in proc.stderr


def test_no_supported_format_starts_a_subprocess_while_packing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"an image started a program: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    assert "PostScript" in _skip_reason(postscript())
    # the binary EPS header, and PostScript behind a byte Pillow's EPS plugin would skip past
    assert "EPS content is never opened" in _skip_reason(b"\xc5\xd0\xd3\xc6" + postscript())
    for data in (gray16_png(), transparent_png(), animated_gif(), jpeg(photo(60, 40, 1).convert("CMYK"))):
        prepare(data, 32, 90)


# ---- bombs and corrupt scan data -------------------------------------------------------------


def _png_claiming(width: int, height: int) -> bytes:
    data = png_bytes(photo(16, 12, 0))
    ihdr = data[12:29]  # type + 13 bytes of fields; its CRC follows
    fields = struct.pack(">II", width, height) + ihdr[12:17]
    return (
        data[:8]
        + struct.pack(">I", 13)
        + b"IHDR"
        + fields
        + struct.pack(">I", zlib.crc32(b"IHDR" + fields))
        + data[33:]
    )


@pytest.mark.parametrize("resize", [0, 64])
def test_bomb_headers_are_skipped_before_any_decode(resize):
    bomb = with_jpeg_size(jpeg(photo(64, 48, 3)), 60000, 60000)
    assert read_jpeg_header(bomb).complete, "the header alone looks like a clean, complete JPEG"
    assert _skip_reason(bomb, resize) == (
        "decompression bomb guard: the JPEG frame header says 60000x60000 (3600 megapixels), "
        "above the limit of 134 megapixels"
    )
    assert _skip_reason(_png_claiming(12000, 12000), resize).startswith(
        "decompression bomb guard: the PNG header says 12000x12000 (144 megapixels)"
    )
    assert _skip_reason(_png_claiming(60000, 60000), resize).startswith("decompression bomb guard: Image size")


@pytest.mark.parametrize("resize", [0, 64])  # pass-through (the 1/8-scale check) and a resize's own decode
def test_corrupt_scan_data_with_an_intact_end_marker_is_skipped(resize):
    clean = jpeg(photo(300, 200, 8))
    damaged = corrupt_scan(clean)
    assert damaged[-2:] == b"\xff\xd9" and read_jpeg_header(damaged).complete
    assert _skip_reason(damaged, resize) == (
        "corrupt JPEG scan data: libjpeg-turbo reports 'Corrupt JPEG data: premature end of data segment'"
    )
    assert prepare(clean, 0, 90) == (clean, None), "the check passes clean data through untouched"
    if resize == 0:  # pack.check_scan_data: false stores it after the header checks, as im2rec would
        assert prepare(damaged, 0, 90, check_scan_data=False) == (damaged, None)


def test_corrupt_scan_data_is_skipped_by_the_pack_and_the_rest_packed(tmp_path):
    files = [("a/bad.JPEG", 0, corrupt_scan(jpeg(photo(300, 200, 8))))]
    files += [(f"a/ok{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(3)]
    raw, index = write_dataset(tmp_path, files, classes=1)
    proc = run_pack(raw, index, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    m = _manifest(tmp_path / "out")
    assert (m["packed"], [s["id"] for s in m["skipped_files"]]) == (3, [0])
    assert "skipped id 0 a/bad.JPEG: corrupt JPEG scan data" in proc.stderr


# ---- repairs that must not destroy pixels ----------------------------------------------------


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=float)


def test_16bit_png_is_scaled_not_clipped_to_white():
    stored, reason = prepare(gray16_png(), 0, 95)
    assert (
        reason
        == "PNG content named as JPEG re-encoded as JPEG; 16-bit grayscale scaled to 8 bits (value x 255 / 65535)"
    )
    pixels = _pixels(stored)
    assert abs(pixels.mean() - 127.5) < 3, f"mean {pixels.mean():.1f}: a clipped ramp is almost all white"
    assert pixels[0, :4].mean() < 10 and pixels[-1, -4:].mean() > 245


def test_transparency_is_composited_on_neutral_gray_not_the_hidden_colour():
    stored, reason = prepare(transparent_png(), 0, 95)
    assert reason == (
        "PNG content named as JPEG re-encoded as JPEG; "
        "transparency (50.0 % of pixels not opaque) composited on mid-gray (128, 128, 128)"
    )
    pixels = _pixels(stored)
    assert np.abs(pixels[:, -20:] - 128).max() < 6, "the hidden green must not show"
    assert np.abs(pixels[:, :20] - (255, 0, 0)).max() < 12


def test_animated_gif_keeps_the_first_frame_and_says_so():
    stored, reason = prepare(animated_gif(3), 0, 95)
    assert reason == "GIF content named as JPEG re-encoded as JPEG; animated GIF: first of 3 frames kept"
    assert np.abs(_pixels(stored) - (255, 0, 0)).max() < 12, "the first frame is red"


# ---- one image's failure is one skip ---------------------------------------------------------


def test_any_failure_on_one_image_is_a_skip_naming_it_and_the_pack_goes_on(tmp_path, monkeypatch):
    files = [(f"a/ok{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(6)]
    files += [("a/huge.JPEG", 0, jpeg(photo(400, 300, 9), quality=100))]
    raw, index = write_dataset(tmp_path, files, classes=1)
    real = pack.prepare

    def failing(data, *args, **kwargs):
        if data == files[1][2]:
            raise MemoryError
        if data == files[2][2]:
            raise RuntimeError("a bug in a decoder")
        return real(data, *args, **kwargs)

    monkeypatch.setattr(pack, "prepare", failing)
    monkeypatch.setattr(recordio, "MAX_PAYLOAD", 20_000)  # the 400x300 q100 photo is ~60 KB
    out = tmp_path / "out"
    assert _pack_in_process(raw, index, out) == 0
    reasons = {s["source"]: s["reason"] for s in _manifest(out)["skipped_files"]}
    assert reasons.keys() == {"a/ok1.JPEG", "a/ok2.JPEG", "a/huge.JPEG"}
    assert reasons["a/ok1.JPEG"] == "out of memory: MemoryError while reading, decoding or encoding this image"
    assert reasons["a/ok2.JPEG"] == "unexpected error: RuntimeError: a bug in a decoder"
    assert reasons["a/huge.JPEG"].startswith("record too large: a record of ")
    assert len(IndexedRecordReader(out / "fast/train.rec", out / "fast/train.idx")) == 4
    assert _leftovers(out) == []


# ---- too many skips --------------------------------------------------------------------------


def _with_missing_files(tmp_path, n_ok: int, n_missing: int):
    files = [(f"a/ok{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(n_ok)]
    files += [(f"a/gone{i}.JPEG", 0, b"x") for i in range(n_missing)]
    raw, index = write_dataset(tmp_path, files, classes=1)
    for i in range(n_missing):  # as if the disk holding them were not mounted
        (raw / f"a/gone{i}.JPEG").unlink()
    return raw, index


def test_a_skip_share_above_the_limit_fails_naming_the_top_reasons_and_publishes_nothing(tmp_path):
    raw, index = _with_missing_files(tmp_path, n_ok=8, n_missing=3)
    (raw / "a/ok0.JPEG").write_bytes(b"")
    out = tmp_path / "out"
    assert run_pack(raw, index, out).returncode == 0  # an earlier, good pack: it must not survive
    proc = run_pack(raw, index, out, cfg={"max_skipped_share": 0.2})
    assert proc.returncode == 4, proc.stderr
    # 3 of 11 is already above 0.2: the pack stops at the third skip, whatever the rest would give
    said = re.search(
        r"3 of the first (\d+) images of split train were skipped: already 27.3 % of its 11, above "
        r"pack.max_skipped_share = 0.2 whatever the other (\d+) hold, so the pack stopped there and nothing was "
        r"published. Top reasons: (.*)\. That many",
        proc.stderr,
    )
    assert said and int(said.group(1)) + int(said.group(2)) == 11, proc.stderr[-2000:]
    reasons = said.group(3)
    assert "x missing since the index (e.g. a/gone" in reasons and "is no longer under" in reasons
    assert reasons.count(" x ") == (2 if "empty file (0 bytes) (e.g. a/ok0.JPEG)" in reasons else 1), reasons
    assert "wrong `raw` path, an unmounted" in proc.stderr
    assert sorted(p.name for p in (out / "fast").iterdir()) == [".train.rec.lock"]
    assert not (out / "pack/train.manifest.json").exists()


def test_a_split_whose_images_are_gone_stops_once_the_skips_pass_the_limit_not_after_every_image(tmp_path):
    """A wrong `raw` path or an unmounted disk: with the default limit (0.01) a 400-image split stops
    at its fifth skip (5 > 4 allowed), not after reading all 400 - on ImageNet, minutes instead of an hour."""
    raw, index = _with_missing_files(tmp_path, n_ok=0, n_missing=400)
    proc = run_pack(raw, index, tmp_path / "out", cfg={"max_skipped_share": 0.01})
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "5 of the first 5 images of split train were skipped: already 1.2 % of its 400, above " in proc.stderr
    assert "whatever the other 395 hold" in proc.stderr and "Top reasons: 5 x missing since the index" in proc.stderr
    assert not (tmp_path / "out/fast/train.rec").exists() and _leftovers(tmp_path / "out") == []


def test_an_all_skipped_split_never_publishes_whatever_the_limit(tmp_path):
    raw, index = _with_missing_files(tmp_path, n_ok=0, n_missing=2)
    proc = run_pack(raw, index, tmp_path / "out", cfg={"max_skipped_share": 1.0})
    assert proc.returncode == 4
    assert "all 2 images of split train were skipped, above pack.max_skipped_share = 1.0" in proc.stderr
    assert not (tmp_path / "out/fast/train.rec").exists() and _leftovers(tmp_path / "out") == []


def test_the_demo_config_packs_under_its_skip_limit():
    with open(REPO / "config" / "config.yaml") as f:
        cfg = config.fill_defaults(yaml.safe_load(f))
    d = cfg["demo"]
    skipped = sum(action == "skip" for _, action, _ in demo.DEFECTS) if d["bad_files"] else 0
    rows = d["classes"] * d["train_per_class"] + (len(demo.DEFECTS) if d["bad_files"] else 0)
    assert skipped / rows <= cfg["pack"]["max_skipped_share"], (skipped, rows)


# ---- publishing, locking, leftovers ----------------------------------------------------------


def _consistent(rec, idx) -> bool:
    """Every .idx entry points at a record of that id in the .rec."""
    reader = IndexedRecordReader(rec, idx)
    return all(unpack_record(payload)[0].id == key for key, payload in reader)


def test_a_reader_never_sees_the_new_rec_with_the_old_idx(tmp_path, monkeypatch):
    old_files = [(f"a/old{i}.JPEG", 0, jpeg(photo(90 + i, 60, i))) for i in range(5)]
    raw_old, index_old = write_dataset(tmp_path / "old", old_files, classes=1)
    out = tmp_path / "out"
    assert _pack_in_process(raw_old, index_old, out) == 0
    new_files = [(f"a/new{i}.JPEG", 0, jpeg(photo(40, 30 + i, i))) for i in range(8)]
    raw, index = write_dataset(tmp_path / "new", new_files, classes=1)
    rec, idx = out / "fast/train.rec", out / "fast/train.idx"
    seen = []
    real = pack.publish

    def observed(tmp, final):
        # what a reader opening the pair right now would find
        seen.append((final.name, idx.exists(), idx.exists() and _consistent(rec, idx)))
        real(tmp, final)
        seen.append((final.name + " done", idx.exists(), idx.exists() and _consistent(rec, idx)))

    monkeypatch.setattr(pack, "publish", observed)
    assert _pack_in_process(raw, index, out) == 0
    assert seen == [
        ("train.rec", False, False),  # the old .idx is gone before the new .rec appears
        ("train.rec done", False, False),
        ("train.idx", False, False),
        ("train.idx done", True, True),
    ]
    assert sorted(k for k, _ in read_idx(idx)) == list(range(8))


def test_a_pack_killed_between_the_two_renames_leaves_no_pair_and_the_rerun_completes(tmp_path, monkeypatch):
    raw, index = write_dataset(tmp_path, [(f"a/x{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(4)], classes=1)
    out = tmp_path / "out"
    real = pack.publish

    class Killed(BaseException):
        """Stands in for a kill: no handler of the pack's catches it, nothing after the raise runs
        (KeyboardInterrupt would be Ctrl-C, which the stage's CLI ends in one line)."""

    def dies_before_the_idx(tmp, final):
        if final.name.endswith(".idx"):
            raise Killed
        real(tmp, final)

    monkeypatch.setattr(pack, "publish", dies_before_the_idx)
    with pytest.raises(Killed):
        _pack_in_process(raw, index, out)
    assert (out / "fast/train.rec").exists() and not (out / "fast/train.idx").exists()
    with pytest.raises(FileNotFoundError):  # a reader fails loudly; it never pairs files of two runs
        IndexedRecordReader(out / "fast/train.rec", out / "fast/train.idx")
    monkeypatch.setattr(pack, "publish", real)
    assert _pack_in_process(raw, index, out) == 0
    assert _consistent(out / "fast/train.rec", out / "fast/train.idx") and _leftovers(out) == []


def test_a_second_pack_of_the_same_pair_is_refused_naming_the_first(tmp_path):
    raw, index = write_dataset(tmp_path, [(f"a/x{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(3)], classes=1)
    (index / "val.tsv").write_bytes((index / "train.tsv").read_bytes())
    out = tmp_path / "out"
    with pack.exclusive(out / "fast/train.rec", "train"):  # this process is "the first pack"
        busy = run_pack(raw, index, out)
        other_split = run_pack(raw, index, out, split="val")
    assert busy.returncode == 2
    assert f"another pack is writing {out / 'fast/train.rec'} (pid {os.getpid()} on " in busy.stderr
    assert ", split train, started " in busy.stderr and "wait for it to finish or stop it" in busy.stderr
    assert other_split.returncode == 0, "the val pack into the same folder is another pair: it runs"
    assert run_pack(raw, index, out).returncode == 0, "the lock dies with its holder"


def test_leftovers_of_a_killed_pack_are_removed_by_the_next_run(tmp_path):
    raw, index = write_dataset(tmp_path, [(f"a/x{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(3)], classes=1)
    out = tmp_path / "out"
    stale = [
        out / "fast/train.rec.partial",
        out / "fast/train.idx.partial",
        out / "pack/.train.manifest.json.tmp4242",
    ]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half-written")
    proc = run_pack(raw, index, out)
    assert proc.returncode == 0, proc.stderr
    assert _leftovers(out) == []
    assert f"removing {stale[2]}, left by an interrupted pack" in proc.stderr


def test_without_simplejpeg_pillow_decodes_the_scan_and_skips_what_it_cannot_read(monkeypatch):
    # Pillow ignores libjpeg's warnings (so the check is weaker there, as images.check_scan says)
    # but not its errors: here, scan data whose quantization tables are missing.
    monkeypatch.setattr(images, "simplejpeg", None)
    data = jpeg(photo(120, 90, 2))
    assert prepare(data, 0, 90) == (data, None)
    no_tables = data.replace(b"\xff\xdb", b"\xff\xe6")  # DQT segments become ignored APP6 data
    assert _skip_reason(no_tables) == "corrupt JPEG scan data: broken data stream when reading image file"
