"""Start training through torchrun with the process count the `train` block asks for.

The train rule runs `python -m rectrain.train.launch --config-json ... <train args>`; this module works out
how many processes to start (one per GPU, or `cpu_processes` CPU processes), builds the torchrun
command and execs it, so torchrun - not us - sets RANK / LOCAL_RANK / WORLD_SIZE, watches the ranks,
and names the failing rank if one dies.  `torchrun_command` is pure so it can be unit-tested.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass

from rectrain.train import cluster
from rectrain.train import local_copy as stage

DEFAULT_PORT = 29500
# How long the elastic agent waits for the other ranks to exit after one failed.  Bounded so a
# crashed rank ends the whole job promptly instead of leaving its peers blocked in a collective.
MONITOR_INTERVAL_S = 0.5


@dataclass(frozen=True)
class ProcessPlan:
    nproc: int  # processes per node
    kind: str  # "gpu" or "cpu"
    cuda_visible_devices: str | None
    reason: str  # said in the log so the user sees why this many


def visible_gpu_count() -> int:
    """GPUs this process may use (honours CUDA_VISIBLE_DEVICES); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def scheduled_gpus(devices) -> int:
    """GPUs the train job will hold, for the rule's `resources: gpus`.  Uses NVML, not torch, so the
    Snakefile parses fast; torchrun's process count is still decided by plan_processes at run time."""
    if isinstance(devices, list):
        return len(devices)
    if devices == "cpu":
        return 0
    from rectrain.train.telemetry import gpu_inventory

    return len(gpu_inventory())


def plan_processes(train_cfg: dict, gpu_count: int) -> ProcessPlan:
    devices = train_cfg.get("devices", "auto")
    cpu_n = int(train_cfg.get("cpu_processes", 2))
    if devices == "cpu":
        return ProcessPlan(cpu_n, "cpu", "", f"train.devices is 'cpu': {cpu_n} CPU processes (train.cpu_processes)")
    if devices == "auto":
        if gpu_count > 0:
            return ProcessPlan(gpu_count, "gpu", None, f"train.devices is 'auto': {gpu_count} visible GPU(s)")
        return ProcessPlan(
            cpu_n,
            "cpu",
            None,
            f"train.devices is 'auto' and no GPU is visible: {cpu_n} CPU processes (train.cpu_processes)",
        )
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
        return ProcessPlan(len(ids), "gpu", ",".join(map(str, ids)), f"train.devices lists GPU ids {ids}")
    raise ValueError(f"train.devices must be 'auto', 'cpu' or a list of GPU ids, got {devices!r}")


def torchrun_args(
    plan: ProcessPlan, nodes: int = 1, rdzv_endpoint: str | None = None, run_id: str = "rectrain"
) -> list[str]:
    """torchrun's own options (everything before the training module)."""
    args = [f"--nproc_per_node={plan.nproc}", "--max_restarts=0", f"--monitor_interval={MONITOR_INTERVAL_S}"]
    if nodes <= 1:
        return ["--standalone", *args]
    if not rdzv_endpoint:
        raise ValueError(
            f"train.nodes is {nodes}: multi-node training needs a rendezvous endpoint host:port "
            "(pass --rdzv-endpoint or set RECTRAIN_RDZV_ENDPOINT to the head node's address)"
        )
    if ":" not in rdzv_endpoint:
        rdzv_endpoint = f"{rdzv_endpoint}:{DEFAULT_PORT}"
    return [
        f"--nnodes={nodes}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={rdzv_endpoint}",
        f"--rdzv_id={run_id}",
        *args,
    ]


def torchrun_command(
    train_cfg: dict,
    train_argv: list[str],
    gpu_count: int,
    *,
    python: str = sys.executable,
    rdzv_endpoint: str | None = None,
    run_id: str = "rectrain",
    base_env: dict | None = None,
) -> tuple[list[str], dict, ProcessPlan]:
    """(argv, env, plan) that run `rectrain.train` under torchrun.  Pure: no process is started."""
    plan = plan_processes(train_cfg, gpu_count)
    nodes = int(train_cfg.get("nodes", 1))
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        *torchrun_args(plan, nodes, rdzv_endpoint, run_id),
        "-m",
        "rectrain.train",
        *train_argv,
    ]
    env = dict(os.environ if base_env is None else base_env)
    if plan.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.cuda_visible_devices
    # Each rank sets its own thread count from the CPU budget; keep torchrun from warning about it.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return argv, env, plan


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, add_help=False)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--rdzv-endpoint", default=os.environ.get("RECTRAIN_RDZV_ENDPOINT"))
    ap.add_argument("--print-only", action="store_true", help="print the torchrun command, start nothing")
    ap.add_argument(
        "--stage-to-local",
        metavar="DIR",
        help="copy the .rec/.idx pairs to node-local DIR first ('auto': $TMPDIR); pack.stage_to_local",
    )
    own, _ = ap.parse_known_args(argv)
    train_argv = [a for a in argv if a != "--print-only"]
    train_argv = _drop_option(_drop_option(train_argv, "--rdzv-endpoint"), "--stage-to-local")
    cfg = json.loads(own.config_json)
    # train.nodes > 1 under SLURM: re-run this launcher once per node (srun); each then finds the
    # rendezvous from the allocation.  One node: nothing changes (--standalone).
    env_now = dict(os.environ, **({cluster.ENDPOINT_ENV: own.rdzv_endpoint} if own.rdzv_endpoint else {}))
    try:
        node = cluster.plan_node_launch(int(cfg.get("nodes", 1)), env_now)
    except cluster.ClusterError as err:
        raise SystemExit(f"[launch] error: {err}") from None
    if node.relaunch:
        cmd = [*node.relaunch, sys.executable, "-m", "rectrain.train.launch", *argv]
        print("[launch] one launcher per node: " + shlex.join(cmd), file=sys.stderr, flush=True)
        if not own.print_only:
            os.execvp(cmd[0], cmd)
        return
    if own.stage_to_local:
        train_argv = stage.stage_argv(train_argv, None if own.stage_to_local == "auto" else own.stage_to_local)
    cmd, env, plan = torchrun_command(
        cfg, train_argv, visible_gpu_count(), rdzv_endpoint=own.rdzv_endpoint or node.rdzv_endpoint, run_id=node.run_id
    )
    print(f"[launch] {plan.reason}", file=sys.stderr)
    if plan.cuda_visible_devices:
        print(f"[launch] CUDA_VISIBLE_DEVICES={plan.cuda_visible_devices}", file=sys.stderr)
    print("[launch] " + shlex.join(cmd), file=sys.stderr, flush=True)
    if own.print_only:
        return
    os.execvpe(cmd[0], cmd, env)


def _drop_option(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
