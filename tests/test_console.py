"""A stage run by a rule writes its log to a file; its progress lines also reach the terminal the job
was started from (rectrain.log.console_handler), and nothing else does."""

import logging

from rectrain import log as stage_log
from rectrain.progress import Progress


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
