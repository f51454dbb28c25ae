"""A failing rank's line in the log: which rank, the error and, for a CUDA error with the card near full (often
an out-of-memory surfacing as `an illegal memory access`), the batch and the config change that fits."""

from __future__ import annotations

import logging
import os

import torch

from rectrain.train import batchplan
from rectrain.train.batchplan import NEAR_LIMIT, BatchPlan, GpuInfo, fix_hint, is_oom

log = logging.getLogger(__name__)


def explain(exc: BaseException, batch, devices, plan: BatchPlan | None) -> str:
    """`plan`: the run's, None when the failure came before it; then a numeric train.batch_size (of the
    train block's `batch` part) is the batch (no preflight decides it), and batch_size auto has none to
    name.  `devices`: train.devices ('cpu': no CUDA error to explain)."""
    line = f"rank {os.environ.get('RANK', '?')} failed: {type(exc).__name__}: {exc}"
    hint = None
    try:
        on_gpu = torch.cuda.is_available() and devices != "cpu"
        if plan is None and batch.batch_size != "auto":
            plan = batchplan.plan(batch, int(os.environ.get("WORLD_SIZE", 1)))
        # setup() chose the rank's GPU (ranks may share one); before it ran, this is GPU 0.
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        hint = explain_cuda_error(exc, device, plan) if plan is not None else None
    except Exception:  # noqa: BLE001 - a second error here would replace the first in the log
        log.debug("no explanation for the failure", exc_info=True)
    return line + (f"\n{hint}" if hint else "")


def explain_cuda_error(exc: BaseException, device: torch.device, plan: BatchPlan) -> str | None:
    """A hint for a CUDA error raised when memory was near the card's limit (usually an OOM in disguise: on an
    11 GB 2080 Ti, batch 128 of ResNet-50 surfaced as 'illegal memory access'), else None."""
    if device.type != "cuda" or not isinstance(exc, RuntimeError) or "cuda" not in str(exc).lower():
        return None
    try:
        gpu = GpuInfo.of(device)
        peak_mb = torch.cuda.max_memory_reserved(device) / 2**20
    except Exception:  # noqa: BLE001 - the context may be unusable after a sticky CUDA error
        return None
    if not is_oom(exc) and peak_mb < NEAR_LIMIT * gpu.total_mb:
        return None
    batch = plan.batch
    fits = max(1, int(batch * NEAR_LIMIT * gpu.total_mb / max(peak_mb, 1)))
    return (
        f"this CUDA error happened with {peak_mb / 1024:.1f} of {gpu.total_mb / 1024:.1f} GB reserved on "
        f"{gpu.label()} at batch {batch} per device ({plan.reason}): most likely out of memory. "
        + fix_hint(batch, fits, plan.world_size, plan.grad_accum, plan.auto)
    )
