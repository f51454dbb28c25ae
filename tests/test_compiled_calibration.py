"""train.compile through the pipeline (issue 25, point 3): the calibration runs the compiled network the
epochs run (torch.compile with inductor, the real compiler: gcc on this box), compiles in its warm-up,
and its synthetic batch has the real batches' dtype and layout, so the epochs' first real step runs the
graph the calibration compiled instead of compiling another."""

import pytest
import torch
from helpers.train_data import tiny_train_config, write_rec

from rectrain.distributed import Dist
from rectrain.loaders import LoaderSpec, build_loader, image_dtype
from rectrain.train.calibrate import Shape, StepRows, calibrate, compiled_note
from rectrain.train.optim import make_optimizer
from rectrain.train.run import wrap
from rectrain.train.step import Step, compiled_graphs, run_steps

pytestmark = pytest.mark.slow  # inductor compiles the forward and backward: ~1 min on the 2-core box


class TinyNet(torch.nn.Module):
    """conv - BatchNorm - ReLU - pool - linear: a graph with BN buffers that compiles in seconds."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, classes)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def compiled_step(cfg: dict):
    torch.manual_seed(0)
    model = TinyNet().to(memory_format=torch.channels_last)
    d = Dist(0, 1, 0, 1, torch.device("cpu"))
    optimizer, scheduler, scaler = make_optimizer(cfg, model, cfg["batch_size"], 100)
    net = wrap(model, d, cfg)
    step = Step(net, torch.nn.CrossEntropyLoss(), optimizer, scheduler, scaler, 1, cfg["precision"], True, d)
    return step, model


def test_compiled_calibration_compiles_in_its_warm_up_and_the_real_batches_reuse_its_graph(tmp_path):
    torch._dynamo.reset()
    cfg = tiny_train_config(compile=True, precision="bf16", batch_size=8, image_size=32)
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


def test_compiled_measured_steps_are_named_in_the_calibration_log_line():
    cal = {"compiled": True, "compiles": {"warmup": 1, "measured": 2}}
    assert "2 graph(s) compiled during the measured steps" in compiled_note(cal)
    assert "train.calibration_warmup_steps" in compiled_note(cal)
    assert compiled_note({"compiled": False}) == ""
