"""A stage run by a rule writes its log to a file; its console lines also reach the console: through
the Snakemake process's relay (rectrain.snakefile.console), else the terminal the job was started from
(rectrain.log.console_handler), and nothing else does."""

import logging
import os
import subprocess

from helpers import REPO

from rectrain import log as stage_log
from rectrain.progress import Progress
from rectrain.snakefile.console import Relay, report_line


def restore_after(fn):
    saved = {n: logging.getLogger(n).handlers[:] for n in ("rectrain", "__main__")}
    try:
        fn()
    finally:
        for n, handlers in saved.items():
            logging.getLogger(n).handlers[:] = handlers


def test_progress_lines_also_go_to_the_terminal_when_stderr_is_a_log_file(tmp_path, monkeypatch, capsys):
    tty = tmp_path / "tty"
    monkeypatch.setattr(stage_log, "CONSOLE", str(tty))  # stands in for /dev/tty
    monkeypatch.delenv("RECTRAIN_CONSOLE", raising=False)
    monkeypatch.delenv("RECTRAIN_TTY", raising=False)

    def run():
        stage_log.setup("pack")
        p = Progress(0.0)
        p.begin("pack train: read", 10, unit="images")
        p.count(5, force=True)
        logging.getLogger("rectrain.data.pack").info("pack train: manifest written")

    restore_after(run)
    err = capsys.readouterr().err
    assert "[pack] pack train: read 5/10 images (50.0 %)" in err and "manifest written" in err, "the log has both"
    console = tty.read_text()
    assert "[pack] pack train: read 5/10 images (50.0 %)" in console
    assert "manifest written" not in console, "only progress lines reach the terminal"


def test_no_terminal_or_rectrain_console_0_means_no_console_handler(tmp_path, monkeypatch):
    monkeypatch.setattr(stage_log, "CONSOLE", str(tmp_path / "missing" / "tty"))
    assert stage_log.console_handler("train", True) is None, "no terminal (a batch job): nothing to add"
    monkeypatch.setattr(stage_log, "CONSOLE", str(tmp_path / "tty"))
    monkeypatch.setenv("RECTRAIN_CONSOLE", "0")
    assert stage_log.console_handler("train", True) is None


def test_a_rank_in_a_session_of_its_own_finds_the_terminal_by_its_path(tmp_path, monkeypatch):
    """torchrun starts each rank with start_new_session: /dev/tty is gone, the launcher's RECTRAIN_TTY
    names the terminal instead."""
    monkeypatch.setattr(stage_log, "CONSOLE", str(tmp_path / "no-controlling-terminal" / "tty"))
    monkeypatch.setenv("RECTRAIN_TTY", str(tmp_path / "pts"))
    monkeypatch.delenv("RECTRAIN_CONSOLE", raising=False)
    handler = stage_log.console_handler("train", False)
    handler.handle(logging.makeLogRecord({"name": "rectrain.progress", "msg": "epoch 0 (of 4) step 2/5"}))
    handler.flush()
    assert (tmp_path / "pts").read_text() == "[train] epoch 0 (of 4) step 2/5\n"


def relay_reader(tmp_path):
    """A FIFO standing in for the Snakemake process's relay, and its read end (opened as the relay opens it)."""
    path = tmp_path / "relay"
    os.mkfifo(path)
    return path, os.open(path, os.O_RDWR | os.O_NONBLOCK)


def test_without_a_terminal_the_console_lines_reach_snakemakes_relay_and_nothing_else_does(tmp_path, monkeypatch):
    """stdout a file or a pipe, no terminal at all (nohup, CI): progress lines and the lines marked
    CONSOLE_LINE (epoch, resuming, moved aside) go to the relay; the rest of the log does not."""
    path, reader = relay_reader(tmp_path)
    monkeypatch.setattr(stage_log, "CONSOLE", str(tmp_path / "no-terminal" / "tty"))
    monkeypatch.setenv(stage_log.RELAY_ENV, str(path))
    monkeypatch.delenv("RECTRAIN_CONSOLE", raising=False)

    def run():
        stage_log.setup("train")
        logging.getLogger("rectrain.progress").info("epoch 1 (of 2) step 3/10")
        logging.getLogger("rectrain.train.epochs").info("epoch 1: train loss 1.1", extra=stage_log.CONSOLE_LINE)
        logging.getLogger("rectrain.train.lifecycle.resume").info("resuming from last.pt", extra=stage_log.CONSOLE_LINE)
        logging.getLogger("rectrain.train.run").info("2 loader workers")

    restore_after(run)
    try:
        assert os.read(reader, 65536).decode() == (
            "[train] epoch 1 (of 2) step 3/10\n[train] epoch 1: train loss 1.1\n[train] resuming from last.pt\n"
        )
    finally:
        os.close(reader)


def test_a_relay_fifo_nobody_reads_is_passed_over_without_blocking(tmp_path, monkeypatch):
    """A FIFO left by a Snakemake that has ended (or named on another node) has no reader: the stage
    neither waits for one nor fails, and falls back to the terminal."""
    path = tmp_path / "relay"
    os.mkfifo(path)
    monkeypatch.setenv(stage_log.RELAY_ENV, str(path))
    monkeypatch.setattr(stage_log, "CONSOLE", str(tmp_path / "tty"))
    monkeypatch.delenv("RECTRAIN_CONSOLE", raising=False)
    monkeypatch.delenv("RECTRAIN_TTY", raising=False)
    handler = stage_log.console_handler("train", False)
    handler.handle(logging.makeLogRecord({"name": "rectrain.progress", "msg": "epoch 0 (of 4) step 2/5"}))
    handler.flush()
    assert (tmp_path / "tty").read_text() == "[train] epoch 0 (of 4) step 2/5\n"


def test_the_relay_copies_each_jobs_lines_to_snakemakes_stderr_and_removes_its_fifo_at_the_end(tmp_path):
    out_r, out_w = os.pipe()
    relay = Relay(out_w)
    try:
        with open(relay.path, "a", buffering=1) as job_a, open(relay.path, "a", buffering=1) as job_b:
            job_a.write("[train] epoch 0: train loss 2.0\n")
            job_b.write("[evaluate] evaluation batch 2/2\n")
        relay.drain()
        assert os.read(out_r, 65536).decode() == "[train] epoch 0: train loss 2.0\n[evaluate] evaluation batch 2/2\n"
    finally:
        relay.close()
        os.close(out_r)
        os.close(out_w)
    assert not relay.folder.exists()


def test_the_run_ends_naming_the_report_copy_it_wrote_else_the_datasets_report(tmp_path):
    own, copy = tmp_path / "results" / "demo" / "main" / "report.html", tmp_path / "results" / "report.html"
    assert report_line([own, copy]) == f"report: {copy}"
    assert report_line([own]) == f"report: {own}"
    assert report_line([]) is None, "a run that wrote no report names none"


def make_run_with_snakemake_exiting(tmp_path, status: int, target: str, *make_args) -> subprocess.CompletedProcess:
    """`make run` from this checkout's Makefile in `tmp_path`, its Snakemake a stand-in exiting `status`."""
    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True, exist_ok=True)
    (fake / "bin" / "snakemake").write_text(f"#!/bin/sh\nexit {status}\n")
    (fake / "bin" / "snakemake").chmod(0o755)
    (tmp_path / "my.yaml").write_text("dataset: demo\n")
    return subprocess.run(
        ["make", "-f", str(REPO / "Makefile"), "-o", f"{fake}/.installed", "run", "CONFIG=my.yaml",
         f"TARGET={target}", f"VENV={fake}", *make_args],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=outside_make(),
    )  # fmt: skip


def outside_make() -> dict:
    """The environment without an enclosing make's (`make test` runs pytest): a sub-make would print
    'Entering directory' lines and join the outer make's jobserver."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}


def test_make_run_ends_naming_the_report_when_snakemake_succeeded_and_not_after_a_stop(tmp_path):
    report = tmp_path / "results" / "report.html"
    report.parent.mkdir()
    report.write_text("<html></html>")
    done = make_run_with_snakemake_exiting(tmp_path, 0, "results/report.html")
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == f"report: {report}", done.stdout
    stopped = make_run_with_snakemake_exiting(tmp_path, 75, "results/report.html")
    assert stopped.returncode != 0 and "report:" not in stopped.stdout, stopped.stdout
    other = make_run_with_snakemake_exiting(tmp_path, 0, "results/demo/main/train/model.pt")
    assert other.returncode == 0 and "report:" not in other.stdout, "a run asked for no report names none"


def test_a_dry_run_through_make_names_no_report(tmp_path):
    """make run SNAKEMAKE_ARGS=-n plans the run and writes nothing: an old report beside it is not its."""
    report = tmp_path / "results" / "report.html"
    report.parent.mkdir()
    report.write_text("<html></html>")
    for args in ("-n", "--dry-run", "-n --forcerun train"):
        dry = make_run_with_snakemake_exiting(tmp_path, 0, "results/report.html", f"SNAKEMAKE_ARGS={args}")
        assert dry.returncode == 0 and "report:" not in dry.stdout, (args, dry.stdout)


def test_a_console_that_has_gone_ends_the_console_lines_not_the_stage_and_is_not_reported_per_line(
    tmp_path, monkeypatch, capsys
):
    """Snakemake killed (kill -9) while training goes on: its relay has no reader any more."""
    path, reader = relay_reader(tmp_path)
    monkeypatch.setenv(stage_log.RELAY_ENV, str(path))
    monkeypatch.delenv("RECTRAIN_CONSOLE", raising=False)
    handler = stage_log.console_handler("train", False)
    os.close(reader)  # the Snakemake process is gone
    record = logging.makeLogRecord({"name": "rectrain.progress", "msg": "epoch 0 (of 4) step 2/5"})
    handler.handle(record)
    handler.handle(record)
    assert capsys.readouterr().err == "", "no 'Logging error' traceback per line"
