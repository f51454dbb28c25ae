"""Where each node's torchrun meets the others: the rendezvous, read from the SLURM allocation.

`train.nodes: 1` runs torchrun with --standalone, as on a workstation.  With `train.nodes: N > 1`
the train rule runs inside an N-node SLURM allocation (the slurm profile gives the job N nodes),
and `python -m rectrain.train` starts in the batch script on the first node.  It then re-runs itself once
per node through `srun --ntasks-per-node=1`; in that per-node task SLURM's variables say which
nodes belong to the step, the first of them hosts torchrun's c10d rendezvous, and the port follows
from the job id so every node computes the same endpoint without talking to the others.

SLURM's own tools do the work: `scontrol show hostnames` expands node lists ('gpu[01-04]'),
`srun` starts the per-node tasks, torchrun does the rest.  Everything here is pure apart from the
injected `run` (scontrol), so the decisions are unit-tested without a cluster.

What the rules book on a cluster (nodes, GPUs, CPUs) is rectrain.snakefile.resources.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from rectrain.distributed import TORCHRUN_PORT

RDZV_PORT_BASE = TORCHRUN_PORT
RDZV_PORT_SPAN = 1000
# Environment a user (or a test) can set to override what SLURM would decide.
ENDPOINT_ENV = "RECTRAIN_RDZV_ENDPOINT"  # host:port, for multi-node runs launched by hand
PORT_ENV = "RECTRAIN_RDZV_PORT"  # a port known to be open between the nodes
# Set by the srun re-launch so the per-node task knows not to re-launch again.
STEP_ENV = "RECTRAIN_SLURM_STEP"
# Node lists, most specific first: the step's nodes are the ones the rendezvous must be on.
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


class ClusterError(RuntimeError):
    """Multi-node training cannot start here; the message says what is missing and how to fix it."""


@dataclass(frozen=True)
class NodeLaunch:
    """What `python -m rectrain.train` (rectrain.train.launch.start) does on this node.

    relaunch: argv prefix (srun ...) to re-run the launcher once per node, or None to start torchrun here.
    rdzv_endpoint: host:port of the c10d rendezvous (None for --standalone).
    run_id: the rendezvous id every node shares.
    """

    relaunch: list[str] | None
    rdzv_endpoint: str | None
    run_id: str


def hostnames(nodelist: str, run=subprocess.run) -> list[str]:
    """Expand a SLURM node list ('gpu[01-02],login1') into host names, in SLURM's order."""
    proc = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    hosts = proc.stdout.split() if proc.returncode == 0 else []
    if not hosts:
        raise ClusterError(
            f"`scontrol show hostnames {nodelist}` failed ({proc.stderr.strip() or 'no output'}); "
            "run this inside a SLURM allocation on a node with the SLURM client installed"
        )
    return hosts


def rendezvous_port(job_id: str, env: dict) -> int:
    """RECTRAIN_RDZV_PORT, else 29500 + job_id % 1000: two jobs sharing a head node rarely collide."""
    if env.get(PORT_ENV):
        return int(env[PORT_ENV])
    digits = "".join(ch for ch in str(job_id).split("_")[0] if ch.isdigit())
    return RDZV_PORT_BASE + (int(digits) % RDZV_PORT_SPAN if digits else 0)


def slurm_endpoint(env: dict, run=subprocess.run) -> str:
    """host:port of the rendezvous for the SLURM step this process runs in."""
    nodelist = next((env[v] for v in NODELIST_VARS if env.get(v)), None)
    if not nodelist or not env.get("SLURM_JOB_ID"):
        raise ClusterError(
            "no SLURM node list in the environment (SLURM_JOB_NODELIST); "
            "the per-node task must run under srun inside the allocation"
        )
    return f"{hostnames(nodelist, run)[0]}:{rendezvous_port(env['SLURM_JOB_ID'], env)}"


def srun_per_node(nodes: int) -> list[str]:
    """srun prefix that runs one launcher per node with all of each node's CPUs and GPUs."""
    return [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        # --whole: the step gets every CPU/GPU the job holds on the node, not srun's 1-CPU default;
        # --kill-on-bad-exit: a node whose torchrun fails ends the others instead of leaving them blocked.
        "--whole",
        "--kill-on-bad-exit=1",
        f"--export=ALL,{STEP_ENV}=1",
    ]


def plan_node_launch(nodes: int, env: dict, run=subprocess.run) -> NodeLaunch:
    """Decide how this node starts training for `train.nodes` = `nodes`."""
    job_id = env.get("SLURM_JOB_ID")
    run_id = f"rectrain-{job_id}" if job_id else "rectrain"
    if nodes <= 1:
        return NodeLaunch(None, None, run_id)
    if env.get(ENDPOINT_ENV):
        return NodeLaunch(None, env[ENDPOINT_ENV], run_id)
    if not job_id:
        raise ClusterError(
            f"train.nodes is {nodes} but this is not a SLURM job: run the pipeline with "
            "`snakemake --executor slurm --workflow-profile profiles/slurm` (it requests the nodes), or "
            f"start python -m rectrain.train on every node yourself with {ENDPOINT_ENV}=<first node>:<port>, "
            "or set train.nodes: 1"
        )
    if env.get(STEP_ENV) != "1":
        return NodeLaunch(srun_per_node(nodes), None, run_id)
    return NodeLaunch(None, slurm_endpoint(env, run), run_id)
