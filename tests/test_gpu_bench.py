"""bench/gpu_efficiency.py's code path (loaders vs synthetic through rectrain.train.trainer.run_steps) on CPU with
tiny settings, and the StepClock's accounting: wall = data wait + compute."""

import json
import subprocess
import sys
import time

import pytest
import torch
from helpers import REPO
from helpers.train_data import write_rec

from rectrain.distributed import Dist
from rectrain.recordio import IndexedRecordReader, unpack_record
from rectrain.stepclock import StepClock


@pytest.mark.slow
def test_gpu_bench_dry_run_measures_every_loader_decode_path_and_repeat_against_synthetic_on_cpu(tmp_path):
    """--dry: the device run's code paths on the CPU at tiny sizes (two runs, one re-encoded), each DALI
    decode path a row, two interleaved repeats of every source and of the synthetic ceiling."""
    rec, idx = write_rec(tmp_path, [i % 5 for i in range(13)])
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "gpu_efficiency.py"),
        "--dry",
        "--rec",
        str(rec),
        "--idx",
        str(idx),
        "--out",
        str(out),
        "--scratch",
        str(tmp_path / "scratch"),
        "--decodes",
        "roi,full",
        "--repeats",
        "2",
        "--num-classes",
        "5",
        "--precision",
        "fp32",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "gpu_efficiency.json").read_text())
    rows = result["rows"]
    assert [(r["loader"], r["image_size"], r["rec_side"], r["compile"]) for r in rows] == [
        ("dali roi", 32, 0, "eager"),
        ("dali full", 32, 0, "eager"),
        ("torch", 32, 0, "eager"),
        ("dali roi", 24, 28, "eager"),
        ("dali full", 24, 28, "eager"),
        ("torch", 24, 28, "eager"),
    ]
    assert result["meta"]["repeats"] == 2 and result["meta"]["steps"] == 3
    for r in rows:
        assert r["real_img_s"] > 0 and r["synthetic_img_s"] > 0 and r["steps"] == 3
        assert len(r["repeats_real"]) == len(r["repeats_synthetic"]) == 2
        assert abs(r["real_img_s"] - sum(r["repeats_real"]) / 2) < 1e-9
        assert abs(r["ratio"] - r["real_img_s"] / r["synthetic_img_s"]) < 1e-9
        assert 0 <= r["data_wait_share"] < 1
        assert r["decode"].startswith("cpu") and r["gpu_util"] is None  # no NVML on the CPU
        assert r["compiles"] == 0
    assert [r["decode_path"] for r in rows[:3]] == ["roi", "full", None]
    table = (out / "gpu_efficiency.md").read_text()
    assert "| img/s real | img/s synthetic | ratio | data-wait share | GPU util % |" in table
    assert table.count("\n| cpu") == 6
    # The bench's .rec copies: enough records for warm-up + steps + prefetch in one epoch, labels kept,
    # and the @28 copy re-encoded to shorter side 28.
    # The copies are scratch data: they go to --scratch, and only the two tables to --out (what comes back
    # from a lent GPU machine must stay small).
    assert sorted(p.name for p in out.iterdir()) == ["gpu_efficiency.json", "gpu_efficiency.md"]
    small = sorted((tmp_path / "scratch").glob("bench_side28_*.rec"))[0]
    with IndexedRecordReader(small, small.with_suffix(".idx")) as reader:
        assert len(reader) >= (1 + 3 + 4) * 4
        header, data = unpack_record(reader.read(reader.keys[13]))
        assert header.label == 0.0  # record 13 repeats source record 0 (label 0)
        import io

        from PIL import Image

        assert min(Image.open(io.BytesIO(data)).size) == 28


class FakeLog:
    def __init__(self):
        self.rows = []

    def write(self, **row):
        self.rows.append(row)


def test_run_steps_rows_add_up_and_data_wait_is_the_loaders_time():
    from helpers.train_data import tiny_train_settings

    from rectrain.train import trainer as T
    from rectrain.train.optim import make_optimizer
    from rectrain.train.run import make_model

    cfg = tiny_train_settings().replaced(channels_last=False, precision="fp32", image_size=16)
    device = torch.device("cpu")
    model, loss_fn, _ = make_model(cfg.replaced(model="resnet18").network, 3, device)
    optimizer, scheduler, scaler = make_optimizer(
        cfg.optim, model, 4, 5, family=cfg.network.model, precision=cfg.network.precision
    )

    def slow_batches():
        for _ in range(4):
            time.sleep(0.05)  # a loader that makes the step wait 50 ms
            yield torch.randn(4, 3, 16, 16), torch.randint(0, 3, (4,))

    log = FakeLog()
    step = T.Step(
        model,
        loss_fn,
        optimizer,
        scheduler,
        scaler,
        1,
        cfg.network.precision,
        cfg.network.channels_last,
        Dist(0, 1, 0, 1, device),
    )
    totals = T.run_steps(step, 0, slow_batches(), log, max_steps=3)
    assert totals["steps"] == 3 and totals["seen"] == 12 and [r["step"] for r in log.rows] == [0, 1, 2]
    for r in log.rows:
        assert abs(r["wall_s"] - r["data_wait_s"] - r["compute_s"]) < 1e-9
        assert r["data_wait_s"] >= 0.045 and r["compute_s"] > 0
    assert log.rows[0]["time"] < log.rows[1]["time"] < log.rows[2]["time"] <= time.time()


def test_step_clock_on_cpu_measures_intervals_and_unix_time():
    clock = StepClock(torch.device("cpu"))
    a = clock.mark()
    time.sleep(0.02)
    b = clock.mark()
    clock.wait(b)
    assert 0.015 < clock.seconds(a, b) < 1
    assert abs(clock.unix_time(b) - time.time()) < 0.5


def test_oom_cap_runs_the_training_preflight_and_refuses_without_a_gpu():
    import pytest

    sys.path.insert(0, str(REPO / "bench"))
    import oom_cap

    cpu = torch.device("cpu")
    fixed = oom_cap.preflight({"model": "resnet18", "image_size": 32, "batch_size": 256}, cpu, 10)
    assert fixed["batch"] == 256 and "no GPU" in fixed["report"]["skipped"]
    auto = oom_cap.preflight({"model": "resnet18", "image_size": 32, "batch_size": "auto", "global_batch": 96}, cpu, 10)
    assert (auto["batch"], auto["grad_accum"]) == (96, 1)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a GPU"):
            oom_cap.main(["--out", "/nonexistent"])


def _bench_module():
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_efficiency

    return gpu_efficiency


@pytest.mark.parametrize(
    "text,expected",
    [("cuda", torch.device("cuda", 0)), ("cuda:1", torch.device("cuda", 1)), ("cpu", torch.device("cpu"))],
)
def test_bench_device_always_has_an_index_for_cuda(text, expected):
    assert _bench_module().bench_device(text) == expected


def test_bench_with_device_cuda_passes_an_indexed_device_to_set_device(monkeypatch, tmp_path):
    """`--device cuda` (the default on a GPU box) used to reach torch.cuda.set_device(torch.device("cuda")),
    which raises "Expected a torch.device with a specified index".  torch's own index check (the one
    set_device runs first) stands in for the GPU; the run stops right after set_device."""
    from torch.cuda._utils import _get_device_index

    bench = _bench_module()
    seen = []

    class SetDeviceCalled(Exception):
        pass

    def set_device(device):
        seen.append(device)
        _get_device_index(device)  # raises ValueError for an unindexed CUDA device, as set_device does
        raise SetDeviceCalled

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(SetDeviceCalled):
        bench.main(["--rec", "r", "--idx", "i", "--out", str(tmp_path), "--device", "cuda"])
    assert seen == [torch.device("cuda", 0)]


def test_unindexed_cuda_device_is_what_torch_refuses():
    """The premise of the test above: without the normalisation, set_device's index check fails."""
    from torch.cuda._utils import _get_device_index

    with pytest.raises(ValueError, match="specified index"):
        _get_device_index(torch.device("cuda"))
