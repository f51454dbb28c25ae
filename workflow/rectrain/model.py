"""The network and its numerics, shared by training, evaluation, the memory preflight and the benches:
one model factory and one autocast context, so every pass computes the same way."""

from __future__ import annotations

import contextlib

import torch
import torchvision

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def build(name: str, num_classes: int, channels_last: bool = False) -> torch.nn.Module:
    """A torchvision architecture by registry name (train.model), randomly initialised."""
    try:
        model = torchvision.models.get_model(name, num_classes=num_classes)
    except ValueError as err:
        raise ValueError(f"model {name!r} is not a torchvision model ({err}); fix train.model") from None
    return model.to(memory_format=torch.channels_last) if channels_last else model


def amp_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of train.precision (None for fp32)."""
    return AMP_DTYPES[precision]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision as train.precision asks, on the device's own autocast (CPU bf16 included)."""
    dtype = amp_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
