"""A run that diverges stops, and nothing non-finite is saved (rectrain.train.lifecycle.divergence): the detector,
fp16's loss scale through a real GradScaler on the CPU, the checkpoint guard, the LR a resume trains at
after train.lr is lowered, and one real 2-rank training made non-finite by a fault hook."""

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.train_data import config_json, packed_dataset

from rectrain.distributed import Dist
from rectrain.train import optim
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import divergence
from rectrain.train.lifecycle.divergence import Detector, Diverged
from rectrain.train.lifecycle.stop import Agreement, StopRequest
from rectrain.train.step import Step, run_steps

NAN, INF = float("nan"), float("inf")
CPU1 = Dist(0, 1, 0, 1, torch.device("cpu"))


def test_the_detector_trips_after_nonfinite_steps_in_a_row_and_a_finite_loss_resets_it():
    d = Detector(3)
    for step, loss in enumerate([2.3, NAN, INF, 2.2, NAN, NAN]):
        d.observe(0, step, loss, 0.1, None)
        assert not d.tripped, f"step {step}: {d.bad} bad in a row"
    d.observe(0, 6, NAN, 0.1, None)
    assert d.tripped and (d.last["epoch"], d.last["step"], d.last["lr"]) == (0, 6, 0.1) and math.isnan(d.last["loss"])
    assert d.cause() == "the training loss was not finite for 3 consecutive steps (train.nonfinite_steps: 3)"


def test_a_loss_scale_below_the_floor_counts_and_a_high_scale_does_not():
    d = Detector(2)
    d.observe(0, 0, 2.0, 0.1, 2.0**15)
    d.observe(0, 1, 2.0, 0.1, 0.5)
    assert not d.tripped
    d.observe(0, 2, 2.0, 0.1, 0.25)
    assert d.tripped and "the fp16 loss scale stayed below 1 for 2 consecutive steps" in d.cause()


class Rows:
    """steps_log stand-in: keeps each step's row."""

    def __init__(self):
        self.rows = []

    def write(self, **row):
        self.rows.append(row)


def fp16_step(overflow_at):
    """A tiny model trained with a real, enabled GradScaler on the CPU; the gradients of the steps in
    `overflow_at` are made infinite, as an fp16 overflow makes them."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    counter = {"step": -1}

    def hook(grad):
        return grad * INF if counter["step"] in overflow_at else grad

    net[1].weight.register_hook(hook)
    sgd = torch.optim.SGD(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    step = Step(net, torch.nn.CrossEntropyLoss(), sgd, sched, scaler, 1, "fp32", False, CPU1)
    return step, counter


def batches(n, counter):
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        counter["step"] = i
        yield torch.randn(4, 3, 2, 2, generator=g), torch.randint(0, 3, (4,), generator=g)


class Control:
    """run_steps' control as rectrain.train.lifecycle.midepoch.MidEpoch polls it: the real Agreement (one rank)."""

    def __init__(self, nonfinite_steps):
        self.detector = Detector(nonfinite_steps)
        self.agreement = Agreement(CPU1, StopRequest(), 0)
        self.diverged_at = None

    def poll(self, step):
        return self.agreement.poll(self.detector.tripped)

    def act(self, decision, steps_done, totals):
        assert decision.diverged and not decision.checkpoint
        self.diverged_at = steps_done - 1
        raise Diverged("diverged")


def test_fp16_s_occasional_overflow_skips_through_a_real_scaler_do_not_stop_the_run():
    overflow_at = {3, 11, 12, 25}  # two in a row too: the scaler halves twice
    step, counter = fp16_step(overflow_at)
    control = Control(nonfinite_steps=2)
    scales = []
    orig_update = step.scaler.update

    def update(*a):
        orig_update(*a)
        scales.append(step.scaler.get_scale())

    step.scaler.update = update
    totals = run_steps(step, 0, batches(40, counter), Rows(), 40, control=control)
    assert totals["steps"] == 40 and control.diverged_at is None
    assert scales[3] == 2.0**15 and scales[12] == 2.0**13, "the scaler really skipped and halved"
    assert all(torch.isfinite(p).all() for p in step.net.parameters())


def test_a_collapsing_fp16_loss_scale_stops_the_run_within_nonfinite_steps_of_crossing_the_floor():
    """Every step overflows: the scale halves from 2**16 each step and is below 1 after step 16."""
    step, counter = fp16_step(set(range(100)))
    control = Control(nonfinite_steps=3)
    with pytest.raises(Diverged):
        run_steps(step, 0, batches(100, counter), Rows(), 100, control=control)
    # below the floor from step 16 on: the third such step (18) is read one step late, at step 19's poll,
    # and step 19 is read before the ranks stop (its row is written): 4 bad steps, the line names 19
    assert control.diverged_at == 19
    assert control.detector.last["step"] == 19 and control.detector.last["scale"] == 2.0**-4
    assert "the fp16 loss scale stayed below 1 for 4 consecutive steps" in control.detector.cause()


def fake_watch(tmp_path):
    """A rank's Watch over a small conv + BatchNorm model whose SGD has momentum buffers."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 5, 5)).sum().backward()
    sgd.step()  # momentum buffers exist
    ck = tmp_path / "checkpoints"
    ck.mkdir(exist_ok=True)
    step = SimpleNamespace(optimizer=sgd, scaler=torch.amp.GradScaler("cpu", enabled=False))
    watch = divergence.Watch(CPU1, ck, "fp32", Detector(3), lambda: divergence.run_states(model, step))
    return watch, model, sgd


def test_nonfinite_names_finds_a_nan_in_a_weight_a_batchnorm_buffer_and_a_momentum_buffer(tmp_path):
    watch, model, sgd = fake_watch(tmp_path)
    assert divergence.nonfinite_names(watch.states()) == []
    with torch.no_grad():
        model[0].weight[0, 0, 0, 0] = NAN
        model[1].running_var[1] = INF
        sgd.state[model[0].bias]["momentum_buffer"][2] = NAN
    assert sorted(divergence.nonfinite_names(watch.states())) == [
        "model.0.weight",
        "model.1.running_var",
        "optimizer.state.1.momentum_buffer",
    ]


def test_the_guard_refuses_a_nonfinite_state_before_any_checkpoint_keeping_the_last_good_one(tmp_path):
    watch, model, _ = fake_watch(tmp_path)
    ck = watch.ck_dir
    ckpt.save_atomic({"model": model.state_dict(), "epoch": 0, "step": None}, ck / "last.pt")
    before = (ck / "last.pt").read_bytes()
    agreement = Agreement(CPU1, StopRequest(), 0)
    divergence.guard(watch, agreement, "the end of epoch 1")  # all finite: nothing happens
    assert not (ck / ckpt.DIVERGED).exists()
    with torch.no_grad():
        model[1].running_mean[0] = NAN
    with pytest.raises(Diverged) as err:
        divergence.guard(watch, agreement, "the end of epoch 1")
    assert (ck / "last.pt").read_bytes() == before
    text = str(err.value)
    assert text.startswith("rank 0: training diverged at the end of epoch 1 (lr unknown, no loss scale (fp32)): ")
    assert "1 non-finite tensor(s) in the model or optimizer state (model.1.running_mean)" in text
    assert f"{ck / 'last.pt'} (epoch 0 (its end)) is the last good checkpoint" in text
    assert "train.clip_grad_norm" in text and "train.resume: always" in text and "bf16" in text
    assert json.loads((ck / ckpt.DIVERGED).read_text())["where"] == "the end of epoch 1"
    assert ckpt.DIVERGED in ckpt.run_files(ck), "moved aside with its run"


def test_a_resume_with_a_lowered_lr_trains_on_at_the_new_peak_from_the_loaded_step():
    """Loading a checkpoint's optimizer and LambdaLR restores its peak LR; keep_configured_lr puts this
    run's back, at the loaded step (train.resume: always after lowering train.lr)."""
    factor = lambda s: 1.0 / (1 + s)  # noqa: E731
    p = torch.nn.Parameter(torch.zeros(2))
    old = torch.optim.SGD([p], lr=1e6, momentum=0.9)
    old_sched = torch.optim.lr_scheduler.LambdaLR(old, factor)
    for _ in range(3):
        old.step()
        old_sched.step()
    new = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(new, factor)
    base = list(sched.base_lrs)
    new.load_state_dict(old.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    assert new.param_groups[0]["lr"] == pytest.approx(1e6 / 4), "what loading alone trains at"
    optim.keep_configured_lr(sched, base)
    assert new.param_groups[0]["lr"] == pytest.approx(0.1 / 4) and sched.get_last_lr() == [pytest.approx(0.1 / 4)]
    new.step()
    sched.step()
    assert new.param_groups[0]["lr"] == pytest.approx(0.1 / 5)


def run_train(data, out, env_extra=None, **cfg):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(env_extra or {})
    cfg = {"model": "squeezenet1_1", "precision": "fp32", "calibration_steps": 0, "batch_size": 4, **cfg}
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", config_json(**cfg), *data, "--out", str(out)]
    return subprocess.run([*cmd, "--threads", "2"], env=env, capture_output=True, text=True, timeout=300)


def all_finite(path):
    state = ckpt.load(path)
    return divergence.nonfinite_names({k: state[k] for k in ("model", "optimizer", "scaler")}) == []


@pytest.mark.slow
def test_a_run_made_nonfinite_stops_on_every_rank_and_resume_always_with_a_lower_lr_finishes(tmp_path):
    """2 ranks, 6 steps an epoch; from epoch 1 step 1 the images are infinite (faults.NONFINITE_AT_ENV)."""
    data = packed_dataset(tmp_path / "data", n_train=45, n_val=15)
    out = tmp_path / "t"
    stopped = run_train(data, out, {"RECTRAIN_NONFINITE_AT": "1:1"}, epochs=3, nonfinite_steps=3)
    err = stopped.stderr
    assert stopped.returncode == divergence.EXIT_DIVERGED, err[-3000:]
    for rank in (0, 1):
        # steps 1, 2, 3 bad; the third is read one step late, at step 4's poll: nonfinite_steps + 1 steps
        assert f"rank {rank}: training diverged at epoch 1 step 4 (lr " in err, err[-3000:]
    assert "the training loss was not finite for 4 consecutive steps (train.nonfinite_steps: 3)" in err
    assert "stopped at epoch 1 step 4 of 6, nothing of it saved" in err
    assert f"{out / 'checkpoints' / 'last.pt'} (epoch 0 (its end)) is the last good checkpoint" in err
    # the ranks end in their line, no traceback of theirs (torchrun's agent then reports the failed ranks)
    assert "rectrain/train/" not in err and "Diverged" not in err
    ck = out / "checkpoints"
    on_disk = sorted(p.name for p in ck.glob("*.pt"))
    assert on_disk == ["epoch_0.pt", "last.pt"] and all(all_finite(ck / n) for n in on_disk)

    resumed = run_train(data, out, epochs=3, nonfinite_steps=3, lr=0.05, resume="always")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "despite the train config changed (lr)" in resumed.stderr and "epoch 0: train loss" not in resumed.stderr
    assert all(all_finite(p) for p in ck.glob("*.pt"))
    model = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    weights = model.get("model", model)
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())
    run = json.loads((out / "run.json").read_text())
    assert run["resumed_from_epoch"] == 1 and run["diverged_before"]["where"] == "epoch 1 step 4 of 6"


@pytest.mark.parametrize("scaled", [False, True])
def test_clip_grad_norm_bounds_the_update_to_the_true_gradients_norm(scaled):
    """SGD at lr 1 without momentum moves the weights by the gradient: clipped to norm 0.1, the step is
    0.1 long, under fp16's GradScaler too (the gradients are unscaled before clipping)."""

    def update_norm(clip):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
        sgd = torch.optim.SGD(net.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0)
        scaler = torch.amp.GradScaler("cpu", enabled=scaled)
        step = Step(net, torch.nn.CrossEntropyLoss(), sgd, sched, scaler, 1, "fp32", False, CPU1, clip_grad_norm=clip)
        before = torch.cat([p.detach().flatten().clone() for p in net.parameters()])
        x, y = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(1)) * 100, torch.tensor([0, 1, 2, 0])
        run_steps(step, 0, [(x, y)], Rows(), 1)
        return float((torch.cat([p.detach().flatten() for p in net.parameters()]) - before).norm())

    assert update_norm(None) > 1.0, "the unclipped gradient is long"
    assert update_norm(0.1) == pytest.approx(0.1, rel=1e-3)
