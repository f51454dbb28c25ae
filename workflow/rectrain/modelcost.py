"""A network's size and compute, the first two columns of a backbone paper: parameters and FLOPs.

Counted by torch itself: the parameters from the module, the FLOPs of one forward pass of one image at
the test resolution with torch.utils.flop_counter.FlopCounterMode (convolutions, matmuls, attention).
It counts 2 FLOPs per multiply-add, so a paper's "GMACs" or "GFLOPs" for a ResNet (4.1 G for
resnet50 at 224 px, a multiply-add count) is half its `flops`: both are given, and every page says
which it shows.  Batch norm, activations and pooling are not counted (as in the papers).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

# What the report and the comparison page say of the unit.
UNIT = "GFLOPs: 2 per multiply-add (torch.utils.flop_counter); GMACs: multiply-adds (the papers' usual count)"


def params(model: torch.nn.Module) -> int:
    """Every parameter's element count (trainable or not; a shared one once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def forward_flops(model: torch.nn.Module, image_size: int, channels: int = 3) -> int:
    """FLOPs of one forward pass of one image of image_size x image_size, in eval mode, on the CPU."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        x = torch.zeros(1, channels, image_size, image_size, device=device)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
        return int(counter.get_total_flops())
    finally:
        model.train(was_training)


def cost(model: torch.nn.Module, image_size: int) -> dict:
    """{params, params_m, flops, gflops, gmacs, image_size, unit}: what weights.json and the pages show."""
    n, f = params(model), forward_flops(model, image_size)
    return {
        "params": n,
        "params_m": round(n / 1e6, 2),
        "flops": f,
        "gflops": round(f / 1e9, 3),
        "gmacs": round(f / 2e9, 3),
        "image_size": image_size,
        "unit": UNIT,
    }
