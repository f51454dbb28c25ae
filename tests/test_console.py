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
