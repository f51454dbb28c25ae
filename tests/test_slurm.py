"""The demo pipeline on a real SLURM cluster: `snakemake --workflow-profile profiles/slurm` submits
every rule as a SLURM job and training spans two nodes through srun + torchrun c10d rendezvous.

The cluster is Debian's slurm-wlm started here on localhost: one slurmctld and two slurmd daemons
(two "nodes" on one host, each with its own port).  The test is skipped only when SLURM is not
installed or a daemon cannot start in this environment, and the skip message says exactly why.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO, VENV_BIN

from rectrain.train.cluster import rendezvous_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol")
# The SLURM job step started by Snakemake's executor drops SLURM_CONF from the environment, so the
# cluster must be configured at the default path.  The marker says the file is ours to replace.
CONF = Path("/etc/slurm/slurm.conf")
MARKER = "# rectrain single-host test cluster"
CHAIN = ["demo_data", "index_raw", "pack", "train", "evaluate", "report"]

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def auth_plugin() -> str:
    """auth/none where the packaged SLURM still has it (22.05 does; 23.11 dropped it), else munge."""
    plugin_dirs = [
        Path(p)
        for p in (
            "/usr/lib/x86_64-linux-gnu/slurm-wlm",
            "/usr/lib/aarch64-linux-gnu/slurm-wlm",
            "/usr/lib64/slurm",
            "/usr/lib/slurm",
        )
    ]
    if any((d / "auth_none.so").exists() for d in plugin_dirs):
        return "none"
    return "munge"


def ensure_munge(workdir: Path) -> None:
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return
    if not shutil.which("munged"):
        pytest.skip("this SLURM build needs munge authentication and munged is not installed (apt-get install munge)")
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    proc = subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], capture_output=True, text=True)
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode != 0:
        pytest.skip(f"munged could not start here: {proc.stderr.strip() or proc.stdout.strip()}")


def node_names() -> list[str]:
    """Names of the two slurmd daemons: this host's name (it hosts torchrun's rendezvous, so it must
    resolve) and a second name sorting after it.  ('localhost' cannot be a SLURM node name.)"""
    host = socket.gethostname()
    try:
        socket.gethostbyname(host)
    except OSError:
        pytest.skip(f"this host's name {host!r} does not resolve, so torchrun could not reach the first SLURM node")
    return [host, f"{host}-2"]


def write_conf(workdir: Path, names: list[str], auth: str) -> dict:
    ports = {"ctld": free_port(), **{n: free_port() for n in names}}
    host = socket.gethostname()
    lines = [
        MARKER,
        "ClusterName=rectrain-test",
        f"SlurmctldHost={host}",
        f"SlurmctldPort={ports['ctld']}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"AuthType=auth/{auth}",
        f"CredType=cred/{auth}",
        f"StateSaveLocation={workdir}/state",
        f"SlurmdSpoolDir={workdir}/spool/%n",
        f"SlurmctldPidFile={workdir}/slurmctld.pid",
        f"SlurmdPidFile={workdir}/slurmd-%n.pid",
        f"SlurmctldLogFile={workdir}/slurmctld.log",
        f"SlurmdLogFile={workdir}/slurmd-%n.log",
        # No cgroups, no accounting database: what a container without systemd can run.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "MpiDefault=none",
        "ReturnToService=2",
        # Finished jobs stay visible to squeue (the executor's status command here) for 10 minutes.
        "MinJobAge=600",
        # The profile's per-job CPUs and memory (e.g. 128 GB for train) are booked, not enforced, here.
        "SlurmdParameters=config_overrides",
    ]
    for name in names:
        lines.append(
            f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={ports[name]} "
            "CPUs=32 RealMemory=256000 State=UNKNOWN"
        )
    lines.append(f"PartitionName=test Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES")
    for sub in ("state", "spool"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    CONF.parent.mkdir(parents=True, exist_ok=True)
    CONF.write_text("\n".join(lines) + "\n")
    return ports


def tail(path: Path, n=8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path} not written)"


def start_daemon(argv: list[str], log: Path, daemons: list) -> None:
    """Start a SLURM daemon in the foreground (-D) as our child, so teardown can stop and reap it;
    skip with its own words when it exits at once."""
    console = log.with_suffix(".console")
    with open(console, "w") as out:
        proc = subprocess.Popen([*argv, "-D"], stdout=out, stderr=subprocess.STDOUT)
    daemons.append(proc)
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return  # still running: started
    pytest.skip(f"{' '.join(argv)} cannot start here (exit {proc.returncode}): {tail(console)} {tail(log)}")


def stop_daemons(daemons: list) -> None:
    for proc in reversed(daemons):
        if proc.poll() is None:
            proc.terminate()
    for proc in daemons:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip(f"starting slurmd and writing {CONF} need root")
    if CONF.exists() and MARKER not in CONF.read_text():
        pytest.skip(f"{CONF} already configures a real cluster; the test does not replace it")
    workdir = tmp_path_factory.mktemp("slurm")
    auth = auth_plugin()
    if auth == "munge":
        ensure_munge(workdir)
    names = node_names()
    write_conf(workdir, names, auth)
    daemons = []
    try:
        start_daemon(["slurmctld", "-i"], workdir / "slurmctld.log", daemons)
        for name in names:
            start_daemon(["slurmd", "-N", name], workdir / f"slurmd-{name}.log", daemons)
        deadline = time.monotonic() + 60
        states = ""
        while time.monotonic() < deadline:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True).stdout
            if states.count("idle") == len(names):
                break
            time.sleep(1)
        else:
            pytest.skip(
                f"SLURM nodes did not become idle within 60 s ({states.strip()!r}): "
                f"slurmctld: {tail(workdir / 'slurmctld.log')}; "
                f"slurmd: {tail(workdir / f'slurmd-{names[0]}.log')}"
            )
        yield {"nodes": names, "workdir": workdir}
    finally:
        stop_daemons(daemons)
        if CONF.exists() and MARKER in CONF.read_text():
            CONF.unlink()


# The demo's 3 unreadable planted files are 7.5 % of these 40 train rows: above pack.max_skipped_share's
# real-data default of 1 %.
TEST_CONFIG = """\
demo: {classes: 4, train_per_class: 8, val_per_class: 4}
pack: {threads: 1, stage_to_local: true, max_skipped_share: 0.1}
train: {devices: cpu, cpu_processes: 1, nodes: 2, epochs: 1, image_size: 32, batch_size: 8, workers: 1,
        precision: fp32, sample_interval_s: 0.5}
evaluate: {batch_size: 16, workers: 1}
"""


def copy_repo(dst: Path) -> Path:
    skip = {".git", ".venv", ".venv-mxnet", ".snakemake", "logs", "benchmarks", "__pycache__", ".pytest_cache"}

    def ignore(directory, names):
        ignored = {n for n in names if n in skip or n.endswith(".egg-info")}
        if Path(directory) == REPO / "results":
            ignored |= {n for n in names if n != ".gitkeep"}
        return ignored

    shutil.copytree(REPO, dst, ignore=ignore)
    return dst


def cluster_env(tmp_path: Path, **extra: str) -> dict:
    """The environment Snakemake runs in on the login node: no SLURM_/SBATCH_/RECTRAIN_ variables of
    ours, this venv first, CPU-only nodes, and TMPDIR the folder each node stages the pairs into."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "RECTRAIN_"))}
    (tmp_path / "node-local").mkdir()
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        RECTRAIN_GPUS_PER_NODE="0",  # these nodes have no GPUs
        TMPDIR=str(tmp_path / "node-local"),
        **extra,
    )
    return env


def profile_run(target: str, *configfiles: str) -> list[str]:
    """`snakemake <target> --workflow-profile profiles/slurm ... --configfile <files>` for this cluster."""
    return [
        str(VENV_BIN / "snakemake"),
        target,
        "--workflow-profile",
        "profiles/slurm",
        # No accounting database on this test cluster: job states come from squeue (MinJobAge=600).
        "--slurm-status-command",
        "squeue",
        # The plugin waits this long before its first status check, then 10 s more after each check
        # that finds nothing finished: most demo jobs end within 8 s, so the first check sees them done.
        "--slurm-init-seconds-before-status-checks",
        "8",
        "--configfile",
        *configfiles,
    ]


def test_demo_pipeline_runs_as_slurm_jobs_to_the_report(slurm_cluster, tmp_path):
    work = copy_repo(tmp_path / "rectrain")
    (work / "test-cluster.yaml").write_text(TEST_CONFIG)
    env = cluster_env(tmp_path)
    started = time.monotonic()
    proc = subprocess.run(
        profile_run("results/report.html", "config/config.yaml", "test-cluster.yaml"),
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        out[-6000:]
        + "\n"
        + "\n".join(f"== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((work / "logs").rglob("*.log")))
    )
    assert (work / "results" / "report.html").stat().st_size > 0

    # Every rule ran as a SLURM job, with its SLURM log under logs/slurm/rule_<rule>/.../<jobid>.log.
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+) \(log: (\S+)\)", out)
    by_rule = {}
    for job_id, log in submitted:
        rule = re.search(r"/logs/slurm/rule_(\w+)/", log).group(1)
        by_rule.setdefault(rule, []).append(job_id)
        assert Path(log).is_file() and Path(log).name == f"{job_id}.log"
    assert sorted(by_rule) == sorted(CHAIN), by_rule
    assert len(by_rule["pack"]) == 2, "one pack job per split"
    main_log = max((work / ".snakemake" / "log").glob("*.snakemake.log"), key=os.path.getmtime).read_text()
    assert main_log.count("has been submitted with SLURM jobid") == len(submitted)
    queue = subprocess.run(["squeue", "--states=all", "-h", "-o", "%i %T"], capture_output=True, text=True).stdout
    states = dict(line.split() for line in queue.splitlines())
    assert all(states.get(j) == "COMPLETED" for j, _ in submitted), queue

    # Training spanned both SLURM nodes: one launcher per node via srun, rendezvous on the first node.
    train_log = (work / "logs" / "train" / "demo" / "main.log").read_text()
    assert "one launcher per node: srun --nodes=2" in train_log
    head = re.search(r"--rdzv_endpoint=([\w.-]+):(\d+)", train_log)
    assert head and head.group(1) in slurm_cluster["nodes"], train_log[-3000:]
    assert int(head.group(2)) == rendezvous_port(by_rule["train"][0], {}), "the port derives from the job id"

    info = json.loads((work / "results" / "demo" / "main" / "train" / "run.json").read_text())
    assert info["world_size"] == 2 and info["nodes"] == 2
    # Each node staged the pair into its node-local directory before training read it.
    assert "] copying" in train_log  # the node-local copy, logged by the launcher that made it
    assert info["rec_device"]["path"].startswith(str(tmp_path / "node-local"))
    print(f"SLURM demo pipeline: {len(submitted)} jobs in {time.monotonic() - started:.0f} s")


def job_state(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def nodes_idle() -> bool:
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True).stdout.split()
    return bool(states) and all(state == "idle" for state in states)


def wait_for(what: str, check, proc, timeout: float, out: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        assert proc.poll() is None, f"Snakemake ended while waiting for {what}: {out.read_text()[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout:.0f} s: {out.read_text()[-4000:]}")


REQUEUE_EPOCHS = 3


# Two starts of the train job and SLURM's own pace (limits checked every ~30 s): minutes on a busy box.
@pytest.mark.timeout(1500)
def test_a_train_job_warned_before_its_time_limit_checkpoints_requeues_itself_and_finishes(slurm_cluster, tmp_path):
    """profiles/slurm asks for SIGTERM RECTRAIN_SLURM_WARNING_S before the train job's time limit.  The
    test shortens the running job's limit (scontrol update TimeLimit) so that SLURM itself sends that
    warning mid-training; the ranks checkpoint mid-epoch, the job requeues itself under the same id,
    the same Snakemake keeps waiting for it, and the restarted job resumes and finishes.  (SLURM holds
    a requeued job before it may start again; the test releases it at once and restores the limit.)"""
    work = copy_repo(tmp_path / "rectrain")
    # Still training when the warning comes (SLURM checks the limits every ~30 s): rank 0 pauses inside
    # epoch 1 (rectrain.train.lifecycle.faults.after_step, on a gate that never opens) until the warning's SIGTERM.
    (work / "test-cluster.yaml").write_text(
        TEST_CONFIG.replace("epochs: 1,", f"epochs: {REQUEUE_EPOCHS}, checkpoint_interval_min: 0,")
    )
    env = cluster_env(tmp_path, RECTRAIN_SLURM_WARNING_S="600", RECTRAIN_PAUSE_AT=f"0:1:1:{tmp_path / 'no-gate'}")
    out = tmp_path / "snakemake.out"
    argv = profile_run("results/demo/main/train/model.pt", "test-cluster.yaml")
    with open(out, "w") as sink:
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        job = wait_for(
            "train submission",
            lambda: (m := re.search(r"jobid (\d+) \(log: \S+/rule_train/", out.read_text())) and m.group(1),
            proc,
            600,
            out,
        )
        train_log = work / "logs" / "train" / "demo" / "main.log"
        wait_for(
            "rank 0's pause in epoch 1",
            lambda: (
                train_log.exists() and "rank 0 pauses after epoch 1 step 1" in train_log.read_text(errors="replace")
            ),
            proc,
            600,
            out,
        )
        # The job's end is now at most 5 min away: inside the 600 s warning, so SLURM signals it.
        subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=5"], check=True)
        wait_for("the requeue", lambda: job_state(job) in ("PENDING", "REQUEUED", "REQUEUE_HOLD"), proc, 240, out)
        # SLURM revokes the first start's job credential at the requeue, in whole seconds: a start within
        # the same second, or while the nodes still complete the first start, is killed ("Job credential
        # revoked") and fails the job.  SLURM's own hold after a requeue avoids that; the test waits for
        # the nodes to be idle and a later second instead.
        requeued = time.time()
        wait_for(
            "the nodes to finish the first start",
            lambda: job_state(job) in ("PENDING", "REQUEUE_HOLD") and nodes_idle() and time.time() > requeued + 2,
            proc,
            120,
            out,
        )
        subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=60"], check=True)
        subprocess.run(["scontrol", "release", job], capture_output=True)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert proc.returncode == 0, text[-6000:] + "".join(
        f"\n== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((work / "logs").rglob("*.log"))
    )
    assert len(re.findall(r"jobid \d+ \(log: \S+/rule_train/", text)) == 1, "one submission: SLURM requeued the job"
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert re.search(r"Restarts=1\b", shown), shown
    info = json.loads((work / "results" / "demo" / "main" / "train" / "run.json").read_text())
    assert info["resumed_from_epoch"] >= 1, info
    with open(work / "results" / "demo" / "main" / "train" / "steps.csv") as f:
        rows = [tuple(int(v) for v in line.split(",")[:3]) for line in f.read().splitlines()[1:]]
    steps = 1 + max(step for _, _, step in rows)
    grid = {(rank, epoch, step) for rank in range(2) for epoch in range(REQUEUE_EPOCHS) for step in range(steps)}
    assert len(rows) == len(set(rows)) and set(rows) == grid, "every (rank, epoch, step) once across the requeue"
