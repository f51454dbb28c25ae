"""Small parts of the training stage: checkpoint files, telemetry CSVs, resume decisions."""

import csv
import random

import numpy as np
import pytest
import torch
from helpers.train_data import first_difference, run_identity

from rectrain.train import telemetry
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import identity as runid


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    ckpt.save_atomic({"rng": ckpt.rng_state()}, tmp_path / "c.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    ckpt.set_rng_state(ckpt.load(tmp_path / "c.pt")["rng"])  # load() uses weights_only=True
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"], "no temporary file left behind"


def test_checkpoint_loading_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        ckpt.load(tmp_path / "evil.pt")


def test_resume_is_refused_naming_the_item_that_differs():
    ident = run_identity()
    state = {"config": {"lr": 0.1, "epochs": 4, "workers": 2}, **ident.stamp()}
    assert first_difference(state, ident) is None
    assert first_difference(dict(state, config={"lr": 0.1, "epochs": 4, "workers": 8}), ident) is None, (
        "workers: same maths"
    )
    cases = {
        "the train config changed (epochs)": run_identity(config={"lr": 0.1, "epochs": 5}),
        "the chosen batch changed (32 x accum 1 then, 16 x accum 2 now)": run_identity(batch_size=16, grad_accum=2),
        "written by 2 processes, this run has 1": run_identity(world_size=1),
        "the training records changed (headers_sha256)": run_identity(
            data=dict(ident.data, headers_sha256="relabelled")
        ),
        "the training code changed (loaders/dali.py)": run_identity(code=dict(ident.code, **{"loaders/dali.py": "cc"})),
    }
    for why, other in cases.items():
        assert why in first_difference(state, other)


def _rec(path, labels, name):
    """A .rec whose records hold the same image bytes in the same order, with these labels."""
    from rectrain.recordio import IRHeader, RecordWriter, pack_record

    with RecordWriter(path / f"{name}.rec", path / f"{name}.idx") as w:
        for i, label in enumerate(labels):
            w.write(i, pack_record(IRHeader(0, float(label), i, 0), b"\xff\xd8 same image bytes \xff\xd9"))
    return str(path / f"{name}.rec"), str(path / f"{name}.idx")


def test_record_fingerprint_sees_a_relabel_with_identical_sizes(tmp_path):
    a = runid.data_fingerprint(*_rec(tmp_path, [0, 1, 2, 3], "a"))
    b = runid.data_fingerprint(*_rec(tmp_path, [1, 0, 2, 3], "b"))
    assert a["rec_bytes"] == b["rec_bytes"] and a["idx_sha256"] == b["idx_sha256"], "same sizes and offsets"
    assert a["headers_sha256"] != b["headers_sha256"]
    assert runid.data_fingerprint(*_rec(tmp_path, [0, 1, 2, 3], "c")) == a, "same content, same fingerprint"
    classes = tmp_path / "classes.tsv"
    classes.write_text("label\twnid\tname\n0\tn1\tx\n")
    assert "classes_sha256" in runid.data_fingerprint(*_rec(tmp_path, [0], "d"), classes=str(classes))


def test_step_log_on_resume_drops_the_interrupted_epoch(tmp_path):
    log = telemetry.step_log(tmp_path, rank=0, start_epoch=0)
    for epoch in range(3):
        log.write(
            rank=0,
            epoch=epoch,
            step=0,
            time=1.7e9,
            wall_s=1.0,
            data_wait_s=0.25,
            compute_s=0.75,
            images=8,
            loss=1.0,
            lr=0.1,
        )
    log.close()
    telemetry.step_log(tmp_path, rank=0, start_epoch=2).close()
    with open(tmp_path / "steps_rank0.csv", newline="") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["0", "1"]


def test_step_log_on_resume_keeps_earlier_epochs_drops_a_torn_last_line_and_appends(tmp_path):
    row = dict(rank=0, step=0, time=1.7e9, wall_s=1.0, data_wait_s=0.25, compute_s=0.75, images=8, loss=1.0, lr=0.1)
    log = telemetry.step_log(tmp_path, rank=0, start_epoch=0)
    for epoch in range(2):
        log.write(epoch=epoch, **row)
    log.close()
    path = tmp_path / "steps_rank0.csv"
    with open(path, "a") as f:
        f.write("0,2,0,17000")  # killed while writing a row of epoch 2
    log = telemetry.step_log(tmp_path, rank=0, start_epoch=3)
    log.write(epoch=3, **row)
    log.close()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["0", "1", "3"] and rows[2]["lr"] == "0.1"


def test_merge_steps_concatenates_ranks_with_the_contract_columns(tmp_path):
    for r in range(2):
        log = telemetry.step_log(tmp_path, rank=r, start_epoch=0)
        log.write(
            rank=r,
            epoch=0,
            step=0,
            time=1795996715.869,
            wall_s=1.0,
            data_wait_s=0.25,
            compute_s=0.75,
            images=8,
            loss=1.0,
            lr=0.1,
        )
        log.close()
    dest = telemetry.merge_steps(tmp_path, tmp_path / "steps.csv", 2)
    with open(dest, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == telemetry.STEP_COLUMNS and [r["rank"] for r in rows] == ["0", "1"]
    assert rows[0]["time"] == "1795996715.869", "timestamps keep millisecond precision"
