"""OOM preflight: the batch search and the message, driven by a fake allocator that fails above a size,
and the budget beside the step (loader, DDP) driven by a fake free-memory query."""

import dataclasses

import pytest
import torch
from helpers.train_data import plan_batch_of, rank_parts, tiny_train_settings, train_settings

from rectrain.distributed import Dist
from rectrain.loaders import DaliOptions, LoaderSpec, choose_loader
from rectrain.train import batchplan
from rectrain.train.lifecycle import failure
from rectrain.train.run import make_model

GPU = batchplan.GpuInfo(0, "NVIDIA GeForce RTX 2080 Ti", 11264.0)
PLAN_128_ON_2 = batchplan.BatchPlan(128, 1, 2, reason="train.batch_size: 128")


class FakeAllocator:
    """try_step(batch) that raises CUDA's OOM error above `limit`, counting the tries."""

    def __init__(self, limit, error=torch.cuda.OutOfMemoryError):
        self.limit, self.error, self.tries = limit, error, []

    def __call__(self, batch):
        self.tries.append(batch)
        if batch > self.limit:
            raise self.error(f"CUDA out of memory. Tried to allocate {batch * 100} MiB")
        return batch * 100.0  # MB: ~96 fits an 11 GB card, as for ResNet-50 at 224 px in fp32


@pytest.mark.parametrize("limit,failed", [(96, 128), (1, 128), (127, 128), (0, 64), (300, 512)])
def test_search_finds_the_largest_fitting_batch(limit, failed):
    fake = FakeAllocator(limit)
    assert batchplan.largest_fitting_batch(fake, failed) == min(limit, failed - 1)
    assert len(fake.tries) <= failed.bit_length() + 1, "binary search, not a linear scan"


def test_search_propagates_errors_that_are_not_oom():
    def broken(batch):
        raise RuntimeError("cuDNN error: CUDNN_STATUS_MAPPING_ERROR")

    with pytest.raises(RuntimeError, match="MAPPING"):
        batchplan.largest_fitting_batch(broken, 64)


def test_failing_batch_message_names_gpu_memory_batch_fit_and_both_fixes():
    with pytest.raises(batchplan.BatchDoesNotFit) as err:
        batchplan.check_batch(FakeAllocator(96), 128, GPU, world_size=2)
    msg = str(err.value)
    for part in (
        "GPU 0",
        "RTX 2080 Ti",
        "11.0 GB",
        "batch 128 per device (needs ~12.5 GB)",
        "largest batch that fits is 96",
        "train.batch_size: 96",
        "train.grad_accum: 2",
        "global batch of 256",
    ):
        assert part in msg, f"{part!r} missing from: {msg}"


def test_allocator_errors_spelled_as_runtime_errors_count_as_oom():
    fake = FakeAllocator(50, error=lambda m: RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    with pytest.raises(batchplan.BatchDoesNotFit, match="largest batch that fits is 50"):
        batchplan.check_batch(fake, 64, GPU, world_size=1)


def test_fitting_batch_passes_after_one_try():
    fake = FakeAllocator(256)
    assert batchplan.check_batch(fake, 128, GPU, world_size=2)["fits"] is True
    assert fake.tries == [128]


def test_nothing_fits_says_so_with_other_fixes():
    with pytest.raises(batchplan.BatchDoesNotFit, match="no batch fits.*not even batch 1"):
        batchplan.check_batch(FakeAllocator(0), 32, GPU, world_size=1)


@pytest.mark.parametrize(
    "limit,global_batch,world,expect",
    [
        (1000, 256, 2, (128, 1)),  # fits outright: no accumulation
        (96, 256, 2, (64, 2)),  # 128 does not fit: 2 x 64 keeps 256
        (40, 256, 2, (32, 4)),
        (50, 300, 1, (50, 6)),
    ],
)
def test_auto_batch_keeps_the_global_batch(limit, global_batch, world, expect):
    batch_part = train_settings({"batch_size": "auto", "global_batch": global_batch, "grad_accum": 1}).batch
    fits, why = batchplan.auto_fit(FakeAllocator(limit), batchplan.wanted(batch_part, world))
    plan = batchplan.plan(batch_part, world, fits)
    batch, accum = plan.batch, plan.grad_accum
    assert (batch, accum) == expect and plan.global_batch == batch * accum * world
    assert (why is None) == (accum == 1), "a lower batch comes with the reason the wanted one was refused"
    assert batch <= limit and batch * accum * world >= global_batch


def test_the_plan_is_one_frozen_value_whose_global_batch_counts_accumulation():
    fixed = batchplan.plan(train_settings({"batch_size": 64, "grad_accum": 2, "global_batch": None}).batch, 4)
    assert (fixed.batch, fixed.grad_accum, fixed.global_batch, fixed.auto) == (64, 2, 512, False)
    auto = batchplan.plan(
        train_settings({"batch_size": "auto", "grad_accum": 1, "global_batch": None}).batch, 2, fits=50
    )
    assert (auto.batch, auto.grad_accum, auto.global_batch) == (43, 3, 258), "128 per device in 3 micro-batches"
    assert auto.auto and "128 per device did not fit, 50 did" in auto.reason
    with pytest.raises(AttributeError):
        auto.batch = 8  # built once; nothing after the plan may change it


def test_the_fix_for_a_batch_that_does_not_fit_keeps_the_global_batch_with_its_accumulation():
    """batch 128 x grad_accum 2 on 2 processes is a global batch of 512, not 256."""
    with pytest.raises(batchplan.BatchDoesNotFit) as err:
        batchplan.check_batch(FakeAllocator(96), 128, GPU, world_size=2, accum=2)
    assert "global batch of 512 with train.batch_size: 86 and train.grad_accum: 3" in str(err.value)


def test_headroom_exceeded_is_treated_as_oom():
    assert batchplan.is_oom(batchplan.HeadroomExceeded("batch 64 peaks at 10500 MB"))


def test_cuda_error_hint_is_none_on_cpu():
    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert failure.explain_cuda_error(err, torch.device("cpu"), PLAN_128_ON_2) is None


def test_illegal_memory_access_near_the_limit_gets_the_oom_hint(monkeypatch):
    """An 'illegal memory access' is explained as OOM when reserved memory was near the card's size."""
    monkeypatch.setattr(batchplan.GpuInfo, "of", classmethod(lambda cls, device: GPU))
    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 10900 * 2**20)
    hint = failure.explain_cuda_error(err, torch.device("cuda", 0), PLAN_128_ON_2)
    assert hint and "most likely out of memory" in hint and "GPU 0" in hint and "train.grad_accum" in hint
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 3000 * 2**20)
    assert failure.explain_cuda_error(err, torch.device("cuda", 0), PLAN_128_ON_2) is None, (
        "far from the limit: no guess"
    )


# --- the budget: what else holds the device -------------------------------------------------------

GB = 2**30
CARD = 11 * GB  # the reference 2080 Ti
FREE = int(10.5 * GB)  # after the CUDA context


def fake_mem_get_info(device):
    return FREE, CARD


def step_bytes(batch):
    """ResNet-50-like: ~0.7 GB fixed (weights, optimizer state) + 32 MB per image; 256 needs 8.7 GB."""
    return int(0.7 * GB) + batch * 32 * 2**20


def dali_held(workers=8, image_size=224):
    spec = LoaderSpec("t.rec", "t.idx", 0, image_size, device="cuda:0", workers=workers, dali=DaliOptions.defaults())
    choice = choose_loader("dali", has_cuda=True, has_dali=True, gpu_decode=True)
    return (
        batchplan.loader_reservation(choice, spec, "training"),
        batchplan.loader_reservation(choice, spec, "validation"),
    )


def budget(held, headroom=batchplan.HEADROOM):
    return batchplan.device_budget(torch.device("cuda", 0), held, headroom, mem_get_info=fake_mem_get_info)


def test_auto_batch_counts_the_decoder_and_says_why_it_chose_lower():
    """11 GB card: the step alone fits at 256 within the headroom; beside DALI's mixed decoder (8 decode
    threads x 201 MB padding, per loader, plus prefetched batches) it does not, so auto goes lower."""
    alone = batchplan.budgeted(step_bytes, budget(()))
    assert alone(256) == pytest.approx(step_bytes(256) / 2**20), "the step alone fits at 256"
    try_step = batchplan.budgeted(step_bytes, budget(dali_held()))
    fits, why = batchplan.auto_fit(try_step, 256)
    assert batchplan.split_batch(256, fits) == (128, 2)
    for part in (
        "batch 256 needs",
        "for the training step (model, activations, optimizer state)",
        "held by the training loader's DALI mixed decoder (dali_device_memory_padding 201 MB per decode thread x 8 "
        "threads = 1.57 GB, plus 2 prefetched batches and the one in the step",
        "held by the validation loader's DALI mixed decoder",
        "over 90% of the 10.50 GB free on the device",
    ):
        assert part in why, f"{part!r} missing from: {why}"


def test_fixed_batch_that_fits_only_without_the_decoder_stops_naming_its_share():
    gpu = batchplan.GpuInfo(0, "NVIDIA GeForce RTX 2080 Ti", 11264.0)
    try_step = batchplan.budgeted(step_bytes, budget(dali_held(), headroom=1.0))
    with pytest.raises(batchplan.BatchDoesNotFit) as err:
        batchplan.check_batch(try_step, 256, gpu, world_size=1)
    msg = str(err.value)
    assert "batch 256 per device does not fit on GPU 0" in msg and "largest batch that fits is 192" in msg
    assert "DALI mixed decoder (dali_device_memory_padding 201 MB per decode thread x 8 threads" in msg


def test_without_a_val_split_the_preflight_reserves_nothing_for_a_validation_loader():
    """On a GPU rank (the device is only named: nothing is allocated) the validation loader's share is
    held beside the step only when a val split will be validated: without one, its DALI decoder's
    padding (GBs with 8 decode threads) would cut an auto batch for a loader never built."""
    d = Dist(0, 2, 0, 2, torch.device("cuda:0"))
    cfg = tiny_train_settings(image_size=224)
    model, loss, _ = make_model(cfg.network, 5, torch.device("cpu"))

    def parts(validated):
        return rank_parts(cfg, model, loss, d, validated=validated)

    def held(validated):
        return [r.what for r in batchplan.preflight_inputs(d, parts(validated), cfg.optim, cfg.network)[1] if r]

    assert any("validation loader" in what for what in held(True))
    without = held(False)
    assert without and not any("validation loader" in what for what in without)
    assert any("training loader" in what for what in without) and any("DDP" in what for what in without)


def test_plan_batch_hands_the_preflight_whether_a_val_split_is_validated(monkeypatch):
    seen = []

    class Seen(Exception):
        pass

    def record(d, parts, optim, network):
        seen.append(parts.val_spec is not None)
        raise Seen

    monkeypatch.setattr(batchplan, "preflight_inputs", record)
    d = Dist(0, 1, 0, 1, torch.device("cuda:0"))
    cfg = tiny_train_settings()
    for validated in (True, False):
        with pytest.raises(Seen):
            spec = LoaderSpec("t.rec", "t.idx", 0, 32)
            plan_batch_of(cfg, d, rank_parts(cfg, None, None, d, spec=spec, validated=validated))
    assert seen == [True, False]


def test_the_preallocation_is_counted_only_on_a_gpu_with_hardware_jpeg_decoders(monkeypatch):
    """dali_preallocate's ImageNet hint (6430x5980) reserves ~115 MB per sample, but only where the
    hardware decoder it sizes exists: an 11 GB RTX 2080 Ti's plan must not lose that memory."""
    opts = dataclasses.replace(DaliOptions.defaults(), preallocate=(6430, 5980))
    spec = LoaderSpec("t.rec", "t.idx", 0, 224, device="cuda:0", workers=4, dali=opts)
    choice = choose_loader("dali", has_cuda=True, has_dali=True, gpu_decode=True)
    per_sample = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("NVIDIA GeForce RTX 2080 Ti", "NVIDIA H200"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        per_sample[name] = batchplan.loader_reservation(choice, spec).per_sample_bytes
    assert per_sample["NVIDIA H200"] - per_sample["NVIDIA GeForce RTX 2080 Ti"] == 3 * 6430 * 5980


def test_the_loaders_batches_are_counted_in_the_dtype_they_reach_the_device_in():
    """fp16 images take half the float32 bytes; DALI without a bfloat16 type (1.34) yields float32 under bf16."""
    from nvidia.dali import types

    per_sample = {}
    for kind in ("dali", "torch"):
        choice = choose_loader(kind, has_cuda=True, has_dali=True, gpu_decode=True)
        for dtype in ("float32", "float16", "bfloat16"):
            spec = LoaderSpec("t.rec", "t.idx", 0, 224, device="cuda:0", workers=4, dtype=dtype)
            per_sample[kind, dtype] = batchplan.loader_reservation(choice, spec).per_sample_bytes
    for kind in ("dali", "torch"):
        assert per_sample[kind, "float16"] * 2 == per_sample[kind, "float32"], kind
    assert per_sample["torch", "bfloat16"] == per_sample["torch", "float16"]
    dali_bf16 = "float16" if hasattr(types, "BFLOAT16") else "float32"  # float16: the same size as bfloat16
    assert per_sample["dali", "bfloat16"] == per_sample["dali", dali_bf16]


def test_decoder_padding_is_counted_per_decode_thread():
    one, four = dali_held(workers=1)[0], dali_held(workers=4)[0]
    assert four.fixed_bytes == 4 * one.fixed_bytes == 4 * DaliOptions.defaults().device_memory_padding
    cpu_spec = LoaderSpec("t.rec", "t.idx", 0, 224, device="cpu")
    assert batchplan.loader_reservation(choose_loader("dali", False, True), cpu_spec) is None, "nothing on a CPU run"


def test_budget_is_the_free_memory_plus_what_torch_already_caches(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: GB // 4)  # the model, already on the card
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    b = budget(dali_held())
    assert b.available_bytes == FREE + GB // 4
    assert b.held_bytes(0) == 2 * 8 * DaliOptions.defaults().device_memory_padding
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5, raising=False)
    assert budget(()).available_bytes == CARD // 2, "a per-process cap bounds the budget"


def test_preflight_runs_the_search_with_cudnn_autotune_off_and_restores_it(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    seen = []

    def try_step(batch):
        seen.append(torch.backends.cudnn.benchmark)
        return FakeAllocator(96)(batch)

    assert batchplan.preflight(try_step, 128, auto=True, gpu=GPU, world_size=2)[0] == 96
    assert seen and not any(seen), "cuDNN's autotuner must be off during the trials"
    assert torch.backends.cudnn.benchmark is True, "and on again afterwards"


def test_trainer_preflight_on_a_fake_gpu_counts_the_configured_decoder(monkeypatch):
    """plan_batch's wiring: the train block's loader settings (DALI, 8 decode threads, 224 px) become
    the held memory, free memory comes from mem_get_info, and the report says why auto went lower."""
    from rectrain.distributed import Dist
    from rectrain.train.run import make_model

    cfg = train_settings({"batch_size": "auto", "global_batch": 256, "workers": 8, "image_size": 224})
    monkeypatch.setattr(batchplan.GpuInfo, "of", classmethod(lambda cls, device: GPU))
    monkeypatch.setattr(batchplan, "cuda_step_bytes", lambda trial: step_bytes)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake_mem_get_info)
    model, loss_fn, _ = make_model(cfg.network, 5, torch.device("cpu"))
    d = Dist(0, 1, 0, 1, torch.device("cuda", 0))
    plan = plan_batch_of(cfg, d, rank_parts(cfg, model, loss_fn, d))
    report = plan.preflight
    assert (plan.batch, plan.grad_accum, plan.global_batch) == (128, 2, 256)
    assert report["auto"] and report["global_batch"] == 256 and report["batch"] == 128 and report["grad_accum"] == 2
    assert "per decode thread x 8 threads" in report["why_lower"]
    # 8 threads x 201 MB padding + (2 prefetched + 1 in use) x 128 float32 images of 224 px, per loader
    per_loader = (8 * DaliOptions.defaults().device_memory_padding + 3 * 128 * 3 * 224 * 224 * 4) / 2**20
    assert report["held"] == {
        "held by the training loader's DALI mixed decoder": pytest.approx(per_loader, abs=0.1),
        "held by the validation loader's DALI mixed decoder": pytest.approx(per_loader, abs=0.1),
    }
    assert report["need_mb"] == pytest.approx(step_bytes(128) / 2**20 + 2 * per_loader, abs=0.5)


# --- the failure line of a run: a CUDA error during training names the planned batch and the fix ----


@pytest.fixture
def in_process_run(monkeypatch, tmp_path):
    """What a rank's `main` needs to run in this process (launched as rank 0 of 1), with the logging
    and thread settings it changes put back afterwards; returns the CLI's data arguments."""
    import logging

    from helpers.train_data import packed_dataset

    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(var, value)
    saved = {
        n: (lg.handlers[:], lg.level, lg.propagate) for n in ("rectrain", "__main__") for lg in [logging.getLogger(n)]
    }
    threads = torch.get_num_threads()
    # 64 images: a global batch of 16 gives 4 steps per epoch, so batch_size auto is not capped to the data
    yield [*packed_dataset(tmp_path / "data", n_train=64, n_val=5), "--out", str(tmp_path / "t"), "--threads", "1"]
    torch.set_num_threads(threads)
    for name, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate


def as_if_on_an_11gb_card_near_full(monkeypatch):
    """From now on the failure handler sees GPU 0, a 2080 Ti with 10.9 of its 11 GB reserved."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(batchplan.GpuInfo, "of", classmethod(lambda cls, device: GPU))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 10900 * 2**20)


ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


def test_a_cuda_error_in_training_with_batch_size_auto_names_the_planned_batch_and_the_fix(
    in_process_run, monkeypatch, capfd
):
    """The reference box's `batch_size: auto`: an OOM that surfaces as an illegal memory access in the
    first training step is explained with the batch the plan chose (16 = global_batch 16 / 1 process)
    and a fix that keeps the global batch - not with batch 0 (a ZeroDivisionError in the handler)."""
    from helpers.train_data import config_json

    from rectrain.train import direct
    from rectrain.train import step as step_module

    def failing_step(*args, **kwargs):
        as_if_on_an_11gb_card_near_full(monkeypatch)
        raise RuntimeError(ILLEGAL_ACCESS)

    monkeypatch.setattr(step_module, "train_step", failing_step)
    cfg = config_json(devices="auto", batch_size="auto", global_batch=16, epochs=1, calibration_steps=0)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        direct.main(["--config-json", cfg, *in_process_run])
    err = capfd.readouterr().err
    line = next((text for text in err.splitlines() if "rank 0 failed:" in text), "")
    assert f"rank 0 failed: RuntimeError: {ILLEGAL_ACCESS}" in line, err[-3000:]
    hint = err[err.index(line) :]
    assert "at batch 16 per device" in hint and "most likely out of memory" in hint, hint[:2000]
    # 16 x 0.85 x 11264 / 10900 -> 14 fits: 2 x 8 keeps the global batch of 16
    assert "train.batch_size: 8 and train.grad_accum: 2" in hint and "global batch of 16" in hint, hint[:2000]


def test_a_cuda_error_before_the_batch_is_planned_is_reported_without_a_second_error(
    in_process_run, monkeypatch, capfd
):
    from helpers.train_data import config_json

    from rectrain import model as models
    from rectrain.train import direct

    def failing_build(*args, **kwargs):
        as_if_on_an_11gb_card_near_full(monkeypatch)
        raise RuntimeError(ILLEGAL_ACCESS)

    monkeypatch.setattr(models, "construct", failing_build)
    cfg = config_json(devices="auto", batch_size="auto", epochs=1, calibration_steps=0)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        direct.main(["--config-json", cfg, *in_process_run])
    assert f"rank 0 failed: RuntimeError: {ILLEGAL_ACCESS}" in capfd.readouterr().err
