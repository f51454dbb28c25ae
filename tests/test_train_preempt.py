"""Stopping and resuming within an epoch: a stop signal (train.stop_signals) makes every rank finish its
step, checkpoint where they agreed and exit with EXIT_STOPPED; periodic mid-epoch checkpoints
(train.checkpoint_interval_min) bound what a SIGKILL loses; a full disk leaves the last checkpoint
usable.  The resumed run sees exactly the samples of the uninterrupted one - observed as labels: the
dataset here has one class per record, so a label is a record id - and ends with the same weights; the
DALI runs with RandAugment on (train.augment.policy), whose draws DALI's checkpoint must carry, and with
random erasing, Mixup/CutMix, LAMB and the weights' EMA (issue 49), whose draws and states the
checkpoint's RNG states, optimizer and EMA must carry: the same EMA and optimizer state too."""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers.curves import check_curves_continue
from helpers.train_data import config_json, packed_dataset, rows, run_identity, train_settings

from rectrain.distributed import Dist
from rectrain.loaders import LoaderSpec
from rectrain.loaders.augment import parse_policy
from rectrain.loaders.dali import DaliLoader
from rectrain.loaders.pytorch import TorchLoader
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import midepoch
from rectrain.train.lifecycle.checkpoint import CheckpointSaver
from rectrain.train.lifecycle.status import EXIT_STOPPED

N_TRAIN = 45
# Tiny and fast on a CPU; batch 4 over 2 ranks: 6 steps per epoch (23 records a rank, 1 padded).
FAST = {"model": "squeezenet1_1", "precision": "fp32", "calibration_steps": 0, "batch_size": 4, "epochs": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """train.rec with label == record id (45 classes): the labels a rank trained on are its samples."""
    return packed_dataset(tmp_path_factory.mktemp("ids"), n_train=N_TRAIN, classes=N_TRAIN)


def spec_of(data, **kw):
    args = dict(zip(data[::2], data[1::2], strict=True))
    return LoaderSpec(args["--rec"], args["--idx"], batch_size=4, image_size=32, rank=1, world_size=2, **kw)


# A policy on: DALI's checkpoint must carry its random ops' states (op, coin, magnitude noise and sign
# draws), the torch loader's per-sample seed timm's `random` and NumPy draws.
POLICY = "rand-m9-mstd0.5-inc1"


@pytest.mark.parametrize("policy", ["none", POLICY])
@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_a_loader_resumed_mid_epoch_from_its_state_yields_the_uninterrupted_batches_exactly(data, kind, policy):
    make = DaliLoader if kind == "dali" else TorchLoader
    spec = spec_of(data, workers=1, augment=parse_policy(policy))
    ref = [(x.clone(), y.clone()) for x, y in make(spec).epoch(3)]
    first = make(spec)
    head = []
    for x, y in first.epoch(3):
        head.append((x.clone(), y.clone()))
        if len(head) == 2:
            break
    state = first.state()  # after the 2 batches consumed (DALI has more in its prefetch queue)
    rest = [(x.clone(), y.clone()) for x, y in make(spec).epoch(3, 2, state)]
    got = head + rest
    assert len(got) == len(ref) == 6
    for k, ((xa, ya), (xb, yb)) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(ya, yb) and torch.equal(xa, xb), f"batch {k} differs after the resume"
    if policy != "none":  # the policy did change the pixels the resume had to repeat
        plain = [x for x, _ in make(spec_of(data, workers=1)).epoch(3)]
        assert all(not torch.equal(a, b) for (a, _), b in zip(ref, plain, strict=True))


@pytest.mark.parametrize("policy", ["none", POLICY])
def test_the_gpu_paths_dali_iterator_ends_at_the_epochs_last_batch_and_resumes_from_its_checkpoint_exactly(
    data, policy
):
    """On a GPU the DALI loader runs its pipeline through DALIGenericIterator, which stops at the external
    source's end of the epoch; driven here on the CPU (no GPU in CI): every batch, then a resume."""

    def batches(iterator):
        for batch in iterator:
            yield batch[0]["images"].clone(), batch[0]["labels"].clone()

    spec = spec_of(data, workers=1, augment=parse_policy(policy))
    ref = list(batches(DaliLoader(spec)._iterator(3)))
    first = DaliLoader(spec)._iterator(3)
    head = [next(batches(first)) for _ in range(2)]
    rest = list(batches(DaliLoader(spec)._iterator(3, first.checkpoints()[0])))
    assert len(ref) == len(head + rest) == 6
    for k, ((xa, ya), (xb, yb)) in enumerate(zip(ref, head + rest, strict=True)):
        assert torch.equal(ya, yb) and torch.equal(xa, xb), f"batch {k} differs after the resume"


def run_train(data, out, env_extra=None, extra=(), **cfg):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", config_json(**{**FAST, **cfg}), *data]
    return subprocess.run(
        [*cmd, "--out", str(out), "--threads", "2", *extra], env=env, capture_output=True, text=True, timeout=300
    )


def labels_seen(folder):
    """{(rank, epoch): the labels of that rank's batches in order} from RECTRAIN_RECORD_LABELS."""
    seen = defaultdict(list)
    for path in sorted(folder.glob("labels_rank*.csv")):
        rank = int(path.stem.removeprefix("labels_rank"))
        for line in path.read_text().splitlines():
            epoch, _step, labels = line.split(",")
            seen[rank, int(epoch)] += [int(v) for v in labels.split()]
    return dict(seen)


def assert_same_weights(a_path, b_path):
    """The same weights, the same EMA of them (train.ema) and the same optimizer state (LAMB's moments and
    step counts) as the uninterrupted run, bit for bit."""
    a, b = ckpt.load(a_path), ckpt.load(b_path)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{k} differs from the uninterrupted run"
    assert (a["ema"] is None) == (b["ema"] is None)
    for k in a["ema"] or {}:
        assert torch.equal(a["ema"][k], b["ema"][k]), f"the EMA's {k} differs from the uninterrupted run"
    opt_a, opt_b = a["optimizer"], b["optimizer"]
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt_a["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in opt_b["param_groups"]
    ]
    for i, state in opt_a["state"].items():
        for k, v in state.items():
            assert torch.equal(v, opt_b["state"][i][k]), f"optimizer state {i}.{k} differs"


def step_rows(out):
    return [(int(r["rank"]), int(r["epoch"]), int(r["step"]), r["lr"]) for r in rows(out / "steps.csv")]


# What each loader's runs below train with: the DALI runs with today's recipe ingredients on - RandAugment
# (its random ops in DALI's checkpoint), random erasing and Mixup/CutMix on the batch (Python's, NumPy's and
# torch's draws in each rank's RNG state), LAMB (its moments and step counts), the weights' EMA and repeated
# augmentation (train.repeated_aug 2: each record's copies on both ranks; the order it resumes in).
RECIPE = {
    "dali": {
        "augment": {"policy": POLICY, "reprob": 0.25},
        "mixup": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0},
        "optimizer": "lamb",
        "ema": {"decay": 0.9, "warmup": True},
        "repeated_aug": 2,
    },
    "torch": {"augment": {"policy": "none"}},
}


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """Uninterrupted 2-rank runs per loader, with the labels each rank saw."""
    runs = {}
    for kind in ("dali", "torch"):
        out = tmp_path_factory.mktemp(f"ref_{kind}")
        (out / "labels").mkdir()
        env = {"RECTRAIN_RECORD_LABELS": str(out / "labels")}
        proc = run_train(data, out / "t", env, loader=kind, **RECIPE[kind])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[kind] = SimpleNamespace(out=out / "t", labels=labels_seen(out / "labels"))
    return runs


def check_resumed_like_reference(ref, out, labels_dir, repeats=1):
    """steps.csv: every (rank, epoch, step) once and the uninterrupted LR at each; each rank's samples
    in each epoch those of the uninterrupted run, in its order; the same final weights.  `repeats`:
    train.repeated_aug of the runs (2: each rank reads the other's records, a copy each, 24 of them)."""
    got, want = step_rows(out), step_rows(ref.out)
    assert Counter((r, e, s) for r, e, s, _ in got) == Counter((r, e, s) for r, e, s, _ in want)
    assert sorted(got) == sorted(want), "the LR schedule continues where it stopped, no jump"
    seen = labels_seen(labels_dir)
    assert seen == ref.labels, "each rank's samples per epoch, in order, as uninterrupted"
    for epoch in (0, 1):
        union = Counter(v for rank in (0, 1) for v in seen[rank, epoch])
        assert sum(union.values()) == 2 * 6 * 4
        if repeats == 1:
            assert set(union) == set(range(N_TRAIN)), "one pass, padded"
        else:  # 45 records under 256: the epoch is all 45 places, 48 in whole steps, 24 records twice each
            assert seen[0, epoch] == seen[1, epoch] and set(union.values()) == {2} and len(union) == 24
    assert_same_weights(ref.out / "model.pt", out / "model.pt")


@pytest.mark.slow
def test_sigterm_to_one_rank_mid_epoch_stops_both_with_status_75_and_the_rerun_resumes_the_same_samples(
    data, reference, tmp_path
):
    """DALI loader, RandAugment, random erasing, Mixup/CutMix, LAMB, the EMA and 2 repeats on; rank 1 alone
    gets SIGTERM after step 2 of epoch 1: both ranks stop there."""
    out, labels = tmp_path / "t", tmp_path / "labels"
    labels.mkdir()
    env = {"RECTRAIN_RECORD_LABELS": str(labels), "RECTRAIN_SIGNAL_AT": "1:1:2"}
    # a progress line (and curve point) a step
    stopped = run_train(data, out, env, loader="dali", progress_s=0.001, **RECIPE["dali"])
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: stopped by SIGTERM after epoch 1 step 2 of 6: {out / 'checkpoints' / 'last.pt'}" in (
            stopped.stderr
        )
    assert "it resumes at epoch 1 step 3" in stopped.stderr
    # torchrun's agent ends in one line, not a ChildFailedError traceback with its table of statuses
    assert (
        "ChildFailedError" not in stopped.stderr and "[torchrun] the ranks stopped (exit status 75)" in stopped.stderr
    )
    state = ckpt.load(out / "checkpoints" / "last.pt")
    assert (state["epoch"], state["step"]) == (1, 3) and len(state["ranks"]) == 2 and len(state["rng"]) == 2
    assert all(isinstance(r["loader"], bytes) for r in state["ranks"]), "DALI's pipeline checkpoints"
    assert state["ema"] and int(state["optimizer"]["param_groups"][0]["step"]) == 6 + 3, "the EMA, LAMB's count"
    assert not (out / "model.pt").exists()

    env = {"RECTRAIN_RECORD_LABELS": str(labels)}
    resumed = run_train(data, out, env, loader="dali", progress_s=0.001, **RECIPE["dali"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing at epoch 1 step 3" in resumed.stderr and "epoch 0: train loss" not in resumed.stderr
    check_resumed_like_reference(reference["dali"], out, labels, repeats=2)
    run = json.loads((out / "run.json").read_text())
    augment, as_run = run["augment"], run["recipe_as_run"]
    assert augment["policy"] == POLICY and augment["ran_as"].startswith("DALI's operators on the CPU")
    assert as_run["optimizer"]["class"] == "Lamb" and as_run["ema"].startswith("timm's ModelEmaV3, decay 0.9")
    assert as_run["batch_augment"]["mixup"] and as_run["batch_augment"]["random_erasing"]
    assert as_run["repeated_aug"].startswith("2 copies of each record") and run["batches_per_epoch"] == 6
    ema_top1 = [r["ema_val_single_view_top1"] for r in rows(out / "epochs.csv")]
    assert len(ema_top1) == 2 and all(v != "" for v in ema_top1), "the EMA validated each epoch"
    # stopped after epoch 1 step 2 (0-based): global step 6 + 2 + 1 = 9, 1-based as the curves count
    check_curves_continue(out / "tensorboard", steps_per_epoch=6, epochs=2, stopped_after=9)


@pytest.mark.slow
def test_ctrl_c_to_the_whole_process_group_stops_with_status_75_and_the_rerun_resumes_the_same_samples(
    data, reference, tmp_path
):
    """torch loader; SIGINT to the process group of `python -m rectrain.train`, as Ctrl-C in a terminal
    sends it: the launcher, torchrun's agent, both ranks and their loader workers all get it, mid-epoch 1."""
    out, labels = tmp_path / "t", tmp_path / "labels"
    labels.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["RECTRAIN_RECORD_LABELS"] = str(labels)
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", config_json(**{**FAST, "loader": "torch"}), *data]
    proc = subprocess.Popen(
        [*cmd, "--out", str(out), "--threads", "2"], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 240
    log_file = out / "telemetry" / "steps_rank0.csv"
    while not (log_file.exists() and any(r["epoch"] == "1" for r in rows(log_file))):
        assert proc.poll() is None and time.monotonic() < deadline, "training never reached epoch 1"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=240)
    state = ckpt.load(out / "checkpoints" / "last.pt")
    if state["step"] is None:  # the signal came during epoch 1's last step: stopped at its end
        assert state["epoch"] == 1 and "after the end of epoch 1" in stderr
    for rank in (0, 1):
        assert f"rank {rank}: stopped by SIGINT after" in stderr, stderr[-3000:]
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
    assert "SIGINT: asking the 2 rank(s) to stop after their current step" in stderr
    assert "SignalException" not in stderr and "ChildFailedError" not in stderr, "torchrun's agent ends in one line"
    assert "the ranks stopped on SIGINT after" in stderr and "checkpoint written: exit status 75" in stderr

    resumed = run_train(data, out, {"RECTRAIN_RECORD_LABELS": str(labels)}, loader="torch")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    check_resumed_like_reference(reference["torch"], out, labels)


@pytest.mark.slow
def test_sigkill_after_a_periodic_checkpoint_resumes_from_it_with_the_uninterrupted_weights(data, tmp_path):
    """One process; a checkpoint after every step (interval 0.0001 min); kill -9 after step 3 of epoch
    0: the checkpoint after step 2 is the one resumed, steps 3 on are trained again."""
    single = ["--single-process"]
    ref = run_train(data, tmp_path / "ref", loader="torch", extra=single)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "t"
    killed = run_train(
        data, out, {"RECTRAIN_SIGNAL_AT": "0:0:3:SIGKILL"}, loader="torch", checkpoint_interval_min=0.0001, extra=single
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "mid-epoch checkpoint after epoch 0 step 2 of 12 (train.checkpoint_interval_min)" in killed.stderr
    state = ckpt.load(out / "checkpoints" / "last.pt")
    assert (state["epoch"], state["step"]) == (0, 3)
    resumed = run_train(data, out, loader="torch", extra=single)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing at epoch 0 step 3" in resumed.stderr
    assert sorted(step_rows(out)) == sorted(step_rows(tmp_path / "ref")), "each step once, the same LR"
    assert_same_weights(tmp_path / "ref" / "model.pt", out / "model.pt")


def fake_run(tmp_path):
    """What midepoch.write reads of a Run."""
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = SimpleNamespace(
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        ema=None,  # train.ema off
    )
    (tmp_path / "checkpoints").mkdir()
    return SimpleNamespace(
        ck_dir=tmp_path / "checkpoints",
        settings=train_settings({"model": "linear", "blurpool": False}).replaced(image_size=8),
        classes=[0] * 64,
        d=Dist(0, 1, 0, 1, torch.device("cpu")),
        identity=run_identity(world_size=1),
        world_sizes=({"epoch": 0, "world_size": 1, "batch_size": 32, "grad_accum": 1},),
        model=model,
        step=step,
    )


def test_a_disk_filling_while_a_mid_epoch_checkpoint_is_written_leaves_the_previous_one_usable(
    tmp_path, monkeypatch, caplog
):
    """torch.save writes 4 KiB of the new checkpoint, then the disk is full (ENOSPC): the error says how
    much the checkpoint needs."""
    run = fake_run(tmp_path)
    gathered = [{"rng": ckpt.rng_state(), "loader": None, "totals": {"seen": 8}, "wall_s": 1.0}]
    assert midepoch.write(run, 0, 2, gathered) is None
    before = (run.ck_dir / "last.pt").read_bytes()

    real_save = torch.save

    def full_disk(obj, f):
        f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk)
    with torch.no_grad():
        run.model.weight.add_(1.0)
    with caplog.at_level(logging.WARNING):
        error = midepoch.write(run, 0, 5, gathered)
    monkeypatch.setattr(torch, "save", real_save)
    assert error and error.startswith("NoSpace: ") and "no space left for the checkpoint" in error, error
    assert "could not write the mid-epoch checkpoint" in caplog.text and "the previous checkpoint there is intact" in (
        caplog.text
    )
    assert (run.ck_dir / "last.pt").read_bytes() == before, "the previous checkpoint, byte for byte"
    assert [p.name for p in run.ck_dir.iterdir()] == ["last.pt"], "no temporary file left behind"
    state = ckpt.load(run.ck_dir / "last.pt")
    assert (state["epoch"], state["step"]) == (0, 2), "and it loads: a rerun resumes from it"


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1.5 MiB tmpfs (root only): room for one checkpoint of fake_run's model, not for two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_real_full_disk_during_a_mid_epoch_checkpoint_says_how_much_it_needs_and_keeps_the_previous_one(
    tiny_disk, caplog
):
    run = fake_run(tiny_disk)
    run.model = torch.nn.Linear(512, 512)  # ~1 MiB of weights: the second copy does not fit beside the first
    run.step.optimizer = torch.optim.SGD(run.model.parameters(), lr=0.1)
    run.step.scheduler = torch.optim.lr_scheduler.LambdaLR(run.step.optimizer, lambda s: 1.0)
    gathered = [{"rng": ckpt.rng_state(), "loader": None, "totals": {}, "wall_s": 0.0}]
    assert midepoch.write(run, 0, 2, gathered) is None
    before = (run.ck_dir / "last.pt").read_bytes()
    with caplog.at_level(logging.WARNING):
        error = midepoch.write(run, 0, 5, gathered)
    # torch.save's zip writer reports the full disk as "unexpected pos ..." (issue 47): said as what it is
    assert error and error.startswith("NoSpace: ") and "unexpected pos" not in error, error
    assert "it needs about 1.0 MiB, and its disk has" in error and "free at least" in error, error
    assert "the previous checkpoint there is intact" in caplog.text and "free on that disk" in caplog.text
    assert (run.ck_dir / "last.pt").read_bytes() == before and [p.name for p in run.ck_dir.iterdir()] == ["last.pt"]
    assert ckpt.load(run.ck_dir / "last.pt")["step"] == 2


def test_ctrl_c_while_a_rank_still_imports_torch_is_one_line_and_status_130(tmp_path):
    """The first seconds of every rank are imports: Ctrl-C then ends it with one line, not a traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "rectrain.train", "--help"]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    maps, deadline = f"/proc/{proc.pid}/maps", time.monotonic() + 60
    while "libtorch" not in open(maps).read():  # mid `import torch`: its library is mapped, the rest loads for seconds
        assert proc.poll() is None and time.monotonic() < deadline, "the rank never imported torch"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-3000:]
    assert (
        stderr
        == "[train] interrupted while starting: nothing new saved (checkpoints/ as it was); rerun to start or resume\n"
    )


# A rank that has finished the run (finished.json written, as outputs.finish does) and is still exiting
# when the stop signal comes; it keeps the signal pending as a rank's stop handler does.
FINISHED_RANK = """
import os, signal, sys, time
from pathlib import Path
from rectrain.train.lifecycle import supervise
from rectrain.train.lifecycle.checkpoint import CheckpointSaver
signal.signal(signal.SIGTERM, lambda *_: None)
ck = Path(sys.argv[1])
CheckpointSaver(ck).mark_finished(ck.parent / "model.pt", os.environ.get(supervise.LAUNCH_ID_ENV))
time.sleep(4)
"""
LAUNCHER = """
import os, sys
from pathlib import Path
from rectrain.distributed import TORCHRUN
from rectrain.train.lifecycle import supervise
ck, rank = Path(sys.argv[1]), sys.argv[2]
cmd = [sys.executable, "-m", TORCHRUN, "--standalone", "--nproc_per_node=1", rank, str(ck)]
sys.exit(supervise.run_torchrun(cmd, dict(os.environ), ck, ["SIGTERM"]))
"""


@pytest.mark.slow
def test_a_stop_signal_while_finished_ranks_exit_leaves_the_job_succeeded_not_failed(tmp_path):
    """SLURM signals every process of the job step: a time-limit warning in a run's last seconds reaches
    torchrun's agent while the finished ranks exit, and the agent then exits 1 whatever they did.  The
    run is published (finished.json names this launch), so the launcher exits 0: Snakemake must not fail
    the job and remove its outputs."""
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    (tmp_path / "rank.py").write_text(FINISHED_RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(ck), str(tmp_path / "rank.py")],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (ck / ckpt.FINISHED).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)  # as SLURM does: the launcher, torchrun's agent and the rank
    _, stderr = proc.communicate(timeout=120)
    assert "SIGTERM: the workers were shut down" in stderr, stderr[-3000:]  # torchrun did exit 1
    assert proc.returncode == 0, stderr[-3000:]
    assert "after the ranks had finished and published the run" in stderr


def test_a_finished_marker_of_an_earlier_launch_does_not_make_a_failed_one_succeed(tmp_path):
    """finished.json left by the last launch (its run already done) says nothing about this one."""
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    CheckpointSaver(ck).mark_finished(tmp_path / "model.pt", "an-earlier-launch")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    (tmp_path / "rank.py").write_text("import sys; sys.exit(3)\n")
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(ck), str(tmp_path / "rank.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
