"""The line a failing rank leaves in the log: which rank, the error, and - for a CUDA error with the
card near full, often an out-of-memory surfacing as `an illegal memory access` - the batch the plan
trains with and the config change that fits (rectrain.train.memory.explain_cuda_error)."""

from __future__ import annotations

import logging
import os

import torch

from rectrain.train import batchplan, memory
from rectrain.train.batchplan import BatchPlan

log = logging.getLogger(__name__)


def explain(exc: BaseException, cfg: dict, plan: BatchPlan | None) -> str:
    """`plan`: the run's, None when the failure came before it; then a numeric train.batch_size is the
    batch (no preflight decides it), and batch_size auto has none to name."""
    line = f"rank {os.environ.get('RANK', '?')} failed: {type(exc).__name__}: {exc}"
    try:
        hint = _hint(exc, cfg, plan)
    except Exception:  # noqa: BLE001 - a second error here would replace the first in the log
        log.debug("no explanation for the failure", exc_info=True)
        hint = None
    return line + (f"\n{hint}" if hint else "")


def _hint(exc: BaseException, cfg: dict, plan: BatchPlan | None) -> str | None:
    if plan is None and cfg["batch_size"] != "auto":
        plan = batchplan.plan(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    if plan is None:
        return None
    on_gpu = torch.cuda.is_available() and cfg["devices"] != "cpu"
    # setup() chose the rank's GPU (ranks may share one); before it ran, this is GPU 0.
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return memory.explain_cuda_error(exc, device, plan)
