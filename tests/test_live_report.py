"""The live report (issue 34 item 2) on synthetic telemetry: complete lines only, where the run stands
(epochs done, the epoch and step it is at), the time left at the measured pace, how it ended (markers,
processes, telemetry age), and the page with its banner. tests/test_live_report_run.py runs it
against a real training, in Chromium."""

import json
import os
import shutil
import socket
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml
from helpers.synthetic_run import make_epochs, make_run, make_steps, make_system, write_run

from rectrain.config import from_files
from rectrain.progress import run_eta_s
from rectrain.report import inprogress, live
from rectrain.report.inputs import read_complete_csv
from rectrain.train.telemetry import STEP_COLUMNS

NOW = 1_700_000_000.0


def steps_with_gaps(epochs: int, steps: int, step_s: float, gaps: list[float], ranks=(0, 1)) -> pd.DataFrame:
    """Step rows of `epochs` epochs (the last one `steps` long too), `gaps[e]` seconds between epoch e's
    last step and epoch e + 1's first (validation, checkpoint)."""
    rows, t = [], NOW
    for e in range(epochs):
        for s in range(steps):
            t += step_s
            rows += [[r, e, s, t, step_s, 0.1 * step_s, 0.9 * step_s, 32, 2.0, 0.1] for r in ranks]
        t += gaps[e] if e < len(gaps) else 0.0
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


def test_a_half_written_last_line_and_a_short_row_are_left_out(tmp_path):
    path = tmp_path / "steps_rank0.csv"
    header = ",".join(STEP_COLUMNS)
    path.write_bytes(
        f"{header}\r\n0,0,0,1.0,0.5,0.1,0.4,32,2.3,0.1\r\n0,0,1,1.5\r\n0,0,2,2.0,0.5,0.1,0.4,32,2.2,0.1\r\n0,0,3,2.5,0.".encode()
    )
    rows = read_complete_csv(path, STEP_COLUMNS)
    assert rows["step"].tolist() == [0, 2] and list(rows.columns) == STEP_COLUMNS
    assert rows["lr"].notna().all()


def test_a_missing_or_headless_file_reads_as_no_rows(tmp_path):
    (tmp_path / "epochs.csv").write_bytes(b"epoch,train_lo")  # the header itself still being written
    assert read_complete_csv(tmp_path / "epochs.csv", ["epoch"]).empty
    assert list(read_complete_csv(tmp_path / "none.csv", ["epoch", "x"]).columns) == ["epoch", "x"]


def test_position_counts_the_epochs_done_and_the_steps_of_the_epoch_in_progress():
    steps = steps_with_gaps(3, 20, 0.5, [3.0, 3.0])
    steps = steps[(steps["epoch"] < 2) | (steps["step"] < 5)]  # epoch 2 at its 5th step
    pos = inprogress.position(steps, make_epochs(2), make_run(epochs=4), {"packed": 1})
    assert pos == inprogress.Position(epochs=4, done=2, epoch=2, step=5, steps_per_epoch=20)


def test_before_any_epoch_finished_its_length_comes_from_the_images_and_the_batch():
    steps = steps_with_gaps(1, 3, 0.5, [])
    run = make_run(world_size=2, batch_size=128, padding_per_epoch=40, epochs=2)
    pos = inprogress.position(steps, make_epochs(0).iloc[:0], run, {"packed": 600})
    assert (pos.done, pos.epoch, pos.step, pos.steps_per_epoch) == (0, 0, 3, 3)  # (600 + 40) / (128 x 2) = 2.5 -> 3


def test_before_any_epoch_finished_a_run_json_with_the_loaders_count_gives_the_epochs_length():
    """train.repeated_aug: an epoch is timm's length, not the records': run.json's batches_per_epoch is
    what the loader runs (16 batches of 8 over 2 ranks for 300 records at 3 repeats, not 19)."""
    steps = steps_with_gaps(1, 3, 0.5, [])
    run = make_run(world_size=2, batch_size=8, padding_per_epoch=0, epochs=2, batches_per_epoch=16)
    assert inprogress.position(steps, make_epochs(0).iloc[:0], run, {"packed": 300}).steps_per_epoch == 16


def test_time_left_is_the_rest_of_the_epoch_and_the_epochs_after_it_at_the_measured_pace():
    steps = steps_with_gaps(3, 20, 0.5, [3.0, 5.0, 4.0])
    steps = steps[(steps["epoch"] < 2) | (steps["step"] < 5)]
    pos = inprogress.position(steps, make_epochs(2), make_run(epochs=4), None)
    pace = inprogress.pace(steps)
    assert pace.step_s == pytest.approx(0.5) and pace.between_s == pytest.approx(4.0)  # median of 3 and 5
    # 15 steps of epoch 2, its validation, then epoch 3's 20 steps and validation: 7.5 + 4 + 14
    assert inprogress.time_left_s(pos, pace) == pytest.approx(25.5)
    assert inprogress.time_left_s(pos, pace) == pytest.approx(run_eta_s(5, 20, 0.5, 2, 4, 4.0))


def test_no_time_left_is_claimed_before_a_step_was_measured():
    pos = inprogress.Position(epochs=3, done=0, epoch=0, step=0, steps_per_epoch=None)
    assert inprogress.time_left_s(pos, inprogress.pace(pd.DataFrame(columns=STEP_COLUMNS))) is None


def test_a_run_past_its_last_epoch_but_not_finished_is_said_to_publish_not_to_train_an_epoch_more():
    pos = inprogress.Position(epochs=3, done=3, epoch=3, step=0, steps_per_epoch=5)
    status = inprogress.Status(inprogress.TRAINING, "a process", pos, inprogress.Pace(0.5, 1.0), 0.0, 1.0)
    assert inprogress.banner(status)["headline"] == "In progress: all 3 epochs trained, publishing the outputs"


def marker(ck, name, when):
    ck.mkdir(parents=True, exist_ok=True)
    (ck / name).write_text(json.dumps({"time": when, "signal": "SIGTERM", "after": "epoch 1 step 2", "where": "x"}))


STARTED = "2026-12-03T09:00:00+00:00"


def test_a_marker_of_this_launch_says_stopped_or_diverged_and_an_older_one_is_ignored(tmp_path):
    run = {"started": STARTED, "host": socket.gethostname()}
    marker(tmp_path / "checkpoints", "stopped.json", "2026-12-03T08:00:00+00:00")  # an earlier launch's
    assert inprogress.state(tmp_path, run, 1.0, here=lambda d: True)[0] == inprogress.TRAINING
    marker(tmp_path / "checkpoints", "stopped.json", "2026-12-03T09:30:00+00:00")
    kind, why, found = inprogress.state(tmp_path, run, 1.0, here=lambda d: False)
    assert kind == inprogress.STOPPED_STATE and "SIGTERM" in why and found["after"] == "epoch 1 step 2"
    marker(tmp_path / "checkpoints", "diverged.json", "2026-12-03T09:31:00+00:00")
    assert inprogress.state(tmp_path, run, 1.0, here=lambda d: False)[0] == inprogress.DIVERGED_STATE
    assert inprogress.state(tmp_path, {**run, "finished": "x"}, 1.0)[0] == inprogress.FINISHED


def test_on_this_host_the_processes_tell_training_from_killed_however_fresh_the_telemetry(tmp_path):
    run = {"started": STARTED, "host": socket.gethostname()}
    assert inprogress.state(tmp_path, run, 0.5, here=lambda d: True)[0] == inprogress.TRAINING
    kind, why, _ = inprogress.state(tmp_path, run, 0.5, here=lambda d: False)
    assert kind == inprogress.KILLED and "no process on this host" in why


def test_on_another_host_the_telemetry_age_tells_training_from_killed(tmp_path):
    run = {"started": STARTED, "host": "gpu-node-17", "config": {"sample_interval_s": 1.0}}
    never = lambda d: pytest.fail("another host's processes cannot be looked at")  # noqa: E731
    assert inprogress.state(tmp_path, run, 20.0, here=never)[0] == inprogress.TRAINING
    assert inprogress.state(tmp_path, run, inprogress.STALE_S + 1, here=never)[0] == inprogress.KILLED
    slow = {**run, "config": {"sample_interval_s": 60.0}}  # ten missed samples, not five minutes
    assert inprogress.state(tmp_path, slow, inprogress.STALE_S + 1, here=never)[0] == inprogress.TRAINING


def test_a_training_process_is_found_by_its_out_folder_resolved_against_its_working_directory(tmp_path):
    (tmp_path / "results/demo/main/train").mkdir(parents=True)

    def proc(cmdline, cwd):
        return SimpleNamespace(info={"cmdline": cmdline}, cwd=lambda: str(cwd))

    rank = proc(["python", "-m", "rectrain.train", "--rec", "x", "--out", "results/demo/main/train"], tmp_path)
    other = proc(["python", "-m", "rectrain.train", "--out", "results/other/train"], tmp_path)
    editor = proc(["vim", "--out", "results/demo/main/train"], tmp_path)
    target = tmp_path / "results/demo/main/train"
    assert inprogress.training_here(target, procs=lambda: [other, editor, rank])
    assert not inprogress.training_here(target, procs=lambda: [other, editor])


def test_config_from_files_puts_the_demo_config_under_a_file_without_a_raw_root_only(tmp_path):
    (tmp_path / "tweak.yaml").write_text(yaml.safe_dump({"train": {"epochs": 7}}))
    (tmp_path / "own.yaml").write_text(yaml.safe_dump({"dataset": "mine", "raw": str(tmp_path)}))
    demo = from_files([tmp_path / "tweak.yaml"])
    assert (demo["dataset"], demo["train"]["epochs"], demo["train"]["image_size"]) == ("demo", 7, 64)
    own = from_files([tmp_path / "own.yaml"])
    assert own["dataset"] == "mine" and own["train"]["image_size"] != 64  # the schema's default, not the demo's


def live_run(root, *, host="gpu-node-17", torn=True):
    """A run of 4 epochs on 2 ranks, 2 epochs done and epoch 2 at step 5 of 20, as its telemetry has it
    while it trains; the stages before it as write_run makes them. Returns the train folder."""
    paths = write_run(root, run_overrides={"epochs": 4})
    train = paths["train"]
    for name in ("steps.csv", "epochs.csv", "system.csv"):
        (train / name).unlink()
    shutil.rmtree(paths["eval"])
    tele = train / "telemetry"
    tele.mkdir()
    steps = make_steps({0: 0.02, 1: 0.03}, epochs=3, steps=20)
    steps = steps[(steps["epoch"] < 2) | (steps["step"] < 5)]
    for rank, rows in steps.groupby("rank"):
        rows.to_csv(tele / f"steps_rank{rank}.csv", index=False)
        if torn:
            with open(tele / f"steps_rank{rank}.csv", "a") as f:
                f.write(f"{rank},2,5,1700000061.")  # the row being written
    make_epochs(2).to_csv(tele / "epochs.csv", index=False)
    make_system(60).to_csv(tele / "system_node0.csv", index=False)
    run = make_run(world_size=2, gpus=0, epochs=4, finished=None, host=host, started=STARTED)
    (train / "run.json").write_text(json.dumps(run))
    return train


def test_the_live_page_shows_the_banner_the_epochs_so_far_and_the_evaluation_still_to_come(tmp_path, monkeypatch):
    live_run(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"report": {"title": "watching"}}))
    monkeypatch.chdir(tmp_path)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "results").rglob("*") if p.is_file()}
    written, real = [], live.atomic.write_text  # whole or not at all: a reader never sees half a page
    monkeypatch.setattr(live.atomic, "write_text", lambda p, t: written.append(str(p)) or real(p, t))
    assert live.main(["--configfile", "run.yaml"]) == 0
    assert written == [os.path.join("results", "demo", "main", "live.html")]
    html = (tmp_path / "results/demo/main/live.html").read_text()
    assert "<title>[training] watching - demo</title>" in html  # the config file's title, the demo's dataset
    assert 'id="live-banner" class="live-training"' in html
    assert "In progress: epoch 2 (of 4) step 5/20" in html and "2 of 4 epoch(s) done" in html
    # 15 steps, then one more epoch of 20, at 0.5 s a step; no gap between epochs in these rows
    assert f"training ends in {inprogress.duration(17.5)}" in html
    table = html[html.index('<section id="learning">') : html.index('<section id="classes">')]
    assert table.count("<tr") == 3  # the header and epochs 0 and 1
    assert 'id="top1-pending"' in html and 'id="classes-pending"' in html and "no val split" not in html
    after = {p: p.stat().st_mtime_ns for p in (tmp_path / "results").rglob("*") if p.is_file()}
    assert set(after) - set(before) == {tmp_path / "results/demo/main/live.html"}
    assert all(after[p] == t for p, t in before.items()), "the live report wrote a file of the run"


def test_a_killed_run_on_this_host_is_shown_killed_with_the_training_left(tmp_path, monkeypatch):
    live_run(tmp_path, host=socket.gethostname(), torn=False)
    monkeypatch.chdir(tmp_path)
    assert live.main([]) == 0
    html = (tmp_path / "results/demo/main/live.html").read_text()
    assert 'class="live-killed"' in html and "Killed at epoch 2 (of 4) step 5/20" in html
    assert f"{inprogress.duration(17.5)} of training left when it goes on" in html


def test_before_training_wrote_run_json_the_command_says_so_in_one_line(tmp_path, monkeypatch):
    train = live_run(tmp_path)
    (train / "run.json").unlink()
    monkeypatch.chdir(tmp_path)
    assert live.main([]) == 1
    assert not (tmp_path / "results/demo/main/live.html").exists()


@pytest.mark.parametrize(
    ("name", "state", "headline"),
    [
        ("stopped.json", "stopped", "Stopped at epoch 2 (of 4) step 5/20"),
        ("diverged.json", "diverged", "Diverged: stopped at epoch 2 step 5"),
    ],
)
def test_a_run_that_stopped_or_diverged_in_this_launch_is_shown_so(tmp_path, monkeypatch, name, state, headline):
    train = live_run(tmp_path, host=socket.gethostname())
    info = {
        "time": "2026-12-03T09:30:00+00:00",
        "signal": "SIGTERM",
        "after": "epoch 2 step 5",
        "where": "epoch 2 step 5",
    }
    (train / "checkpoints").mkdir()
    (train / "checkpoints" / name).write_text(
        json.dumps({**info, "line": "rank 0: training diverged at epoch 2 step 5"})
    )
    monkeypatch.chdir(tmp_path)
    assert live.main([]) == 0
    html = (tmp_path / "results/demo/main/live.html").read_text()
    assert f'class="live-{state}"' in html and headline in html
    if state == "diverged":
        assert "rank 0: training diverged at epoch 2 step 5" in html
    else:
        assert "stopped cleanly (SIGTERM" in html and "of training left when it goes on" in html


def test_a_stopped_run_whose_run_json_snakemake_removed_is_read_from_its_live_copy(tmp_path, monkeypatch):
    """Snakemake removes a stopped or failed job's outputs, run.json among them; training's copy in
    telemetry/ survives (rectrain.train.telemetry.LIVE_RUN_JSON), and the page reads it: the Stopped
    banner and the epochs so far, not "no training has started yet"."""
    train = live_run(tmp_path, host=socket.gethostname(), torn=False)
    (train / "run.json").rename(train / "telemetry" / "run.json")
    (train / "checkpoints").mkdir()
    stopped = {"time": "2026-12-03T09:30:00+00:00", "signal": "SIGTERM", "after": "epoch 2 step 5"}
    (train / "checkpoints" / "stopped.json").write_text(json.dumps(stopped))
    monkeypatch.chdir(tmp_path)
    assert live.main([]) == 0
    html = (tmp_path / "results/demo/main/live.html").read_text()
    assert 'class="live-stopped"' in html and "Stopped at epoch 2 (of 4) step 5/20" in html
    table = html[html.index('<section id="learning">') : html.index('<section id="classes">')]
    assert table.count("<tr") == 3, "epochs 0 and 1 so far"
