"""torch's CPU bf16 convolution backward on a 1 x 1 map: the minimal case behind "bf16 on CPU turned 2 of
5 short runs to NaN" (issue 46 item 8; bench/RESULTS.md, "bf16 on the CPU").  No rectrain code.

    MALLOC_PERTURB_=165 .venv/bin/python bench/bf16_cpu_conv.py

A ResNet's layer4 starts with a 3x3 stride-2 convolution; at a 16 px input its feature map is 1 x 1
there.  Its weight gradient under CPU bf16 autocast is computed from uninitialised memory: values up to
1e38, inf or NaN, different at each call (glibc's MALLOC_PERTURB_ fills freed memory with a pattern,
which makes the read show every time); the same convolution in fp32, or over a 2 x 2 map, is right.
Prints, per case, the largest error of the bf16 weight gradient relative to the fp32 one over a few
calls.  A benchmark-style repro, not a test (tests/test_bf16_cpu.py runs it).
"""

from __future__ import annotations

import torch

CASES = [(1, 3, 2, 1), (1, 3, 1, 1), (1, 1, 2, 0), (2, 3, 2, 1), (3, 3, 2, 1)]  # (map side, kernel, stride, padding)


def relative_error(side: int, kernel: int, stride: int, padding: int, calls: int = 4) -> float:
    """The worst |bf16 - fp32| / max |fp32| of the weight gradient over `calls` calls (inf if not finite)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(256, 512, kernel, stride=stride, padding=padding, bias=False)
    x = torch.randn(32, 256, side, side, requires_grad=True)
    grad = torch.randn_like(conv(x))
    conv(x).backward(grad)
    fp32, worst = conv.weight.grad.clone(), 0.0
    for _ in range(calls):
        conv.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = conv(x)
        out.backward(grad.to(out.dtype))
        got = conv.weight.grad
        err = (got - fp32).abs().max().item() if torch.isfinite(got).all() else float("inf")
        worst = max(worst, err / fp32.abs().max().item())
    return worst


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 256 -> 512 channels, batch 32, CPU bf16 autocast against fp32:")
    for side, kernel, stride, padding in CASES:
        err = relative_error(side, kernel, stride, padding)
        verdict = "WRONG (uninitialised memory)" if err > 0.05 else "right (bf16 rounding)"
        print(
            f"  {side}x{side} map, {kernel}x{kernel} stride {stride} padding {padding}: relative error {err:.3g}: {verdict}"
        )


if __name__ == "__main__":
    main()
