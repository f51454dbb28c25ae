"""Progress lines between epoch lines: the ETA arithmetic and what a line says, with a fake clock."""

import logging

import pytest

from rectrain.log import duration
from rectrain.progress import Progress, RunProgress, epoch_eta_s, run_eta_s


def test_epoch_eta_is_the_remaining_steps_at_the_measured_step_time():
    assert epoch_eta_s(1000, 5005, 0.25) == pytest.approx(4005 * 0.25)
    assert epoch_eta_s(5005, 5005, 0.25) == 0
    assert epoch_eta_s(6000, 5005, 0.25) == 0  # never negative


def test_run_eta_adds_the_later_epochs_and_the_measured_validation_per_epoch():
    # epoch 10 of 90, step 1000 of 5005 at 0.25 s: 4005 steps left here, then 79 epochs of 5005 steps,
    # and 60 s of validation + checkpoint after this epoch and after each of the 79 others
    expected = 4005 * 0.25 + 60 + 79 * (5005 * 0.25 + 60)
    assert run_eta_s(1000, 5005, 0.25, 10, 90, 60.0) == pytest.approx(expected)
    assert run_eta_s(1000, 5005, 0.25, 10, 90, None) == pytest.approx(4005 * 0.25 + 79 * 5005 * 0.25)
    assert run_eta_s(5005, 5005, 0.25, 89, 90, 60.0) == pytest.approx(60.0)  # the last validation only


def test_durations_read_at_the_precision_a_deadline_needs():
    assert [duration(s) for s in (0.4, 45, 725, 3 * 3600 + 7 * 60 + 30, 2 * 86400 + 4 * 3600 + 59)] == [
        "0 s",
        "45 s",
        "12 min 05 s",
        "3 h 07 min",
        "2 d 04 h",
    ]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_line_is_logged_once_per_interval_from_the_steps_since_the_last_line(caplog):
    clock = FakeClock()
    p = RunProgress(interval_s=30, world_size=2, epochs=3, clock=clock)
    p.begin_epoch(1, total=100)
    lines = []
    with caplog.at_level(logging.INFO, logger="rectrain.progress"):
        for i in range(100):
            # step 0 (loader start-up) takes 10 s and is left out; later steps 1 s, 0.2 s of it waiting
            wall = 10.0 if i == 0 else 1.0
            clock.now += wall
            p.add(i, wall, 0.2 if i else 9.0, 64)
            if p.due():
                lines.append(p.line(i + 1))
    # due at 30 s: step 0 ends at 10 s, then 20 steps of 1 s -> the line after step 21, then every 30 steps
    assert [line.split(":")[0] for line in lines] == [f"epoch 1 (of 3) step {k}/100 ({k}.0 %)" for k in (21, 51, 81)]
    assert caplog.messages == lines
    first = lines[0]
    assert "128.0 img/s (all 2 rank(s), last 20 step(s))" in first  # 64 images x 2 ranks / 1 s
    assert "data wait 20 %" in first
    assert "ETA 1 min 19 s" in first  # 79 steps x 1 s
    # and one more epoch of 100 x 1 s after this one; validation not measured yet
    assert "run ETA 2 min 59 s + validation (1 epoch(s) after this one; validation not measured yet)" in first
    assert "last 30 step(s)" in lines[1]


def test_run_eta_counts_validation_once_measured():
    clock = FakeClock()
    p = RunProgress(interval_s=1, world_size=1, epochs=3, clock=clock)
    p.between_s = 30.0
    p.begin_epoch(1, total=100)
    for i in range(3):
        clock.now += 1.0
        p.add(i, 1.0, 0.0, 10)
    line = p.line(3)
    # 97 s here + 30 s validation, then 100 s + 30 s for the last epoch
    assert "run ETA 4 min 17 s (1 epoch(s) after this one; validation and checkpoint 30 s per epoch)" in line


def test_no_line_before_a_steady_step():
    clock = FakeClock()
    p = Progress(interval_s=0, world_size=1, clock=clock)
    p.begin("evaluation batch", 10)
    p.add(0, 5.0, 5.0, 8)
    assert p.due() and p.line(1) is None


def test_a_pass_ends_on_its_last_steps_line_even_when_no_interval_has_passed(caplog):
    """Steps are resolved one step late, so the last one comes right after the one before: with the
    line due by the clock alone, whether `step K/K` appeared depended on the machine's speed (a quiet
    box missed it). The last step's line is always written; before it, only the interval decides."""
    import torch

    from rectrain.distributed import Dist
    from rectrain.train.step import Step, run_steps

    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    step = Step(
        net, torch.nn.CrossEntropyLoss(), opt, sched, scaler, 1, "fp32", False, Dist(0, 1, 0, 1, torch.device("cpu"))
    )
    batches = [(torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2,))) for _ in range(5)]

    class NoLog:
        def write(self, **row):
            pass

    progress = Progress(3600, 1)  # never due within this test
    progress.begin("epoch 0 step", len(batches))
    with caplog.at_level(logging.INFO, logger="rectrain"):
        run_steps(step, 0, iter(batches), NoLog(), n_batches=len(batches), progress=progress)
    lines = [m for m in caplog.messages if m.startswith("epoch 0 step")]
    assert [line.split(" (")[0] for line in lines] == ["epoch 0 step 5/5"], lines


def test_a_counted_pass_says_images_done_of_total_the_rate_so_far_and_the_eta(caplog):
    # the pack's read / assemble / verify steps: only a count of images done, no step times
    clock = FakeClock()
    p = Progress(interval_s=10, clock=clock)
    p.begin("pack train: read", 1000, lambda done, per_image: ", 1.0 MB/s", unit="images")
    with caplog.at_level(logging.INFO, logger="rectrain.progress"):
        clock.now = 5.0
        assert p.count(100) is None  # not due yet
        clock.now = 10.0
        first = p.count(250)
        clock.now = 11.0
        assert p.count(260) is None  # the next line is due 10 s after the last
        last = p.count(1000, force=True)  # the step's end: a line now
    assert first == "pack train: read 250/1000 images (25.0 %): 25.0 img/s, ETA 30 s, 1.0 MB/s"
    assert last == "pack train: read 1000/1000 images (100.0 %): 90.9 img/s, ETA 0 s, 1.0 MB/s"
    assert caplog.messages == [first, last]
