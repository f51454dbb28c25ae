"""Fused vs foreach SGD on this machine's CPU: seconds per optimizer.step() over a torchvision model's
parameters (nesterov momentum, the weight-decay groups of timm's rule that rectrain.train.optim uses).

    .venv/bin/python bench/optim_bench.py [--model resnet50] [--steps 20]

A CPU measures only the optimizer's own arithmetic; on a GPU the fused kernel's gain is fewer kernel
launches and, under fp16, no host sync for the GradScaler's found-inf flag - neither shows here.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from rectrain import model as models  # noqa: E402


def step_seconds(name: str, fused: bool, steps: int) -> float:
    net = models.build(name, 1000)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    from timm.optim import param_groups_weight_decay

    opt = torch.optim.SGD(param_groups_weight_decay(net, 1e-4), lr=0.1, momentum=0.9, nesterov=True, fused=fused)
    opt.step()  # momentum buffers allocated
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    for fused in (False, True, False, True):  # alternated: a noisy shared machine affects both
        print(f"{args.model} fused={fused}: {1e3 * step_seconds(args.model, fused, args.steps):.1f} ms/step")


if __name__ == "__main__":
    main()
