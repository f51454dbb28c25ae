"""A rerun with the same records resumes (issue #38 item 10): the resume fingerprint covers what decides
the records (the .idx, sampled headers, classes.tsv, the manifest's pack settings and counts), never a
timing. Repacking the same raw set after an edit of the pack's code, and checking the same brought pair
twice, give the same data fingerprint, so train.resume: auto continues the checkpoints."""

import json
import os
import shutil
import subprocess
import sys

from helpers.packdata import REPO, jpeg, pack_args, photo, write_dataset
from helpers.train_data import run_identity
from helpers.views import view
from test_train_resume import fake_run, write_checkpoints

from rectrain.data.byo_recordio import check_pairs
from rectrain.recordio import IRHeader, RecordWriter, pack_record
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import identity as runid
from rectrain.train.lifecycle.resume import resume

PACK_CFG = json.dumps({"resize": 0, "quality": 90, "shuffle_seed": 0, "max_skipped_share": 0.5})


def _pack(raw, index, out, workflow) -> None:
    cmd = [sys.executable, "-m", "rectrain.data.pack", *pack_args(raw, index, out, PACK_CFG, threads=1)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(workflow)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _fingerprint(out):
    fast, pack = out / "fast", out / "pack"
    return runid.data_fingerprint(fast / "train.rec", fast / "train.idx", manifest=pack / "train.manifest.json")


def resumes(tmp_path, checkpointed: dict, now: dict) -> bool:
    """train.resume: auto (rectrain.train.lifecycle.resume), as the training command decides it: checkpoints of
    two epochs written under the data fingerprint `checkpointed`, a run whose records give `now`.
    True when it continues at epoch 2 with nothing moved aside."""
    tmp_path.mkdir()
    run = fake_run(tmp_path, "auto", run_identity(world_size=1, data=now))
    write_checkpoints(run, identity=run_identity(world_size=1, data=checkpointed))
    return resume(run).start_epoch == 2 and not (run.ck_dir / ckpt.REPLACED).exists()


def test_a_repack_of_the_same_raw_set_after_an_edit_of_the_packs_code_resumes(tmp_path):
    files = [(f"c{i % 2}/x{i}.JPEG", i % 2, jpeg(photo(40, 30, i))) for i in range(6)]
    raw, index = write_dataset(tmp_path, files, classes=2)
    _pack(raw, index, tmp_path / "first", REPO / "workflow")
    edited = tmp_path / "edited" / "workflow"
    shutil.copytree(REPO / "workflow" / "rectrain", edited / "rectrain")
    shutil.copytree(REPO / "config", edited.parent / "config")
    with open(edited / "rectrain" / "data" / "pack.py", "a") as fh:
        fh.write("\n# an edit of the pack's code that writes the same records\n")
    _pack(raw, index, tmp_path / "second", edited)
    first, second = (tmp_path / d / "pack/train.manifest.json" for d in ("first", "second"))
    # Two 6-image packs can time the same to the millisecond (a CI run saw wall_s 0.067 and cpu_s 0.29 twice):
    # the second's timings are set apart, as a repack's on a busier machine would be.
    timed = json.loads(second.read_text())
    timed["wall_s"] = json.loads(first.read_text())["wall_s"] + 1.0
    timed["usage"]["cpu_s"] += 1.0
    second.write_text(json.dumps(timed))
    old, new = _fingerprint(tmp_path / "first"), _fingerprint(tmp_path / "second")
    assert old == new
    assert resumes(tmp_path / "train", old, new)


def test_checking_the_same_brought_pair_twice_resumes_and_a_change_of_its_published_bytes_does_not(tmp_path):
    rec, idx = tmp_path / "mine.rec", tmp_path / "mine.idx"
    with RecordWriter(rec, idx) as w:
        for i in range(8):
            w.write(i, pack_record(IRHeader(0, float(i % 2), i, 0), jpeg(photo(24, 24, i))))
    block = view("recordio", train={"rec": str(rec), "idx": str(idx)})
    prints = []
    for run in ("a", "b"):
        out = tmp_path / run
        check_pairs(block, out / "fast", out / "pack", out / "index", threads=1)
        prints.append(_fingerprint(out))
    assert prints[0] == prints[1]
    assert resumes(tmp_path / "train", *prints)
    manifest = tmp_path / "b/pack/train.manifest.json"
    changed = json.loads(manifest.read_text())
    changed["existing"]["bytes_written"] = changed["existing"]["bytes_written"] + 1
    manifest.write_text(json.dumps(changed))
    assert _fingerprint(tmp_path / "b") != prints[0], "a manifest change that decides the records still counts"


def test_a_checkpoint_fingerprinted_with_the_whole_manifest_still_resumes_on_the_same_records(tmp_path):
    """Checkpoints written before this fix hold manifest_sha256 (timings included): compared on the rest."""
    now = {"rec_bytes": 7000, "idx_sha256": "i", "headers_sha256": "h", "manifest_records_sha256": "m"}
    before = {"rec_bytes": 7000, "idx_sha256": "i", "headers_sha256": "h", "manifest_sha256": "whole manifest"}
    assert resumes(tmp_path / "same", before, now)
    assert not resumes(tmp_path / "other", {**before, "headers_sha256": "relabelled"}, now)
