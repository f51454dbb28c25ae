"""A run that diverges stops, and nothing non-finite or out of its loss band is saved
(rectrain.train.lifecycle.divergence): the detector (a loss that is not finite, above its band, a collapsed
fp16 loss scale through a real GradScaler on the CPU, parameters that explode), the checkpoint guard,
the advice for the run's own settings, the LR a resume trains at after train.lr is lowered, and real
2-rank trainings: made non-finite by a fault hook, exploding at a high train.lr, and exploding after a
good epoch."""

import csv
import json
import math
import os
import re
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.train_data import config_json, packed_dataset, train_settings

from rectrain.distributed import Dist
from rectrain.train import lossband, optim
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import divergence, faults
from rectrain.train.lifecycle.divergence import Diverged
from rectrain.train.lifecycle.stop import Agreement, StopRequest
from rectrain.train.lossband import Detector
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


LN5 = math.log(5)


def test_a_loss_above_its_band_for_nonfinite_steps_in_a_row_trips_and_a_single_spike_does_not():
    """The band's top: max(ln K, min(4 x the median of the recent in-band losses, 10 x max(ln K, the first
    loss))); a spike above it counts as a bad step, the next step inside the band resets the count."""
    d = Detector(3, classes=5)
    for step, loss in enumerate([2.0, 1.9, 1.8, 1.7]):
        d.observe(0, step, loss, 0.1, None)
    assert d.upper() == pytest.approx(4 * statistics.median([2.0, 1.9, 1.8, 1.7]))
    d.observe(0, 4, 500.0, 0.1, None)
    d.observe(0, 5, 400.0, 0.1, None)
    assert d.above_band and not d.tripped
    d.observe(0, 6, 1.6, 0.1, None)
    assert not d.above_band and d.bad == 0, "back inside the band: a spike, not a divergence"
    assert 500.0 not in d.history, "a loss above the band never raises the level"
    for step, loss in enumerate([50.0, 60.0, 70.0], start=7):
        d.observe(0, step, loss, 0.1, None)
    assert d.tripped and d.kind == lossband.ABOVE_BAND
    assert d.cause().startswith(
        "the training loss stayed above its band for 3 consecutive steps (train.nonfinite_steps: 3), last 70"
    ), d.cause()
    assert "ln 5 = 1.61" in d.cause()


def test_the_band_never_falls_below_ln_k_and_a_slow_climb_trips_at_ten_times_the_first_loss():
    """A trained model's loss far below ln K may spike to ln K on a hard batch; a loss that creeps up a
    little every step (each step inside 4 x its recent level) still ends at the ceiling."""
    d = Detector(3, classes=5)
    for step in range(200):
        d.observe(0, step, 0.01, 0.1, None)
    assert d.upper() == pytest.approx(LN5), "4 x 0.01 is below ln 5: the floor"
    for step in range(3):
        d.observe(1, step, 1.5, 0.1, None)
    assert not d.tripped, "below ln K: a hard batch, not a divergence"
    d = Detector(3, classes=5)
    loss, step = 2.0, 0
    while not d.tripped and step < 10_000:
        d.observe(0, step, loss, 0.1, None)
        loss, step = loss * 1.01, step + 1
    assert d.tripped and d.last["loss"] > 10 * 2.0 and d.last["loss"] < 10 * 2.0 * 1.01**3, d.last


def test_a_nan_after_the_loss_left_its_band_counts_toward_the_same_streak():
    d = Detector(3, classes=5)
    for step, loss in enumerate([1.7, 1.6, 300.0, 9e9, NAN]):
        d.observe(0, step, loss, 0.1, None)
    assert (
        d.tripped and d.cause() == "the training loss was not finite for 3 consecutive steps (train.nonfinite_steps: 3)"
    )


class FakeNorms:
    """A parameters' norm measurer that counts its calls (each one a host sync on a GPU)."""

    def __init__(self, params=10.0, update=0.01):
        self.params, self.update, self.calls = params, update, 0

    def __call__(self):
        self.calls += 1
        return lossband.Norms(self.params, self.update)


def test_the_parameters_are_measured_every_norm_every_steps_not_every_step_and_trip_when_they_explode():
    norms = FakeNorms()
    d = Detector(3, classes=5, norms=norms)
    assert norms.calls == 1 and d.start_norm == 10.0, "the launch's starting norm"
    for step in range(lossband.NORM_EVERY_STEPS * 3):
        d.observe(0, step, 1.5, 0.1, None)
    assert norms.calls == 1 + 3 and not d.tripped, "no host sync per step"
    norms.params = 10.0 * lossband.NORM_GROWTH
    d.check_norms()  # as the guard does before a checkpoint
    assert d.tripped and d.cause() == (
        "the parameters' norm grew from 10 at this launch's start to 1000 (100 x; limit 100 x)"
    )
    norms = FakeNorms(update=12.0)
    d = Detector(3, classes=5, norms=norms)
    d.check_norms()
    assert d.tripped and d.cause().startswith("one SGD update moved the parameters by 12, 1.2 x their norm 10")


def test_sgds_update_norm_is_the_lr_times_its_momentum_buffer_and_adamw_has_none():
    net = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    measure = lossband.parameter_norms(net, sgd)
    assert measure().update is None, "no step yet: no momentum buffer"
    net(torch.ones(1, 3)).sum().backward()
    sgd.step()
    bufs = [sgd.state[p]["momentum_buffer"] for p in net.parameters()]
    n = measure()
    assert n.update == pytest.approx(0.5 * float(torch.cat([b.flatten() for b in bufs]).norm()))
    assert n.params == pytest.approx(float(torch.cat([p.detach().flatten() for p in net.parameters()]).norm()))
    adamw = torch.optim.AdamW(net.parameters(), lr=0.5)
    net(torch.ones(1, 3)).sum().backward()
    adamw.step()
    assert lossband.parameter_norms(net, adamw)().update is None


@pytest.mark.parametrize(
    ("given", "wanted", "unwanted"),
    [
        ({"precision": "bf16"}, ["lower train.lr (now 0.1", "train.warmup_epochs (now 1)", "set train.clip_grad_norm"], ["bf16"]),
        ({"precision": "fp16", "clip_grad_norm": 5.0, "lr": 2.0}, ["train.precision: bf16", "lower train.clip_grad_norm (now 5)", "(now 2,"], ["set train.clip_grad_norm"]),
        ({"lr_schedule": "linear", "lr_peak_epoch": 3}, ["train.lr_peak_epoch later (now 3)"], ["warmup_epochs"]),
    ],
)  # fmt: skip
def test_the_advice_fits_the_runs_own_settings(given, wanted, unwanted):
    settings = train_settings(given)
    text = divergence.advice(settings.optim, settings.network.precision)
    assert all(w in text for w in wanted) and not any(u in text for u in unwanted), text
    assert text.endswith("then rerun with train.resume: always")


def test_the_guard_refuses_a_checkpoint_while_the_last_loss_is_above_its_band(tmp_path):
    """A checkpoint written after the loss left its band would be no good one: the guard stops the run
    there, though the detector has not tripped yet, and last.pt stays the good one before."""
    watch, model, _ = fake_watch(tmp_path)
    ckpt.save_atomic({"model": model.state_dict(), "epoch": 0, "step": None}, watch.ck_dir / "last.pt")
    for step, loss in enumerate([1.7, 1.6, 1.5]):
        watch.detector.observe(1, step, loss, 0.1, None)
    agreement = Agreement(CPU1, StopRequest(), 0)
    divergence.guard(watch, agreement, "the end of epoch 1")
    kept = json.loads((tmp_path / "telemetry" / divergence.MARGINS).read_text())
    assert kept["margins"]["loss_over_band"] == pytest.approx(1.6 / (4 * 1.7)), "how close it came, for the bench"
    assert kept["thresholds"] == {"loss_over_band": 1.0, "norm_growth": 100.0, "update_share": 1.0}
    watch.detector.observe(1, 3, 80.0, 0.1, None)
    assert not watch.detector.tripped
    with pytest.raises(Diverged) as err:
        divergence.guard(watch, agreement, "the end of epoch 1")
    assert "the training loss 80 was above its band at this checkpoint (the loss band's top 6.4 " in str(err.value)
    assert "(epoch 0 (its end)) is the last good checkpoint" in str(err.value)


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
    states = lambda: divergence.run_states(model, step)  # noqa: E731
    settings = train_settings({"precision": "fp32"})
    advice = divergence.advice(settings.optim, settings.network.precision)
    watch = divergence.Watch(CPU1, ck, "fp32", Detector(3, classes=5), states, advice)
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
    assert "set train.clip_grad_norm (e.g. 1.0)" in text and "train.resume: always" in text
    assert "bf16" not in text, "no bf16 advice to an fp32 run"
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


def rank_losses(out, rank):
    """(epoch, step, loss) of each step `rank` trained, from its live step log."""
    with open(out / "telemetry" / f"steps_rank{rank}.csv", newline="") as f:
        return [(int(r["epoch"]), int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def five_colours(tmp_path_factory):
    return packed_dataset(tmp_path_factory.mktemp("colours") / "data", n_train=45, n_val=15)


@pytest.mark.slow
def test_an_lr_that_makes_the_loss_explode_without_nan_stops_the_run_in_its_first_epoch_with_the_line(
    five_colours, tmp_path
):
    """ResNet-18 at train.lr 100 (3.1 at this global batch of 8): the loss climbs from 2 to thousands
    within the first epoch and stays finite for epochs (before, the run finished at a loss of 1e10 and
    exited 0); now every rank stops within nonfinite_steps + 1 steps above the band, naming it.  The
    previous run's weights.json is gone as the run starts (before, it stood beside the new run)."""
    out = tmp_path / "t"
    out.mkdir()
    (out / "weights.json").write_text('{"top1": 0.9}')  # an earlier run's, as the evaluate stage left it
    run = run_train(five_colours, out, model="resnet18", lr=100, warmup_epochs=2, epochs=3, nonfinite_steps=3)
    err = run.stderr
    assert not (out / "weights.json").exists(), "the weights it described are not this run's"
    assert run.returncode == divergence.EXIT_DIVERGED, err[-3000:]
    for rank in (0, 1):
        m = re.search(rf"rank {rank}: training diverged at epoch 0 step (\d+) \(lr [\d.]+, no loss scale \(fp32\), loss ([\d.e+]+)\): "
                      r"the training loss stayed above its band for 4 consecutive steps \(train.nonfinite_steps: 3\)", err)  # fmt: skip
        assert m, err[-3000:]
        assert all(math.isfinite(loss) for _, _, loss in rank_losses(out, rank)), "it never was NaN"
    assert "no checkpoint was written yet, a rerun starts over" in err
    assert "lower train.lr (now 100, the peak for a global batch of 256)" in err and "bf16" not in err
    assert not list((out / "checkpoints").glob("*.pt")), "nothing out of its band is saved"


@pytest.mark.slow
def test_after_a_good_epoch_the_checkpoint_called_good_has_every_loss_inside_the_band(five_colours, tmp_path):
    """The default train.lr for epoch 0; after epoch 1's second step the peak LR is 10,000 times higher
    (faults.LR_TIMES_AT_ENV): the loss explodes, finite.  The ranks stop at the end of epoch 1 with
    nothing of it saved, naming epoch 0's checkpoint, and every loss up to that checkpoint is inside the
    band by the detector's own test (its steps replayed through a new Detector)."""
    out = tmp_path / "t"
    run = run_train(five_colours, out, {faults.LR_TIMES_AT_ENV: "1:1:10000"}, model="resnet18", epochs=3)
    err = run.stderr
    assert run.returncode == divergence.EXIT_DIVERGED, err[-3000:]
    assert err.count(f"{out / 'checkpoints' / 'last.pt'} (epoch 0 (its end)) is the last good checkpoint") == 2, err[
        -3000:
    ]
    assert sorted(p.name for p in (out / "checkpoints").glob("*.pt")) == ["epoch_0.pt", "last.pt"]
    for rank in (0, 1):
        replay = Detector(3, classes=5)
        steps = rank_losses(out, rank)
        for epoch, step, loss in steps:
            if epoch == 0:
                replay.observe(epoch, step, loss, 0.1, None)
                assert not replay.above_band and math.isfinite(loss), (rank, step, loss)
        exploded = [loss for epoch, _, loss in steps if epoch == 1 and loss > replay.upper()]
        assert exploded, f"rank {rank}'s epoch 1 left the band: {steps}"
