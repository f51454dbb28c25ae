"""A stop sent to the Snakemake process (rectrain.snakefile.stopping): which processes it reaches, when
a stop counts as clean, and the run's last line.  The whole path, through a real run: tests/test_pipeline_e2e.py
(SIGINT) and tests/test_own_model_pipeline.py (SIGTERM)."""

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import psutil
import pytest
from helpers.users import as_other_user, needs_root, shared_folder

from rectrain.snakefile import stopping
from rectrain.train.lifecycle.status import EXIT_STOPPED, STOPPED


def test_the_signal_goes_to_each_jobs_command_not_to_the_shell_snakemake_runs_it_in():
    """bash ended by SIGTERM would leave its command (training's launcher) running while Snakemake
    counts the job failed: the command gets the signal, its shell does not."""
    shell = subprocess.Popen(["bash", "-c", f"set -e; {sys.executable} -c 'import time; time.sleep(60)'; true"])
    command = None
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(shell.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        command = psutil.Process(shell.pid).children()[0]
        found = {p.pid for p in stopping.job_commands(psutil.Process())}
        assert command.pid in found and shell.pid not in found
    finally:
        shell.kill()
        shell.wait()
        if command is not None:
            command.kill()


def write_stopped(ck_dir, age_s=0.0):
    ck_dir.mkdir(parents=True, exist_ok=True)
    marker = ck_dir / STOPPED
    info = {"signal": "SIGINT", "after": "epoch 1 step 2 of 10", "resumes_at": "epoch 1 step 3"}
    marker.write_text(json.dumps(info))
    then = time.time() - age_s
    os.utime(marker, (then, then))


def test_only_a_stopped_json_written_after_the_signal_is_a_clean_stop(tmp_path):
    since = time.time()
    write_stopped(tmp_path, age_s=3600)  # an earlier stop's marker
    assert stopping.stopped_since(tmp_path, since) is None
    write_stopped(tmp_path)
    assert stopping.stopped_since(tmp_path, since)["resumes_at"] == "epoch 1 step 3"


class FakeScheduler:
    def __init__(self):
        self.graceful = 0

    def exit_gracefully(self):
        self.graceful += 1


class FakeWorkflow:
    def __init__(self):
        self.scheduler = FakeScheduler()


def test_after_a_clean_stop_snakemakes_error_block_is_dropped_and_one_line_says_how_to_go_on(tmp_path, monkeypatch):
    forwarded = []
    monkeypatch.setattr(stopping.Stop, "forward", lambda self, signum: forwarded.append(signum))
    out = tmp_path / "console"
    with open(out, "w") as console:
        stop = stopping.Stop(FakeWorkflow(), tmp_path / "checkpoints", out=console)
        error = logging.makeLogRecord({"levelno": logging.ERROR, "msg": "Error in rule train"})
        info = logging.makeLogRecord({"levelno": logging.INFO, "msg": "Shutting down"})
        assert stop.keep_record(error), "no stop asked: Snakemake's errors stand"
        stop.handle(signal.SIGINT, None)
        deadline = time.monotonic() + 10
        while not stop.workflow.scheduler.graceful and time.monotonic() < deadline:  # told from a thread
            time.sleep(0.01)
        assert forwarded == [signal.SIGINT] and stop.workflow.scheduler.graceful == 1
        assert stop.keep_record(error), "the train job did not stop cleanly (no stopped.json since): its error stands"
        write_stopped(tmp_path / "checkpoints")
        assert not stop.keep_record(error) and stop.keep_record(info)
    assert "SIGINT: asking the running job(s) to stop" in out.read_text()
    line = stopping.final_line(stop.stopped(), stop.shown)
    assert line == (
        f"stopped on SIGINT after epoch 1 step 2 of 10: the checkpoint {tmp_path / 'checkpoints' / 'last.pt'} holds "
        f"the run; run the same command again to continue at epoch 1 step 3 (exit status {EXIT_STOPPED}: stopped, "
        "resumable)"
    )


# ---- issue 47 items 5, 6: `make stop` finds its runs by entries of the user's own -----------------

REGISTERED = "from rectrain.snakefile import runs; import time; runs.register(); print('registered', flush=True); time.sleep(120)"


def registered_process(work, env) -> subprocess.Popen:
    """A process in `work` that registered itself as a run (as the onstart hook does), then waits."""
    proc = subprocess.Popen([sys.executable, "-c", REGISTERED], cwd=work, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "registered"
    return proc


def test_two_pipelines_in_one_folder_each_keep_their_entry_and_stop_reaches_the_one_named_then_all(
    tmp_path, monkeypatch
):
    from rectrain.snakefile import runs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    env = dict(os.environ)
    first, second, other = (registered_process(w, env) for w in (work, work, elsewhere))
    try:
        assert runs.stop(work, pid=second.pid) == [
            f"make stop: asked Snakemake (pid {second.pid}) to stop; it ends after training's checkpoint"
        ]
        assert second.wait(10) == -signal.SIGTERM and first.poll() is None
        assert len(runs.stop(work)) == 1 and first.wait(10) == -signal.SIGTERM
        assert other.poll() is None, "a run in another folder is not this folder's"
        assert runs.stop(work)[0].startswith("make stop: no run is going in this folder")
        assert stat.S_IMODE(os.stat(runs.folder()).st_mode) == 0o700
    finally:
        for proc in (first, second, other):
            proc.kill()
            proc.wait()


def test_an_entry_naming_a_process_that_did_not_write_it_is_never_signalled_and_is_removed(tmp_path, monkeypatch):
    from rectrain.snakefile import runs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sleeper = subprocess.Popen(["sleep", "60"], cwd=tmp_path)
    try:
        entry = runs.Entry(sleeper.pid, start=1.0, workdir=str(tmp_path), host=socket.gethostname())  # pid reused
        folder = runs.folder()
        folder.mkdir(parents=True)
        (folder / entry.name).write_text(json.dumps(entry.__dict__))
        assert runs.stop(tmp_path)[0].startswith("make stop: no run is going in this folder")
        assert sleeper.poll() is None and not (folder / entry.name).exists()
    finally:
        sleeper.kill()
        sleeper.wait()


@needs_root
def test_the_entries_folder_inside_another_users_folder_is_refused_and_nothing_is_written_there(monkeypatch):
    from rectrain.snakefile import runs

    with shared_folder() as base:
        base.chmod(0o1777)  # as /tmp
        theirs = base / "cache"
        made = as_other_user("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", theirs)
        assert made.returncode == 0, made.stderr
        monkeypatch.setenv("XDG_CACHE_HOME", str(theirs))
        with pytest.raises(runs.RunsFolderError, match="make stop cannot use it"):
            runs.register()
        assert not (theirs / "rectrain").exists()
