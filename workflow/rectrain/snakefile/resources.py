"""What the train and evaluate rules book: GPUs on this machine and, under SLURM, nodes, GPUs and CPUs
per node.

Read by the Snakefile while it parses and by profiles/slurm's resource expressions, so this module
imports neither torch nor the training code (a dry-run stays fast).  The cluster's shape is set in
the environment (RECTRAIN_GPUS_PER_NODE, RECTRAIN_CPUS_PER_GPU), not in files.
"""

from __future__ import annotations

import ctypes
import os


class ResourceError(ValueError):
    """A resource setting in the environment that cannot be booked; the message names the variable."""


def scheduled_gpus(devices) -> int:
    """GPUs the train job will hold, for the rule's `resources: gpus`.  Uses NVML, not torch, so the
    Snakefile parses fast; torchrun's process count is still decided by plan_processes at run time."""
    if isinstance(devices, list):
        return len(set(devices))  # a GPU listed twice is shared by two ranks, still one GPU
    if devices == "cpu" or not nvml_loads():
        return 0
    from rectrain.train.telemetry import gpu_inventory

    return len(gpu_inventory())


def run_slots(devices) -> int:
    """The train rule's `gpu` resource: the GPUs the run takes (scheduled_gpus), and 1 for a run on CPU
    processes, so `--resources gpu=N` caps the runs training at once on any machine: on a 2-GPU box,
    gpu=2 runs two 1-GPU runs side by side, or one 2-GPU run (docs/runs.md)."""
    return max(1, scheduled_gpus(devices))


def train_threads(snakemake_resources, devices) -> int:
    """The train job's threads: every core given with --cores, or, when --resources gpu=N shares them
    between runs, the run's part of them (run_slots / N): two 1-GPU runs under gpu=2 take half each,
    (snakemake_resources: Snakemake's resource settings, its --cores and --resources),
    so Snakemake starts both.  Read when the job is expanded (commands that run no job need no --cores)."""
    cores = snakemake_resources.cores or os.cpu_count() or 1
    total = (snakemake_resources.resources or {}).get("gpu")
    total = getattr(total, "value", total)  # Snakemake 9 keeps a Resource; a plain number in tests
    if not isinstance(total, int) or total <= 0 or total >= 1 << 30:  # not given (or Snakemake's "unlimited")
        return cores
    return max(1, cores * min(run_slots(devices), total) // total)


def nvml_loads() -> bool:
    """Whether the driver's NVML library loads (what pynvml tries first on Linux).  Without it there is
    no GPU to count, and every dry-run on a machine without a driver skips pynvml's 0.15 s import."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def train_rule_resources(nodes: int) -> dict:
    """Resources the train rule declares so the SLURM executor books `nodes` nodes.

    With more than one node the rule is marked as an `mpi`-style job: the SLURM executor then runs
    the rule's command directly in the batch script (not inside a one-task srun step, which would
    leave no room for the per-node srun above), with one task per node.  `tasks_per_gpu: 0` keeps it
    from turning the task count into --ntasks-per-gpu when GPUs are requested through `gres`.
    Local runs ignore all of these.
    """
    if nodes <= 1:
        return {"nodes": 1}
    return {"nodes": nodes, "tasks": nodes, "mpi": "srun", "tasks_per_gpu": 0}


# --- job sizes for profiles/slurm (its resource expressions call these) ---------------------------

GPUS_ENV = "RECTRAIN_GPUS_PER_NODE"
CPUS_PER_GPU_ENV = "RECTRAIN_CPUS_PER_GPU"
DEFAULT_CPUS_PER_GPU = 8  # DALI decode threads plus the rank itself


def _count(env, name: str, default: int) -> int:
    raw = str(env.get(name, default)).strip()
    if not raw.isdigit():
        raise ResourceError(f"{name}={raw!r}: expected a whole number (0 for none)")
    return int(raw)


def gpus_per_node(env=None) -> int:
    """RECTRAIN_GPUS_PER_NODE (default 1): the GPUs each train/evaluate node books."""
    return _count(os.environ if env is None else env, GPUS_ENV, 1)


def gpu_gres(env=None) -> str:
    """The slurm profile's GPU request for train/evaluate: 'gpu:<RECTRAIN_GPUS_PER_NODE>' per node
    (default 1), or '' for 0 so CPU-only clusters request no GPU."""
    gpus = gpus_per_node(env)
    return f"gpu:{gpus}" if gpus else ""


def cpus_per_node(env=None) -> int:
    """CPUs the train/evaluate job books per node: RECTRAIN_CPUS_PER_GPU (default 8) per GPU.

    Booked as cpus_per_task rather than cpus_per_gpu because the SLURM job step that runs the rule
    is sized by cpus_per_task; with cpus_per_gpu the ranks would be confined to the rule's threads.
    0 (no GPUs) leaves the count to the rule's `threads`.
    """
    env = os.environ if env is None else env
    return gpus_per_node(env) * _count(env, CPUS_PER_GPU_ENV, DEFAULT_CPUS_PER_GPU)
