"""Byte identity with the format authority: mxnet 1.9.1's MXIndexedRecordIO, run in .venv-mxnet
(built from envs/mxnet-interop.txt by `make mxnet-env`), writes the same .rec/.idx as our writer, and
reads our files, packed ones included (pass-through and pack.max_side), back exactly."""

import hashlib
import io
import json
import subprocess
import textwrap

import pytest
from helpers.packdata import REPO, jpeg, kinds_dataset, photo, run_pack, write_dataset
from PIL import Image

from rectrain.recordio import (
    MAGIC_BYTES,
    IndexedRecordReader,
    IRHeader,
    RecordWriter,
    pack_record,
    read_idx,
    unpack_record,
)

MXPY = REPO / ".venv-mxnet" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not MXPY.exists(), reason=".venv-mxnet is missing: build it with `make mxnet-env` (envs/mxnet-interop.txt)"
)

MX_SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import mxnet as mx
    mode, spec_path, rec, idx = sys.argv[1:5]
    dump = sys.argv[5] if len(sys.argv) > 5 else None  # read: also write each image as <dump>/<key>.jpg
    if mode == "write":
        spec = json.load(open(spec_path))
        w = mx.recordio.MXIndexedRecordIO(idx, rec, "w")
        for r in spec:
            header = mx.recordio.IRHeader(0, r["label"], r["id"], r["id2"])
            w.write_idx(r["key"], mx.recordio.pack(header, open(r["image"], "rb").read()))
        w.close()
    else:
        r = mx.recordio.MXIndexedRecordIO(idx, rec, "r")
        out = []
        for key in r.keys:
            header, img = mx.recordio.unpack(r.read_idx(key))
            label = header.label.tolist() if header.flag > 0 else float(header.label)
            out.append([int(key), int(header.flag), label, int(header.id), int(header.id2),
                        hashlib.sha256(img).hexdigest()])
            if dump:
                open(f"{dump}/{int(key)}.jpg", "wb").write(img)
        r.close()
        seq = mx.recordio.MXRecordIO(rec, "r")
        n = 0
        while seq.read() is not None:
            n += 1
        json.dump({"records": out, "sequential_count": n}, open(spec_path, "w"))
""")


def _mx(mode, spec_path, rec, idx, *dump):
    proc = subprocess.run(
        [str(MXPY), "-c", MX_SCRIPT, mode, str(spec_path), str(rec), str(idx), *map(str, dump)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def _sha(data):
    return hashlib.sha256(data).hexdigest()


def _interop_records(tmp_path):
    """Pass-through JPEGs of assorted lengths, a multi-float label, and payloads holding the magic."""
    images = [jpeg(photo(40 + 7 * i, 30 + 5 * i, i), quality=70 + i) for i in range(6)]
    images.append(b"\0" * 4 + MAGIC_BYTES + b"tail")  # payload offset 28: aligned -> split
    images.append(MAGIC_BYTES + b"ab" + MAGIC_BYTES + b"c" + MAGIC_BYTES * 2 + b"xyz")  # aligned + unaligned
    images.append(b"\1" * 3 + MAGIC_BYTES)  # unaligned only: not split
    specs = []
    for i, data in enumerate(images):
        path = tmp_path / f"img{i}.bin"
        path.write_bytes(data)
        label = [float(i), 0.5, -2.25] if i in (2, 7) else float(i % 4)
        specs.append({"key": 100 - 3 * i, "label": label, "id": 1000 + i, "id2": i % 2, "image": str(path)})
    return specs


def test_writer_output_is_byte_identical_to_mxnet(tmp_path):
    specs = _interop_records(tmp_path)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(specs))
    _mx("write", spec_path, tmp_path / "mx.rec", tmp_path / "mx.idx")
    with RecordWriter(tmp_path / "ours.rec", tmp_path / "ours.idx") as w:
        for r in specs:
            w.write(r["key"], pack_record(IRHeader(0, r["label"], r["id"], r["id2"]), open(r["image"], "rb").read()))
    mx_rec, ours_rec = (tmp_path / "mx.rec").read_bytes(), (tmp_path / "ours.rec").read_bytes()
    assert mx_rec.count(MAGIC_BYTES) > len(specs), "the set must exercise split records"
    assert ours_rec == mx_rec
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "mx.idx").read_bytes()


def test_mxnet_reads_our_records_back_exactly(tmp_path):
    specs = _interop_records(tmp_path)
    with RecordWriter(tmp_path / "ours.rec", tmp_path / "ours.idx") as w:
        for r in specs:
            w.write(r["key"], pack_record(IRHeader(0, r["label"], r["id"], r["id2"]), open(r["image"], "rb").read()))
    out = tmp_path / "read.json"
    _mx("read", out, tmp_path / "ours.rec", tmp_path / "ours.idx")
    got = json.loads(out.read_text())
    assert got["sequential_count"] == len(specs)
    expected = [
        [
            r["key"],
            len(r["label"]) if isinstance(r["label"], list) else 0,
            r["label"],
            r["id"],
            r["id2"],
            _sha(open(r["image"], "rb").read()),
        ]
        for r in specs
    ]
    assert got["records"] == expected


def test_mxnet_reads_a_packed_split_with_index_ids_labels_and_original_bytes(tmp_path):
    raw, index, _ = kinds_dataset(tmp_path)
    proc = run_pack(raw, index, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    fast = tmp_path / "out" / "fast"
    out = tmp_path / "read.json"
    _mx("read", out, fast / "train.rec", fast / "train.idx")
    got = json.loads(out.read_text())
    manifest = json.loads((tmp_path / "out/pack/train.manifest.json").read_text())
    repaired = {r["id"] for r in manifest["repaired"]}
    rows = {int(f[0]): f for f in (line.split("\t") for line in (index / "train.tsv").read_text().splitlines()[1:])}
    assert [r[0] for r in got["records"]] == [k for k, _ in read_idx(fast / "train.idx")]
    assert got["sequential_count"] == manifest["packed"] == len(got["records"])
    for key, flag, label, rid, id2, sha in got["records"]:
        assert (rid, flag, id2, label) == (key, 0, 0, float(rows[key][2]))
        if key not in repaired:
            assert sha == _sha((raw / rows[key][1]).read_bytes())


def test_packed_pass_through_split_equals_mxnet_writing_the_source_files(tmp_path):
    raw, index, _ = kinds_dataset(tmp_path)
    proc = run_pack(raw, index, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    fast = tmp_path / "out" / "fast"
    rows = {int(f[0]): f for f in (line.split("\t") for line in (index / "train.tsv").read_text().splitlines()[1:])}
    repaired = {r["id"] for r in json.loads((tmp_path / "out/pack/train.manifest.json").read_text())["repaired"]}
    reader = IndexedRecordReader(fast / "train.rec", fast / "train.idx")
    specs = []
    for key in reader.keys:
        image = raw / rows[key][1]
        if key in repaired:  # re-encoded by us: hand mxnet the same bytes
            image = tmp_path / f"repaired_{key}.jpg"
            image.write_bytes(unpack_record(reader.read(key))[1])
        specs.append({"key": key, "label": float(rows[key][2]), "id": key, "id2": 0, "image": str(image)})
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(specs))
    _mx("write", spec_path, tmp_path / "mx.rec", tmp_path / "mx.idx")
    assert (fast / "train.rec").read_bytes() == (tmp_path / "mx.rec").read_bytes()
    assert (fast / "train.idx").read_bytes() == (tmp_path / "mx.idx").read_bytes()


def test_mxnet_reads_a_max_side_pack_with_index_ids_labels_and_the_longest_side_capped(tmp_path):
    # larger than 160 px on either side, exactly 160, within it, and a repaired CMYK one above it
    shapes = [(500, 375), (333, 500), (160, 120), (150, 100), (90, 60), (640, 480)]
    files = [(f"c{i % 2}/p{i}.JPEG", i % 2, jpeg(photo(w, h, i))) for i, (w, h) in enumerate(shapes)]
    files.append(("c0/cmyk.JPEG", 0, jpeg(photo(400, 200, 9).convert("CMYK"))))
    raw, index = write_dataset(tmp_path, files, classes=2)
    proc = run_pack(raw, index, tmp_path / "out", cfg={"max_side": 160, "quality": 85})
    assert proc.returncode == 0, proc.stderr
    fast, dump = tmp_path / "out" / "fast", tmp_path / "mx_images"
    dump.mkdir()
    out = tmp_path / "read.json"
    _mx("read", out, fast / "train.rec", fast / "train.idx", dump)
    got = json.loads(out.read_text())
    assert got["sequential_count"] == len(files) == len(got["records"])
    assert [r[0] for r in got["records"]] == [k for k, _ in read_idx(fast / "train.idx")]
    for key, flag, label, rid, id2, sha in got["records"]:
        assert (rid, flag, id2, label) == (key, 0, 0, float(files[key][1]))
        image = (dump / f"{key}.jpg").read_bytes()
        assert _sha(image) == sha
        width, height = Image.open(io.BytesIO(image)).size
        source_w, source_h = shapes[key] if key < len(shapes) else (400, 200)
        if max(source_w, source_h) <= 160 and key < len(shapes):
            assert image == files[key][2], f"id {key} is within max_side: stored byte for byte"
        else:
            assert max(width, height) == 160 and abs(width / height - source_w / source_h) < 0.02, (key, width, height)
    # and mxnet writing those images under the same keys, labels and ids makes the same pair, byte for byte
    specs = [
        {"key": r[0], "label": r[2], "id": r[3], "id2": 0, "image": str(dump / f"{r[0]}.jpg")} for r in got["records"]
    ]
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(specs))
    _mx("write", spec_path, tmp_path / "mx.rec", tmp_path / "mx.idx")
    assert (fast / "train.rec").read_bytes() == (tmp_path / "mx.rec").read_bytes()
    assert (fast / "train.idx").read_bytes() == (tmp_path / "mx.idx").read_bytes()
