"""The training entry point end to end on CPU: started without a launcher, under torchrun with 2 gloo
ranks (telemetry), killed and resumed, and with a crashing rank."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch
import torchvision
from helpers.train_data import config_json, packed_dataset, rows

from rectrain.loaders.order import choose_order
from rectrain.train.lifecycle.checkpoint import PUBLISHED, load
from rectrain.train.lifecycle.status import FORCED_ENV
from rectrain.train.telemetry import EPOCH_COLUMNS, STEP_COLUMNS, SYSTEM_BASE_COLUMNS


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_dataset(tmp_path_factory.mktemp("packed"))


# Milliseconds per step on this CPU: for tests about what runs, not what is learnt.
FAST = {"model": "squeezenet1_1", "precision": "fp32", "calibration_steps": 2, "calibration_warmup_steps": 1}
SINGLE = ["--single-process", "--threads", "1"]


def run_train(data, out, env_extra=None, timeout=240, extra=(), **cfg):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "rectrain.train", "--config-json", config_json(**cfg), *data, "--out", str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_direct_run_relaunches_through_torchrun_and_writes_telemetry(data, tmp_path):
    """Plain `python -m rectrain.train` (no RANK): relaunches as 2 gloo ranks, says so, no KeyError.
    train.global_batch 32 with batch_size 8: the 2 ranks accumulate 2 micro-batches per step (issue 36)."""
    out = tmp_path / "train"
    proc = run_train(data, out, cpu_processes=2, epochs=2, workers="auto", global_batch=32, extra=["--threads", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "KeyError" not in proc.stderr
    assert "relaunching through torchrun with 2 processes" in proc.stderr
    for name in ("model.pt", "steps.csv", "epochs.csv", "system.csv", "run.json", "checkpoints/last.pt"):
        assert (out / name).exists(), name

    steps = rows(out / "steps.csv")
    assert list(steps[0]) == STEP_COLUMNS
    assert {r["rank"] for r in steps} == {"0", "1"}
    per_rank_epoch = defaultdict(list)
    for r in steps:
        wall, wait, compute = float(r["wall_s"]), float(r["data_wait_s"]), float(r["compute_s"])
        # compute_s is written as wall - wait, so their sum says nothing; compute > 0 is what says the
        # data wait was measured inside the step (wait < wall)
        assert wall > 0 and wait >= 0 and compute > 0, r
        per_rank_epoch[r["rank"], r["epoch"]].append(r)
    counts = {k: len(v) for k, v in per_rank_epoch.items()}
    assert len(set(counts.values())) == 1, f"ranks ran different step counts: {counts}"

    epochs = rows(out / "epochs.csv")
    assert list(epochs[0]) == EPOCH_COLUMNS and [e["epoch"] for e in epochs] == ["0", "1"]
    assert [e["resolution"] for e in epochs] == ["32", "32"], "no train.progressive: image_size every epoch"
    for e in epochs:
        steps_wall = sum(float(r["wall_s"]) for r in per_rank_epoch["0", e["epoch"]])
        # Outside every step: the last step's bookkeeping and the loader's end of epoch, 1-2 ms here idle;
        # a CI box running 3 test workers on 2 cores once stretched it to 22 ms of a 0.44 s epoch.
        assert steps_wall == pytest.approx(float(e["wall_s"]), rel=0.05, abs=0.05), (
            "step times must account for the epoch"
        )
        assert 0 <= float(e["val_single_view_top1"]) <= 1 and float(e["images_per_s"]) > 0

    system = rows(out / "system.csv")
    assert list(system[0]) == SYSTEM_BASE_COLUMNS, "no GPU here: GPU columns must be absent"
    assert len(system) >= 2 and all(0 <= float(s["cpu_percent"]) <= 100 for s in system)

    info = json.loads((out / "run.json").read_text())
    assert info["world_size"] == 2 and info["backend"] == "gloo" and info["loader"] == "dali"
    assert (info["batch_size"], info["grad_accum"], info["global_batch"], info["recipe_global_batch"]) == (8, 2, 32, 32)
    # whole optimizer steps of 2 ranks x 8 x accum 2: 4 micro-batches per rank, the last step a full 32 too
    assert info["padding_per_epoch"] == 2 * 4 * 8 - 45 and info["finished"]
    as_run = info["recipe_as_run"]  # what ran, beside the config's weight_decay: null (issue 46 item 10)
    assert [(g["peak_lr"], g["weight_decay"]) for g in as_run["optimizer"]["groups"]] == [
        (0.1 * 32 / 256, 0.0),
        (0.1 * 32 / 256, 5e-5),
    ]
    assert as_run["mechanics"]["zero_init_residual"] == {"asked": False, "changed": 0, "what": {}}
    assert info["config"]["workers"] == "auto" and info["workers"] == 2, "auto: 4 cores shared by 2 local ranks"
    # train.order as it ran (auto: by the .rec's disk) and each rank's reads: 2 epochs of 4 batches of 8
    assert info["order"]["used"] == choose_order("auto", data[data.index("--rec") + 1]).used
    assert f"training order: {info['order']['used']}" in proc.stderr
    assert [r["order"] for r in info["reads"]] == [info["order"]["used"]] * 2
    assert 2 * 45 <= sum(r["records"] for r in info["reads"]) <= 2 * 2 * 4 * 8, info["reads"]
    assert all(r["bytes"] > 0 and r["elapsed_s"] >= r["busy_s"] >= 0 for r in info["reads"]), info["reads"]
    model = load(out / "model.pt")
    assert model["epoch"] == 1 and model["num_classes"] == 5 and model["model_name"] == "resnet18"
    # The README's way to get the weights out of a 2-rank run: a plain torchvision model takes them.
    weights = torch.load(out / "model.pt", weights_only=True)["model"]
    net = torchvision.models.get_model(model["model_name"], num_classes=model["num_classes"])
    assert not net.load_state_dict(weights).missing_keys


# rectrain.log.duration's forms: '45 s', '12 min 05 s', '3 h 07 min', '2 d 04 h'
DURATION = r"\d+ (?:s|min \d\d s|h \d\d min|d \d\d h)"
UNIT_S = {"s": 1, "min": 60, "h": 3600, "d": 86400}


def seconds(text: str) -> int:
    return sum(int(n) * UNIT_S[unit] for n, unit in re.findall(r"(\d+) (s|min|h|d)\b", text))


@pytest.mark.slow  # a real training (10-18 s): make test, not make check
def test_single_process_run_says_so_and_logs_progress_between_epoch_lines(data, tmp_path):
    proc = run_train(data, tmp_path / "t", epochs=2, progress_s=0.001, extra=SINGLE, **FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "running as a single process (rank 0 of 1) because --single-process was given" in proc.stderr
    assert json.loads((tmp_path / "t" / "run.json").read_text())["world_size"] == 1
    # 45 images in batches of 8: 6 steps per epoch; a line after every step but the first (start-up)
    line = re.compile(
        rf"epoch (\d) \(of 2\) step (\d+)/(\d+) \([\d.]+ %\): ([\d.]+) img/s \(all 1 rank\(s\), last \d+ step\(s\)\), "
        rf"data wait (\d+) %, ETA ({DURATION}), run ETA ({DURATION})"
    )
    found = [m.groups() for m in line.finditer(proc.stderr)]
    progress_lines = "\n".join(text for text in proc.stderr.splitlines() if "(of 2)" in text)
    for epoch in ("0", "1"):
        steps = [(k, total) for e, k, total, *_ in found if e == epoch]
        assert steps == [(str(k), "6") for k in range(2, 7)], progress_lines
    for *_, rate, wait, eta, run_eta in found:
        assert float(rate) > 0 and 0 <= int(wait) <= 100 and seconds(eta) <= seconds(run_eta)
    assert "validation not measured yet" in proc.stderr, "epoch 0 has no validation time yet"
    assert "validation and checkpoint" in proc.stderr, "epoch 1's run ETA counts epoch 0's validation"
    # progress lines come before the epoch's own line; validation (15 images: 2 batches) logs too
    assert proc.stderr.index("epoch 0 (of 2) step 6/6") < proc.stderr.index("epoch 0: train loss")
    assert "epoch 0 (of 2) validation batch 2/2 (100.0 %):" in proc.stderr


@pytest.mark.slow
def test_killed_run_resumes_at_next_epoch_and_matches_uninterrupted(data, tmp_path):
    """Exact equality holds because every random choice is either restored from the checkpoint (torch,
    numpy, python RNG per rank) or a pure function of (seed, epoch, rank) (the loader's order and crops)."""
    ref = run_train(data, tmp_path / "ref", epochs=2, extra=SINGLE, **FAST)
    assert ref.returncode == 0, ref.stderr[-3000:]

    out = tmp_path / "resumed"
    killed = run_train(data, out, env_extra={"RECTRAIN_KILL_AFTER_EPOCH": "0"}, epochs=2, extra=SINGLE, **FAST)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert load(out / "checkpoints" / "last.pt")["epoch"] == 0 and not (out / "model.pt").exists()

    resumed = run_train(data, out, epochs=2, extra=SINGLE, **FAST)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing at epoch 1" in resumed.stderr
    assert [e["epoch"] for e in rows(out / "epochs.csv")] == ["0", "1"]
    assert {r["epoch"] for r in rows(out / "steps.csv")} == {"0", "1"}

    a, b = load(tmp_path / "ref" / "model.pt"), load(out / "model.pt")
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{k} differs after resume"
    assert a["optimizer"]["state"][0]["momentum_buffer"].equal(b["optimizer"]["state"][0]["momentum_buffer"])


def moved_aside(out):
    """{folder name under checkpoints/replaced/: the file names in it}."""
    folder = out / "checkpoints" / "replaced"
    return {d.name: sorted(p.name for p in d.iterdir()) for d in folder.iterdir()} if folder.exists() else {}


@pytest.mark.slow  # a real training (10-18 s): make test, not make check
def test_changed_config_does_not_resume_and_moves_the_old_runs_checkpoints_aside(data, tmp_path):
    out = tmp_path / "t"
    assert run_train(data, out, epochs=2, extra=SINGLE, **FAST).returncode == 0
    proc = run_train(data, out, epochs=1, extra=SINGLE, **FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not resuming" in proc.stderr and "the train config changed (epochs)" in proc.stderr
    assert "moved its checkpoints (epoch_0.pt, epoch_1.pt, last.pt, finished.json, finished) aside to" in proc.stderr
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["epoch_0.pt", "finished", "finished.json", "last.pt", "replaced"], "no epoch_1.pt of the old run"
    ((folder, files),) = moved_aside(out).items()
    whole = ["epoch_0.pt", "epoch_1.pt", "finished", "finished.json", "last.pt", "tensorboard"]
    assert files == whole, "the replaced run, whole, with its TensorBoard curves"
    assert folder.endswith("-the-train-config-changed-epochs") and folder in proc.stderr


def killed_after_epoch_0(data, out, **cfg):
    killed = run_train(data, out, env_extra={"RECTRAIN_KILL_AFTER_EPOCH": "0"}, epochs=2, extra=SINGLE, **FAST, **cfg)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    return killed


@pytest.mark.slow  # a real training (10-18 s): make test, not make check
def test_killed_run_restarted_with_another_lr_starts_over_and_keeps_the_old_checkpoints_aside(data, tmp_path):
    out = tmp_path / "t"
    killed_after_epoch_0(data, out)
    old = load(out / "checkpoints" / "last.pt")
    proc = run_train(data, out, epochs=2, lr=0.05, extra=SINGLE, **FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not resuming" in proc.stderr and "the train config changed (lr)" in proc.stderr
    assert "epoch 0: train loss" in proc.stderr, "started over"
    ((folder, files),) = moved_aside(out).items()
    assert folder.endswith("-the-train-config-changed-lr") and files == ["epoch_0.pt", "last.pt", "tensorboard"]
    kept = load(out / "checkpoints" / "replaced" / folder / "last.pt")
    assert kept["epoch"] == 0 and kept["config"]["lr"] == old["config"]["lr"] == 0.1, "the killed run, intact"
    assert torch.equal(kept["model"]["classifier.1.weight"], old["model"]["classifier.1.weight"])


@pytest.mark.slow  # a real training (10-18 s): make test, not make check
def test_killed_run_restarted_with_another_lr_under_resume_always_continues_and_records_it(data, tmp_path):
    out = tmp_path / "t"
    killed_after_epoch_0(data, out, keep_checkpoints=1)
    proc = run_train(data, out, epochs=2, lr=0.05, resume="always", keep_checkpoints=1, extra=SINGLE, **FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "despite the train config changed (lr)" in proc.stderr and "continuing at epoch 1" in proc.stderr
    assert "epoch 0: train loss" not in proc.stderr, "nothing retrained"
    assert json.loads((out / "run.json").read_text())["resumed_despite"] == ["the train config changed (lr)"]
    assert moved_aside(out) == {}
    # train.keep_checkpoints: 1 - epoch_0.pt went once epoch_1.pt was written; the line says size and disk
    kept = ["epoch_1.pt", "finished", "finished.json", "last.pt"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept
    line = re.search(r"epoch 1: train loss .*", proc.stderr).group(0)
    assert re.search(
        rf"checkpoint [\d.]+ [KM]iB \(epoch_1.pt, last.pt a hard link to it\) in {out / 'checkpoints'} on disk ", line
    )
    assert os.path.samefile(out / "checkpoints" / "epoch_1.pt", out / "checkpoints" / "last.pt"), "written twice"
    assert "keeping the last 1 epoch checkpoint(s), deleted epoch_0.pt" in line


@pytest.mark.slow
def test_forced_rerun_retrains_but_a_job_killed_after_its_last_checkpoint_only_finishes(data, tmp_path):
    """The signal is checkpoints/finished.json, written after model.pt: Snakemake deletes the rule's
    outputs before a forced rerun but not last.pt, so 'outputs missing' alone cannot tell the two apart;
    that Snakemake forced the job is the Snakefile's word (FORCED_ENV, from its onstart hook)."""
    out = tmp_path / "t"
    killed = run_train(data, out, env_extra={"RECTRAIN_KILL_AFTER_EPOCH": "0"}, epochs=1, extra=SINGLE, **FAST)
    assert killed.returncode == -signal.SIGKILL and not (out / "model.pt").exists()
    assert not (out / "checkpoints" / "finished.json").exists()
    resumed = run_train(data, out, epochs=1, extra=SINGLE, **FAST)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "epoch 0 of 1 done by the same run" in resumed.stderr
    assert "continuing at epoch 1" in resumed.stderr and "epoch 0: train loss" not in resumed.stderr, (
        "nothing retrained"
    )
    assert (out / "model.pt").exists() and (out / "checkpoints" / "finished.json").exists()

    for name in ("model.pt", "steps.csv", "epochs.csv", "system.csv", "run.json"):  # what --forcerun deletes
        (out / name).unlink()
    finished = load(out / "checkpoints" / "last.pt")
    forced = run_train(data, out, env_extra={FORCED_ENV: "1"}, epochs=1, extra=SINGLE, **FAST)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "not resuming" in forced.stderr and "snakemake --forcerun" in forced.stderr
    assert "epoch 0: train loss" in forced.stderr, "a forced rerun trains again"
    assert {r["epoch"] for r in rows(out / "steps.csv")} == {"0"} and (out / "model.pt").exists()
    ((folder, files),) = moved_aside(out).items()  # the finished run's checkpoints, moved aside whole
    assert files == ["epoch_0.pt", "finished", "finished.json", "last.pt", "tensorboard"]
    assert "Z-a-forced-rerun-that-run-finished" in folder
    kept = load(out / "checkpoints" / "replaced" / folder / "last.pt")
    assert torch.equal(kept["model"]["classifier.1.weight"], finished["model"]["classifier.1.weight"])


@pytest.mark.slow  # a real training (10-18 s): make test, not make check
def test_finished_run_whose_outputs_were_removed_is_republished_from_its_kept_outputs_without_training(data, tmp_path):
    """What Snakemake leaves after a rerun that failed inside the job: every output removed, the
    checkpoints and checkpoints/finished/ kept.  Not forced, the same run: published again, no step run."""
    out = tmp_path / "t"
    assert run_train(data, out, epochs=1, extra=SINGLE, **FAST).returncode == 0
    published = {name: (out / name).read_bytes() for name in PUBLISHED}
    for name in PUBLISHED:  # what Snakemake removes before the job and again when it fails
        (out / name).unlink()
    again = run_train(data, out, epochs=1, extra=SINGLE, **FAST)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "restored the finished run's outputs" in again.stderr and "no training needed" in again.stderr
    assert "epoch 0" not in again.stderr and "calibrat" not in again.stderr.split("restored")[1], "nothing trained"
    assert {name: (out / name).read_bytes() for name in PUBLISHED} == published
    kept = out / "checkpoints" / "finished" / "model.pt"
    assert os.stat(out / "model.pt").st_ino == os.stat(kept).st_ino, "a hard link: no extra disk"
    assert moved_aside(out) == {}


@pytest.mark.slow
def test_crashed_rank_ends_the_job_naming_rank_and_cause(data, tmp_path):
    t0 = time.monotonic()
    proc = run_train(
        data, tmp_path / "t", env_extra={"RECTRAIN_FAIL_RANK": "1"}, cpu_processes=2, epochs=1, timeout=120
    )
    assert proc.returncode != 0
    assert "rank 1 failed: RuntimeError: injected failure" in proc.stderr
    assert time.monotonic() - t0 < 90, "a dead rank must not leave the job hanging"
