"""Staging the .rec/.idx pair to node-local storage: once per node, verified, skipped when current."""

import json
import multiprocessing as mp
import os
import stat

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
        with open(dst, "r+b") as fh:  # the local disk "returns" a different first byte
            first = fh.read(1)
            fh.seek(0)
            fh.write(bytes([first[0] ^ 0xFF]))  # a fixed byte would match random data 1 time in 256
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
    local = tmp_path / "local" / stage.stage_key(fast / "train.rec")  # demo-<hash of its real path>
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


def test_staging_dir_is_created_owner_only(pair, tmp_path):
    rec, idx = pair
    local = tmp_path / "base" / "demo"
    stage_pair(rec, idx, local)
    assert stat.S_IMODE(os.stat(local).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(local.parent).st_mode) == 0o700, "a parent it creates is private too"


def test_existing_staging_dir_with_open_mode_is_tightened(pair, tmp_path):
    rec, idx = pair
    local = tmp_path / "local"
    local.mkdir(mode=0o777)
    os.chmod(local, 0o777)
    stage_pair(rec, idx, local)
    assert stat.S_IMODE(os.stat(local).st_mode) == 0o700


def test_symlink_planted_at_the_staging_dir_is_refused(pair, tmp_path):
    rec, idx = pair
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    local = tmp_path / "local"
    local.symlink_to(elsewhere)
    with pytest.raises(StageError) as err:
        stage_pair(rec, idx, local)
    msg = str(err.value)
    assert str(local) in msg and "symbolic link" in msg and str(elsewhere) in msg and "pack.local_storage" in msg
    assert list(elsewhere.iterdir()) == [], "nothing may be written through the link"


def test_staging_dir_owned_by_another_user_is_refused(pair, tmp_path):
    rec, idx = pair
    local = tmp_path / "local"
    local.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    os.chown(local, 65534, 65534)  # nobody
    with pytest.raises(StageError) as err:
        stage_pair(rec, idx, local)
    msg = str(err.value)
    assert str(local) in msg and "uid 65534" in msg and "not to you" in msg and "pack.local_storage" in msg
    assert list(local.iterdir()) == []


def test_staging_under_a_folder_another_user_created_is_refused(pair, tmp_path):
    """/tmp/rectrain-<you> made first by someone else: they could swap the dataset folder inside it."""
    rec, idx = pair
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    base = tmp_path / "rectrain-me"
    base.mkdir(mode=0o755)
    os.chown(base, 65534, 65534)
    with pytest.raises(StageError) as err:
        stage_pair(rec, idx, base / "demo")
    assert str(base) in str(err.value) and "uid 65534" in str(err.value)
    assert not (base / "demo").exists()


def test_symlinked_stamp_and_copy_are_replaced_not_written_through(pair, tmp_path):
    rec, idx = pair
    local = tmp_path / "local"
    local.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    # Links planted at the stamp name, at the copy's name and at the lock: none may be written through.
    (local / ("train.rec" + stage.STAMP_SUFFIX)).symlink_to(victim)
    (local / "train.idx").symlink_to(victim)
    rec_l, idx_l, copied = stage_pair(rec, idx, local)
    assert copied and victim.read_text() == "precious"
    stamp = local / ("train.rec" + stage.STAMP_SUFFIX)
    assert not stamp.is_symlink() and json.loads(stamp.read_text())["size"] == rec.stat().st_size
    assert not idx_l.is_symlink() and idx_l.read_bytes() == idx.read_bytes()


def test_symlinked_lock_is_refused_without_touching_its_target(pair, tmp_path):
    rec, idx = pair
    local = tmp_path / "local"
    local.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (local / stage.LOCK_NAME).symlink_to(victim)
    with pytest.raises(StageError, match="staging lock .*refused; remove it"):
        stage_pair(rec, idx, local)
    assert victim.read_text() == "precious"


def test_stage_argv_logs_its_copies_tagged_stage_in_a_fresh_process(pair, tmp_path):
    """The train rule's log keeps '[stage] copying ...' lines (the launcher sets up no logging of its own)."""
    import subprocess
    import sys

    rec, idx = pair
    code = (
        "import sys; from rectrain.train.local_copy import stage_argv; "
        "stage_argv(['--rec', sys.argv[1], '--idx', sys.argv[2]], sys.argv[3])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(rec), str(idx), str(tmp_path / "local")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == f"[stage] copying {rec} -> {tmp_path / 'local' / stage.stage_key(rec) / 'train.rec'}"
    assert any(line.startswith("[stage] ") and " MB verified in " in line for line in lines)


# ---- issue #38 item 4: staging keyed by the source's identity, held while a training reads it ----


def _pair_in(folder, seed):
    folder.mkdir(parents=True)
    (folder / "train.rec").write_bytes(bytes([seed]) * 4000)
    (folder / "train.idx").write_text("0\t0\n")
    return str(folder / "train.rec"), str(folder / "train.idx")


def test_two_pairs_in_folders_of_one_name_are_staged_apart(tmp_path):
    """Two brought pairs both in folders called `rec` (or two working directories' `imagenet`)."""
    first, second = _pair_in(tmp_path / "a" / "rec", 1), _pair_in(tmp_path / "b" / "rec", 2)
    local = tmp_path / "local"
    argv_a = stage.stage_argv(["--rec", first[0], "--idx", first[1]], str(local))
    argv_b = stage.stage_argv(["--rec", second[0], "--idx", second[1]], str(local))
    assert argv_a[1] != argv_b[1]
    assert open(argv_a[1], "rb").read() == bytes([1]) * 4000, "the first training's staged copy was replaced"
    assert open(argv_b[1], "rb").read() == bytes([2]) * 4000
    assert os.path.basename(os.path.dirname(argv_a[1])).startswith("rec-")


def test_a_staged_copy_a_running_training_reads_is_not_replaced_by_a_later_staging(tmp_path):
    import subprocess
    import sys

    rec, idx = _pair_in(tmp_path / "shared", 1)
    local = tmp_path / "local"
    held = subprocess.Popen(  # a launcher whose training is running: it staged the pair and stays
        [
            sys.executable,
            "-c",
            "import sys, time; from rectrain.train import local_copy as s; "
            "s.stage_pair(*sys.argv[1:]); print('staged', flush=True); time.sleep(60)",
            rec,
            idx,
            str(local),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert held.stdout.readline().strip() == "staged"
        open(rec, "wb").write(bytes([9]) * 4000)  # the source repacked while that training runs
        with pytest.raises(StageError, match=r"a running training on this node reads it"):
            stage_pair(rec, idx, local)
        assert (local / "train.rec").read_bytes() == bytes([1]) * 4000
    finally:
        held.kill()
        held.wait()
    _, _, copied = stage_pair(rec, idx, local)  # once it has ended, the new records are staged
    assert copied and (local / "train.rec").read_bytes() == bytes([9]) * 4000
