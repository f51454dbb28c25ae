"""bench/gpu_check.sh fits a lent GPU machine: its part limits add up to the budget inside one 600 s
command, a run cut at its deadline or killed still writes summary.txt, and what lands in the output
folder is what such a machine sends back (at most 8 files, 16 MiB each, 64 MiB in all, 2 folders deep).
The runs here are on CPU: the pipeline part is cut long before it could finish."""

import os
import re
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
from helpers import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
ONE_COMMAND_S = 600  # the longest one device command may run
MIB = 2**20


def declared_limits() -> tuple[int, dict[str, int]]:
    text = SCRIPT.read_text()
    budget = int(re.search(r"^BUDGET_S=(\d+)$", text, re.M).group(1))
    limits = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(LIMIT_\w+_S)=(\d+)\b", text, re.M)}
    return budget, limits


def test_part_limits_add_up_to_the_budget_inside_one_device_command():
    budget, limits = declared_limits()
    assert set(limits) == {
        "LIMIT_SETUP_S",
        "LIMIT_PIPELINE_S",
        "LIMIT_EFFICIENCY_S",
        "LIMIT_OOM_CAP_S",
        "LIMIT_DECODER_MEMORY_S",
        "LIMIT_SUMMARY_S",
    }
    assert sum(limits.values()) <= budget <= 510
    assert ONE_COMMAND_S - budget >= 90, "room for the interpreter's start and the transfer back"


def test_limits_are_set_in_one_place_and_every_part_uses_its_variable():
    text = SCRIPT.read_text()
    for line in text.splitlines():
        if line.lstrip().startswith("run_part ") and "()" not in line:
            assert re.match(r'\s*run_part ("[^"]+"|\w+) "(\$LIMIT_\w+_S|\$\(setup_left\))" ', line), line
    # No stray literal limits: `timeout` is only ever given a variable.
    assert not re.search(r"timeout (--kill-after=\d+ )?\d", text)


def test_runbook_quotes_the_scripts_limits():
    budget, limits = declared_limits()
    runbook = (REPO / "bench" / "GPU_RUNBOOK.md").read_text()
    for name, seconds in limits.items():
        assert re.search(rf"`{name}` \| {seconds} s \|", runbook), name
    assert f"`BUDGET_S` | {budget} s" in runbook


def assert_returnable(out):
    """What a lent machine sends back: <= 8 files, each <= 16 MiB, <= 64 MiB together, <= 2 folders down,
    names of letters, digits, '.', '_' and '-'."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    assert all(p.stat().st_size <= 16 * MIB for p in files)
    assert sum(p.stat().st_size for p in files) <= 64 * MIB
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
    return sorted(str(p.relative_to(out)) for p in files)


def check_env(tmp_path, deadline_s):
    return dict(
        os.environ,
        PYTHON=str(VENV_PYTHON),
        PATH=f"{VENV_PYTHON.parent}{os.pathsep}{os.environ['PATH']}",
        GPU_CHECK_WORK=str(tmp_path / "work"),
        GPU_CHECK_SCRATCH=str(tmp_path / "scratch"),
        GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"),  # not the worktree's .whl/, should one be there
        GPU_CHECK_DEADLINE_S=str(deadline_s),
        PYTHONUNBUFFERED="1",
    )


@pytest.mark.slow
def test_check_cut_at_its_deadline_still_reports_and_returns_only_what_can_come_back(tmp_path):
    out = tmp_path / "out"
    started = time.monotonic()
    # Without a GPU here the onstart hook would refuse config/gpu.yaml's devices before any job; without
    # hooks the pipeline runs (the demo set, the pack) until the deadline cuts it, as on a slow GPU box.
    env = {**check_env(tmp_path, 30), "GPU_CHECK_SNAKEMAKE_ARGS": "--no-hooks"}
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - started
    assert done.returncode != 0
    names = assert_returnable(out)
    assert names == ["gpu_check.log", "gpu_check.tar.gz", "summary.txt"], names
    summary = (out / "summary.txt").read_text()
    assert "pipeline: no " in summary and "training did not finish" in summary
    # 137: still running 5 s after timeout's TERM (a loaded machine), so killed: cut all the same.
    environment_cut = re.search(r"FAILED: environment \(rc=(124|137), timed out after 30 s\)", summary)
    if environment_cut:
        # A machine so loaded that importing torch outlasted the 30 s (seen once, on a CI run at half speed):
        # said as a cut, not as torch missing, and nothing after it ran.
        assert "the environment check (importing torch and torchvision) did not finish within its limit" in summary
        assert "torch/torchvision missing" not in summary and "FAILED: pipeline" not in summary, summary
    else:
        # Cut while it ran, or (on a loaded machine, where the environment check alone can take 20 s) before.
        assert re.search(
            r"FAILED: pipeline \((rc=(124|137), timed out after \d+ s|skipped: no time left before the 30 s deadline)\)",
            summary,
        ), summary
        assert "FAILED: efficiency (skipped: no " in summary
        assert "FAILED: oom_cap (skipped: no time left before the 30 s deadline)" in summary
    assert "archive: gpu_check.tar.gz" in summary
    assert took < 30 + 5 + 30 + 10, "parts end by the deadline (+ kill grace); only the summary runs after it"
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = tar.getnames()
    assert "gpu_check.log" in names
    if not environment_cut:
        assert any(n.startswith("logs/") for n in names), names
        # Scratch data stayed out of the output folder; the pipeline ran in the work folder.
        assert (tmp_path / "work" / "logs").is_dir() and (tmp_path / "scratch" / "tables").is_dir()


@pytest.mark.slow  # waits out a 10 s deadline
def test_an_environment_check_cut_by_its_limit_is_said_as_a_cut_not_as_torch_missing(tmp_path):
    """The interpreter answers everything but the environment check's torch import, which outlasts the
    10 s deadline (as importing torch outlasted 30 s on a CI machine running at half speed)."""
    slow = tmp_path / "python"
    slow.write_text(
        f'#!/bin/bash\ncase "$*" in *"import sys, torch, torchvision"*) sleep 30;; esac\nexec {VENV_PYTHON} "$@"\n'
    )
    slow.chmod(0o755)
    out = tmp_path / "out"
    env = {**check_env(tmp_path, 10), "PYTHON": str(slow)}
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert re.search(r"FAILED: environment \(rc=(124|137), timed out after 10 s\)", summary), summary
    assert "the environment check (importing torch and torchvision) did not finish within its limit" in summary
    assert "torch/torchvision missing" not in summary, summary


def alive_in_session(sid: int) -> list[str]:
    """Command lines of the live (not zombie) processes of a session (timeout puts its command in a
    process group of its own, but not in another session)."""
    import psutil

    alive = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(p.info["cmdline"] or []))
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


@pytest.mark.slow  # a whole check killed mid-way (8 s): make test, not make check
def test_check_killed_by_a_signal_still_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), str(out)],
        env=check_env(tmp_path, 300),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        log = out / "gpu_check.log"
        for _ in range(600):
            if log.exists() and "pipeline (limit" in log.read_text():
                break
            time.sleep(0.1)
        else:
            pytest.fail("the pipeline part never started: " + (log.read_text() if log.exists() else "no log"))
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)  # the script alone, as a supervisor stopping it would
        assert proc.wait(timeout=90) == 143
        summary = (out / "summary.txt").read_text()
        assert "FAILED: the part running at SIGTERM was stopped" in summary
        assert re.search(r"FAILED: check stopped by SIGTERM after \d+ s", summary)
        assert_returnable(out)
        time.sleep(1)
        assert alive_in_session(proc.pid) == [], "the pipeline part must not outlive the check"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_archive_leaves_out_what_would_pass_its_cap_and_says_so(tmp_path):
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import gpu_summary

    small = tmp_path / "steps.csv"
    small.write_text("rank,epoch,step\n" + "0,0,1\n" * 50_000)  # 300 KB of text: compresses well
    big = tmp_path / "report.html"
    big.write_bytes(os.urandom(3 * MIB))  # incompressible
    dest = tmp_path / "a.tar.gz"
    left_out = gpu_summary.pack([(small, "train/steps.csv"), (big, "report.html")], dest, cap_bytes=2 * MIB)
    assert left_out == ["report.html (3.0 MiB)"]
    assert dest.stat().st_size <= 2 * MIB
    with tarfile.open(dest) as tar:
        assert tar.getnames() == ["train/steps.csv"]
        assert tar.extractfile("train/steps.csv").read() == small.read_bytes()
    left_out = gpu_summary.pack([(small, "train/steps.csv"), (big, "report.html")], dest, cap_bytes=4 * MIB)
    assert left_out == [] and 3 * MIB < dest.stat().st_size <= 4 * MIB


def test_a_venv_made_from_a_venv_sees_the_interpreters_packages_after_the_overlay(tmp_path):
    """On the lent machine python3 is itself a venv holding torch and numpy; a venv made from it with
    --system-site-packages saw neither (the first GPU run failed on `import numpy`). Here a venv with one
    marker package plays that interpreter."""

    def make_venv(python, path):
        subprocess.run([str(python), "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True)
        return path / "bin" / "python"

    def site(python):
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        return Path(subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip())

    interpreter = make_venv(VENV_PYTHON, tmp_path / "interpreter")
    (site(interpreter) / "only_in_the_interpreter.py").write_text("MARK = 1\n")
    venv_python = make_venv(interpreter, tmp_path / "overlay")
    probe = [str(venv_python), "-c", "import only_in_the_interpreter"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert subprocess.run(probe, capture_output=True, env=env).returncode != 0, "the plain venv already sees it"
    subprocess.run([str(interpreter), str(REPO / "bench" / "overlay_venv.py"), str(tmp_path / "overlay")], check=True)
    assert subprocess.run(probe, capture_output=True, env=env).returncode == 0
    # The venv's own packages still come first (what pip installs there wins over the interpreter's).
    order = subprocess.run([str(venv_python), "-c", "import sys; print(sys.path)"], capture_output=True, text=True)
    assert order.stdout.index(str(site(venv_python))) < order.stdout.index(str(site(interpreter)))


@pytest.mark.parametrize("planted", ["writable by others", "another user's", "a link"])
def test_a_scratch_folder_someone_else_could_have_planted_is_refused_and_its_venv_never_run(tmp_path, planted):
    scratch, marker = tmp_path / "scratch", tmp_path / "ran"
    real = tmp_path / "elsewhere" if planted == "a link" else scratch
    (real / "venv/bin").mkdir(parents=True)
    python = real / "venv/bin/python"
    python.write_text(f"#!/bin/sh\ntouch {marker}\n")
    python.chmod(0o755)
    if planted == "a link":
        scratch.symlink_to(real)
    elif planted == "writable by others":
        scratch.chmod(0o777)
    elif os.getuid() == 0:
        os.chown(scratch, 65534, 65534)  # nobody's
    else:
        pytest.skip("giving a folder to another user needs root")
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)], env=check_env(tmp_path, 30), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert f"refusing scratch folder {scratch}" in (out / "summary.txt").read_text()
    assert not marker.exists()
