"""The network and its numerics, shared by training, evaluation, the memory preflight and the benches:
one model factory and one autocast context, so every pass computes the same way."""

from __future__ import annotations

import contextlib

import torch
import torchvision

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def build(
    name: str,
    num_classes: int,
    channels_last: bool = False,
    *,
    zero_init_residual: bool = False,
    blurpool: bool = False,
) -> torch.nn.Module:
    """A torchvision architecture by registry name (train.model), randomly initialised.  For the ResNet
    family, zero_init_residual zeroes each residual branch's last BatchNorm weight (torchvision's own
    constructor option), so every block starts as the identity (Goyal et al. 2017); blurpool
    anti-aliases its strided convolutions (add_blurpool)."""
    kwargs = {"num_classes": num_classes}
    if zero_init_residual and is_resnet(name):
        kwargs["zero_init_residual"] = True
    try:
        model = torchvision.models.get_model(name, **kwargs)
    except ValueError as err:
        raise ValueError(f"model {name!r} is not a torchvision model ({err}); fix train.model") from None
    if blurpool:
        add_blurpool(model)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def is_resnet(name: str) -> bool:
    """torchvision's ResNet family (resnet*, resnext*, wide_resnet*): the constructors that take
    zero_init_residual."""
    return name.startswith(("resnet", "resnext", "wide_resnet"))


class BlurPoolConv2d(torch.nn.Module):
    """A strided convolution that first low-pass filters its input with a fixed 3x3 binomial kernel
    ([1, 2, 1] outer [1, 2, 1] / 16, depthwise, stride 1), so the stride no longer aliases (Zhang 2019,
    "Making convolutional networks shift-invariant again"; FFCV applies it to torchvision ResNets).
    The kernel is a non-persistent buffer: the state dict keeps the conv's weights under `conv.`."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        self.conv = conv
        taps = torch.tensor([1.0, 2.0, 1.0])
        kernel = torch.outer(taps, taps) / 16.0
        self.register_buffer("blur", kernel.expand(conv.in_channels, 1, 3, 3).clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blurred = torch.nn.functional.conv2d(x, self.blur.to(x.dtype), padding=1, groups=self.conv.in_channels)
        return self.conv(blurred)


def add_blurpool(model: torch.nn.Module, min_channels: int = 16) -> torch.nn.Module:
    """Wrap every strided Conv2d with at least `min_channels` input channels in BlurPoolConv2d, in place
    (FFCV's rule: the RGB stem, 3 channels, is left alone)."""
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Conv2d) and max(child.stride) > 1 and child.in_channels >= min_channels:
            setattr(model, name, BlurPoolConv2d(child))
        else:
            add_blurpool(child, min_channels)
    return model


def amp_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of train.precision (None for fp32)."""
    return AMP_DTYPES[precision]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision as train.precision asks, on the device's own autocast (CPU bf16 included)."""
    dtype = amp_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
