"""Processes for training and evaluation: how many, the torchrun command that starts them, and the
process group each one joins.

One home for the mechanism the train rule, the trainer started without a launcher (an IDE's Run
button) and a multi-GPU evaluation all use: `plan_processes` decides the ranks from the train block,
`torchrun_command` builds the command and its environment, `setup` is what every rank does first.
torchrun - not us - sets RANK / LOCAL_RANK / WORLD_SIZE, watches the ranks and names a failing one.
"""

from __future__ import annotations

import datetime
import glob
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

# torch is imported by the functions a rank calls, not here: the train rule's launcher imports this
# module for its plan and command only, and importing torch cost it ~2-3 s of CPU per training start.
if TYPE_CHECKING:
    import torch

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# torchrun's default rendezvous port; multi-node jobs derive theirs from it (rectrain.train.cluster).
TORCHRUN_PORT = 29500
# How long the elastic agent waits for the other ranks to exit after one failed.  Bounded so a
# crashed rank ends the whole job promptly instead of leaving its peers blocked in a collective.
MONITOR_INTERVAL_S = 0.5


@dataclass(frozen=True)
class ProcessPlan:
    nproc: int  # processes per node
    kind: str  # "gpu" or "cpu"
    cuda_visible_devices: str | None
    reason: str  # said in the log so the user sees why this many


TORCHRUN = "rectrain._torchrun"  # torch.distributed.run without its traceback on a stop signal


# Where a GPU is usable its driver shows a device node: NVIDIA's, WSL2's GPU paravirtualisation, ROCm's.
GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")


def visible_gpu_count() -> int:
    """GPUs this process may use (honours CUDA_VISIBLE_DEVICES); 0 without CUDA.  Without any GPU
    device node the answer is 0 without importing torch."""
    if not any(glob.glob(pattern) for pattern in GPU_DEVICE_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_processes(devices, cpu_processes: int, gpu_count: int) -> ProcessPlan:
    """Ranks per node for train.devices and train.cpu_processes: one per GPU, or cpu_processes without GPUs."""
    cpu_n = int(cpu_processes)
    if devices == "cpu":
        return ProcessPlan(cpu_n, "cpu", "", f"train.devices is 'cpu': {cpu_n} CPU processes (train.cpu_processes)")
    if devices == "auto":
        if gpu_count > 0:
            return ProcessPlan(gpu_count, "gpu", None, f"train.devices is 'auto': {gpu_count} visible GPU(s)")
        why = f"train.devices is 'auto' and no GPU is visible: {cpu_n} CPU processes (train.cpu_processes)"
        return ProcessPlan(cpu_n, "cpu", None, why)
    if isinstance(devices, list) and devices:
        ids = [int(d) for d in devices]
        if gpu_count and max(ids) >= gpu_count:
            raise ValueError(
                f"train.devices asks for GPU ids {ids} but only {gpu_count} GPU(s) are visible "
                f"(ids 0..{gpu_count - 1}); fix train.devices in the config"
            )
        if gpu_count == 0:
            raise ValueError(
                f"train.devices asks for GPU ids {ids} but no GPU is visible; "
                "set train.devices: cpu (or auto) to train on CPU processes"
            )
        unique = list(dict.fromkeys(ids))
        why = f"train.devices lists GPU ids {ids}"
        if len(unique) < len(ids):
            why += " (a GPU listed more than once is shared by that many ranks, which then talk over gloo: NCCL needs one GPU per rank)"
        return ProcessPlan(len(ids), "gpu", ",".join(map(str, unique)), why)
    raise ValueError(f"train.devices must be 'auto', 'cpu' or a list of GPU ids, got {devices!r}")


def torchrun_args(plan: ProcessPlan, nodes: int = 1, rdzv_endpoint: str | None = None, run_id: str = "rectrain"):
    """torchrun's own options (everything before the module it runs)."""
    args = [f"--nproc_per_node={plan.nproc}", "--max_restarts=0", f"--monitor_interval={MONITOR_INTERVAL_S}"]
    if nodes <= 1:
        return ["--standalone", *args]
    if not rdzv_endpoint:
        raise ValueError(
            f"train.nodes is {nodes}: multi-node training needs a rendezvous endpoint host:port "
            "(pass --rdzv-endpoint or set RECTRAIN_RDZV_ENDPOINT to the head node's address)"
        )
    if ":" not in rdzv_endpoint:
        rdzv_endpoint = f"{rdzv_endpoint}:{TORCHRUN_PORT}"
    return [
        f"--nnodes={nodes}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={rdzv_endpoint}",
        f"--rdzv_id={run_id}",
        *args,
    ]


def torchrun_command(
    plan: ProcessPlan,
    module: str,
    module_argv: list[str],
    *,
    nodes: int = 1,
    rdzv_endpoint: str | None = None,
    run_id: str = "rectrain",
    python: str = sys.executable,
    base_env: dict | None = None,
) -> tuple[list[str], dict]:
    """(argv, env) that run `python -m <module> <module_argv>` under torchrun (as rectrain._torchrun,
    which ends it in one line on a stop signal).  Pure: starts nothing."""
    argv = [python, "-m", TORCHRUN, *torchrun_args(plan, nodes, rdzv_endpoint, run_id)]
    env = dict(os.environ if base_env is None else base_env)
    if plan.cuda_visible_devices is not None:  # "" for devices: cpu hides the GPUs from NVML too
        env["CUDA_VISIBLE_DEVICES"] = plan.cuda_visible_devices
    # Each rank sets its own thread count from the CPU budget; keep torchrun from warning about it.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return [*argv, "-m", module, *module_argv], env


def launched() -> bool:
    """True when a launcher set RANK, WORLD_SIZE and LOCAL_RANK."""
    return all(v in os.environ for v in LAUNCH_VARS)


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str = "none (one process)"

    @property
    def master(self) -> bool:
        return self.rank == 0


def rank_device(local_rank: int, local_world: int, gpu_count: int) -> tuple[int, bool]:
    """(GPU index, shared) for a local rank: its own GPU = LOCAL_RANK (never the global rank); with
    more local ranks than visible GPUs (a GPU listed twice in train.devices) they share, round-robin."""
    if local_world <= gpu_count:
        return local_rank, False
    return local_rank % gpu_count, True


def setup(use_gpu: bool, timeout_s: float) -> Dist:
    """What every rank does first (nanoGPT-style): its device, NCCL on GPUs (gloo on CPU, or when ranks
    share a GPU, which NCCL refuses), and a collective timeout so a lost peer ends the job instead of
    hanging it."""
    import torch
    import torch.distributed as dist

    # Without a launcher (evaluation on one device, a test): rank 0 of 1.
    rank, world, local = (int(os.environ.get(v, d)) for v, d in zip(LAUNCH_VARS, (0, 1, 0), strict=True))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_gpu = use_gpu and torch.cuda.is_available()
    shared = False
    if use_gpu:
        index, shared = rank_device(local, local_world, torch.cuda.device_count())
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        nccl = use_gpu and not shared
        dist.init_process_group(
            "nccl" if nccl else "gloo",
            timeout=datetime.timedelta(seconds=float(timeout_s)),
            **({"device_id": device} if nccl else {}),
        )
    backend = dist.get_backend() if world > 1 else Dist.backend
    return Dist(rank, world, local, local_world, device, backend)


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    if d.world_size > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_gather(obj, d: Dist) -> list:
    if d.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(d: Dist) -> None:
    if d.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
