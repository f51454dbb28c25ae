"""Staging the .rec/.idx pair to node-local storage: once per node, verified, skipped when current."""

import multiprocessing as mp
import os

import pytest

from rectrain.train import local_copy as stage
from rectrain.train.local_copy import StageError, default_local_dir, stage_pair


@pytest.fixture
def pair(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    rec, idx = shared / "train.rec", shared / "train.idx"
    rec.write_bytes(os.urandom(300_000))
    idx.write_text("".join(f"{i}\t{i * 100}\n" for i in range(50)))
    return rec, idx


def test_first_call_copies_byte_identical_pair(pair, tmp_path):
    rec, idx = pair
    rec_l, idx_l, copied = stage_pair(rec, idx, tmp_path / "local")
    assert copied
    assert rec_l == tmp_path / "local" / "train.rec" and idx_l == tmp_path / "local" / "train.idx"
    assert rec_l.read_bytes() == rec.read_bytes()
    assert idx_l.read_bytes() == idx.read_bytes()
    assert not list((tmp_path / "local").glob("*.part")), "temporary files must not be left behind"


def test_second_call_skips_without_copying(pair, tmp_path, monkeypatch):
    rec, idx = pair
    stage_pair(rec, idx, tmp_path / "local")
    mtime = (tmp_path / "local" / "train.rec").stat().st_mtime_ns

    def no_copy(*a, **k):
        raise AssertionError("an identical pair was copied again")

    monkeypatch.setattr(stage, "_copy_hashing", no_copy)
    _, _, copied = stage_pair(rec, idx, tmp_path / "local")
    assert copied is False
    assert (tmp_path / "local" / "train.rec").stat().st_mtime_ns == mtime


def test_corrupted_local_copy_is_detected_and_recopied(pair, tmp_path):
    rec, idx = pair
    rec_l, _, _ = stage_pair(rec, idx, tmp_path / "local")
    data = bytearray(rec_l.read_bytes())
    data[1234] ^= 0xFF  # same size, one flipped byte
    rec_l.write_bytes(bytes(data))
    _, _, copied = stage_pair(rec, idx, tmp_path / "local")
    assert copied
    assert rec_l.read_bytes() == rec.read_bytes()


def test_changed_source_is_restaged(pair, tmp_path):
    rec, idx = pair
    stage_pair(rec, idx, tmp_path / "local")
    idx.write_text("0\t0\n")  # a re-pack replaced the pair
    _, idx_l, copied = stage_pair(rec, idx, tmp_path / "local")
    assert copied and idx_l.read_text() == "0\t0\n"


def test_copy_that_does_not_match_source_is_rejected(pair, tmp_path, monkeypatch):
    rec, idx = pair
    real = stage._copy_hashing

    def flaky_disk(src, dst):
        digest = real(src, dst)
        with open(dst, "r+b") as fh:  # the local disk "returns" different bytes
            fh.write(b"\0")
        return digest

    monkeypatch.setattr(stage, "_copy_hashing", flaky_disk)
    with pytest.raises(StageError, match="does not match the source"):
        stage_pair(rec, idx, tmp_path / "local")
    assert not (tmp_path / "local" / "train.rec").exists(), "an unverified copy must not be published"


def test_missing_source_names_the_file(tmp_path):
    with pytest.raises(StageError, match="run the pack step first"):
        stage_pair(tmp_path / "nope.rec", tmp_path / "nope.idx", tmp_path / "local")


def _stage_in_child(args):
    rec, idx, local = args
    return stage_pair(rec, idx, local)[2]


def test_concurrent_ranks_on_one_node_copy_once(pair, tmp_path):
    rec, idx = pair
    with mp.get_context("spawn").Pool(3) as pool:
        copied = pool.map(_stage_in_child, [(rec, idx, tmp_path / "local")] * 3)
    assert sorted(copied) == [False, False, True]


def test_default_local_dir_prefers_config_then_tmpdir():
    assert str(default_local_dir("/scratch/x", "demo", env={"TMPDIR": "/t"})) == "/scratch/x/demo"
    assert str(default_local_dir(None, "demo", env={"TMPDIR": "/t"})) == "/t/demo"
    assert str(default_local_dir(None, "demo", env={})).startswith("/tmp/rectrain-")


def test_stage_argv_rewrites_both_pairs_to_local_copies(tmp_path):
    fast = tmp_path / "fast" / "demo"
    fast.mkdir(parents=True)
    for name in ("train.rec", "train.idx", "val.rec", "val.idx"):
        (fast / name).write_bytes(name.encode() * 100)
    argv = [
        "--config-json",
        "{}",
        "--rec",
        str(fast / "train.rec"),
        f"--idx={fast / 'train.idx'}",
        "--val-rec",
        str(fast / "val.rec"),
        "--val-idx",
        str(fast / "val.idx"),
        "--out",
        "o",
    ]
    out = stage.stage_argv(argv, str(tmp_path / "local"))
    local = tmp_path / "local" / "demo"
    assert out == [
        "--config-json",
        "{}",
        "--rec",
        str(local / "train.rec"),
        f"--idx={local / 'train.idx'}",
        "--val-rec",
        str(local / "val.rec"),
        "--val-idx",
        str(local / "val.idx"),
        "--out",
        "o",
    ]
    assert (local / "val.idx").read_bytes() == (fast / "val.idx").read_bytes()
