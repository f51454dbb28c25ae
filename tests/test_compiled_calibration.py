"""train.compile through the pipeline (issue 25, point 3): the calibration runs the compiled network the
epochs run (torch.compile with inductor, the real compiler: gcc on this box), compiles in its warm-up,
and its synthetic batch has the real batches' dtype and layout, so the epochs' first real step runs the
graph the calibration compiled instead of compiling another."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from helpers.train_data import config_json, packed_dataset, tiny_train_settings, write_rec

from rectrain.distributed import Dist
from rectrain.loaders import LoaderSpec, build_loader, image_dtype
from rectrain.train.calibrate import Bounds, Shape, StepRows, calibrate, compiled_note
from rectrain.train.optim import make_optimizer
from rectrain.train.run import wrap
from rectrain.train.step import Step, compiled_graphs, run_steps

OWN_MODEL = REPO / "tests" / "helpers" / "own_model" / "net.py"
pytestmark = pytest.mark.slow  # inductor compiles forward and backward: 1-3 min cold on the 2-core box


class TinyNet(torch.nn.Module):
    """conv - BatchNorm - ReLU - pool - linear: a graph with BN buffers that compiles in seconds."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, classes)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def compiled_step(cfg):
    torch.manual_seed(0)
    model = TinyNet().to(memory_format=torch.channels_last)
    d = Dist(0, 1, 0, 1, torch.device("cpu"))
    part = cfg.network
    optimizer, scheduler, scaler = make_optimizer(
        cfg.optim, model, cfg.batch.batch_size, 100, family=part.model, precision=part.precision
    )
    net = wrap(model, d, cfg.launch, part)
    step = Step(net, torch.nn.CrossEntropyLoss(), optimizer, scheduler, scaler, 1, part.precision, True, d)
    return step, model


def test_compiled_calibration_compiles_in_its_warm_up_and_the_real_batches_reuse_its_graph(tmp_path):
    torch._dynamo.reset()
    cfg = tiny_train_settings(compile=True, precision="bf16", batch_size=8, image_size=32)
    step, model = compiled_step(cfg)
    rec, idx = write_rec(tmp_path, [i % 5 for i in range(40)])
    spec = LoaderSpec(rec, idx, batch_size=8, image_size=32, workers=1, dtype=image_dtype("bf16"), channels_last=True)
    loader = build_loader("dali", spec)
    shape = Shape(8, 32, 5, loader.image_dtype, channels_last=True)

    cal = calibrate(step, model, shape, steps=3, warmup=0)  # asked for no warm-up: a compiled run takes one
    assert cal["compiled"] is True and cal["warmup_steps"] == 1 and cal["steps"] == 3
    assert cal["compiles"]["warmup"] >= 1 and cal["compiles"]["measured"] == 0, cal["compiles"]
    assert "compiled (torch.compile: " in compiled_note(cal) and "raise" not in compiled_note(cal)

    graphs = compiled_graphs()
    totals = run_steps(step, 0, loader.epoch(0), StepRows(), n_batches=loader.batches_per_epoch)
    assert totals["steps"] == loader.batches_per_epoch == 5
    assert compiled_graphs() == graphs, "the real batches ran the graph the calibration compiled"

    # The control: a batch of another dtype than the loader's (a synthetic batch made without the
    # loader's image_dtype, under fp16) is another input to the compiled graph, which compiles again:
    # the count above can move.
    x = torch.randn(8, 3, 32, 32, dtype=torch.float16)
    run_steps(step, 0, [(x, torch.zeros(8, dtype=torch.int64))], StepRows(), n_batches=1)
    assert compiled_graphs() > graphs


def test_compiling_does_not_count_against_the_calibration_time_cap(monkeypatch):
    """calibration_max_s 1 s, and the first (compiling) step alone takes longer: the cap counts from its
    end, so all 6 steps of a few ms each are measured (before, the cap cut it to one).  Inductor's caches
    are off, so the graph compiled by the test before is compiled again, not loaded in half a second."""
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    torch._dynamo.reset()
    cfg = tiny_train_settings(compile=True, precision="fp32", batch_size=8, image_size=32)
    step, model = compiled_step(cfg)
    cal = calibrate(step, model, Shape(8, 32, 5, channels_last=True), steps=6, warmup=1, bounds=Bounds(max_s=1.0))
    assert cal["seconds"] > 1.0, "the precondition: compiling took longer than the cap"
    assert cal["steps"] == 6 and cal["warmup_steps"] == 1 and cal["shortened"] is None, cal


def test_compiled_measured_steps_are_named_in_the_calibration_log_line():
    cal = {"compiled": True, "compiles": {"warmup": 1, "measured": 2}}
    assert "2 graph(s) compiled during the measured steps" in compiled_note(cal)
    assert "train.calibration_warmup_steps" in compiled_note(cal)
    assert compiled_note({"compiled": False}) == ""


def test_a_compiled_training_run_of_your_own_model_under_bf16_autocast_says_so_in_its_log_and_run_json(tmp_path):
    """The CLI end to end, one CPU process, at 32 px: asked for no calibration warm-up, the compiled run
    still warms up one step, which compiles; run.json and the calibration line say it was compiled.  The
    network is the suite's own two-block model (train.model as file:factory), under bf16 autocast and
    channels_last, as a torchvision one would be (issue 33: compile, AMP and channels_last with your own
    model): inductor compiles it in seconds, where ResNet-18 took 52 s with its cache warm and 143 s cold
    on this box."""
    data = packed_dataset(tmp_path / "data")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cfg = config_json(
        model=f"{OWN_MODEL}:tiny",
        precision="bf16",
        channels_last=True,
        epochs=1,
        cpu_processes=1,
        compile=True,
        calibration_warmup_steps=0,
    )
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", cfg, *data, "--out", str(tmp_path / "out")]
    done = subprocess.run([*cmd, "--threads", "2"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads((tmp_path / "out" / "run.json").read_text())
    cal = info["calibration"]
    assert info["compiled"] is True and info["config"]["compile_mode"] == "default"
    assert (info["config"]["precision"], info["config"]["channels_last"]) == ("bf16", True)
    assert info["decode_path"] == "roi"  # train.decode: auto
    assert cal["compiled"] is True and cal["warmup_steps"] == 1 and cal["steps"] >= 1
    assert cal["compiles"]["warmup"] >= 1 and cal["compiles"]["measured"] == 0, cal
    assert "graph(s) in the warm-up)" in done.stderr and "compiled (torch.compile: " in done.stderr
