"""OOM preflight: the batch search and the message, driven by a fake allocator that fails above a size."""

import pytest
import torch

from rectrain.train import memory

GPU = memory.GpuInfo(0, "NVIDIA GeForce RTX 2080 Ti", 11264.0)


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
    assert memory.largest_fitting_batch(fake, failed) == min(limit, failed - 1)
    assert len(fake.tries) <= failed.bit_length() + 1, "binary search, not a linear scan"


def test_search_propagates_errors_that_are_not_oom():
    def broken(batch):
        raise RuntimeError("cuDNN error: CUDNN_STATUS_MAPPING_ERROR")

    with pytest.raises(RuntimeError, match="MAPPING"):
        memory.largest_fitting_batch(broken, 64)


def test_failing_batch_message_names_gpu_memory_batch_fit_and_both_fixes():
    with pytest.raises(memory.BatchDoesNotFit) as err:
        memory.check_batch(FakeAllocator(96), 128, GPU, world_size=2)
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
    with pytest.raises(memory.BatchDoesNotFit, match="largest batch that fits is 50"):
        memory.check_batch(fake, 64, GPU, world_size=1)


def test_fitting_batch_passes_after_one_try():
    fake = FakeAllocator(256)
    assert memory.check_batch(fake, 128, GPU, world_size=2)["fits"] is True
    assert fake.tries == [128]


def test_nothing_fits_says_so_with_other_fixes():
    with pytest.raises(memory.BatchDoesNotFit, match="no batch fits.*not even batch 1"):
        memory.check_batch(FakeAllocator(0), 32, GPU, world_size=1)


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
    batch, accum = memory.auto_batch(FakeAllocator(limit), global_batch, world)
    assert (batch, accum) == expect
    assert batch <= limit and batch * accum * world >= global_batch


def test_headroom_exceeded_is_treated_as_oom():
    assert memory.is_oom(memory.HeadroomExceeded("batch 64 peaks at 10500 MB"))


def test_cuda_error_hint_is_none_on_cpu():
    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert memory.explain_cuda_error(err, torch.device("cpu"), 128, 2) is None


def test_illegal_memory_access_near_the_limit_gets_the_oom_hint(monkeypatch):
    """The seed user's error: explained as OOM when reserved memory was near the card's size."""
    monkeypatch.setattr(memory.GpuInfo, "of", classmethod(lambda cls, device: GPU))
    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 10900 * 2**20)
    hint = memory.explain_cuda_error(err, torch.device("cuda", 0), 128, 2)
    assert hint and "most likely out of memory" in hint and "GPU 0" in hint and "train.grad_accum" in hint
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 3000 * 2**20)
    assert memory.explain_cuda_error(err, torch.device("cuda", 0), 128, 2) is None, "far from the limit: no guess"
