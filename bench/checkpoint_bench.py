"""What a mid-epoch checkpoint and the per-step stop agreement cost (issue 22), on this machine's CPU.

    .venv/bin/python bench/checkpoint_bench.py --out /tmp/ckbench [--models resnet18 resnet50] [--repeats 3]

Per model (1000 classes, SGD with momentum after one step, so the momentum buffers exist as in
training): the bytes of the checkpoint rectrain.train.lifecycle.midepoch writes (model, optimizer, scheduler,
scaler, RNG) and the seconds of `save_atomic` (torch.save to a temporary file, fsync, rename, fsync
of the folder).  Then the stop agreement (rectrain.train.lifecycle.stop.Agreement.poll: an all-reduce MAX of
two int64 on gloo) between two local processes: microseconds per poll.  Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from rectrain import model as models  # noqa: E402
from rectrain.distributed import Dist  # noqa: E402
from rectrain.train.lifecycle import checkpoint as ckpt  # noqa: E402
from rectrain.train.lifecycle.stop import Agreement, StopRequest  # noqa: E402


def state_of(name: str) -> dict:
    net = models.build(name, 1000, False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 64, 64)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return {
        "model": net.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": [ckpt.rng_state(), ckpt.rng_state()],
        "epoch": 0,
        "step": 100,
    }


def save_cost(name: str, out: Path, repeats: int) -> tuple[int, list[float]]:
    state = state_of(name)
    path = out / f"{name}_last.pt"
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ckpt.save_atomic(state, path)
        times.append(time.perf_counter() - t0)
    return path.stat().st_size, times


def _poll_worker(rank: int, polls: int, result) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29631")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    agreement = Agreement(Dist(rank, 2, rank, 2, torch.device("cpu"), "gloo"), StopRequest(), 30)
    for _ in range(50):
        agreement.poll()
    t0 = time.perf_counter()
    for _ in range(polls):
        agreement.poll()
    if rank == 0:
        result.value = (time.perf_counter() - t0) / polls
    dist.destroy_process_group()


def poll_cost(polls: int) -> float:
    result = mp.get_context("spawn").Value("d", 0.0)
    mp.start_processes(_poll_worker, args=(polls, result), nprocs=2, start_method="spawn")
    return result.value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the checkpoints (its disk is measured)")
    ap.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--polls", type=int, default=2000)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    print("| model | checkpoint bytes | save_atomic s (median of %d, min-max) |" % a.repeats)
    print("|---|---:|---:|")
    for name in a.models:
        size, times = save_cost(name, a.out, a.repeats)
        print(
            f"| {name} | {size:,} ({size / 2**20:.1f} MiB) | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) |"
        )
    print(
        f"\nstop agreement (all-reduce MAX of 2 int64, gloo, 2 local processes): {poll_cost(a.polls) * 1e6:.0f} us per poll"
    )


if __name__ == "__main__":
    main()
