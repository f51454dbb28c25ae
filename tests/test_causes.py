"""A failed job's one-line cause (rectrain.snakefile.causes, rectrain.log's cause handler): a stage
process leaves its first error line with the log its stderr goes to; the Snakemake process prints it
for the failed job whose log that is, else that log's last line; Snakemake's error block is short on
its console and whole at the end of the job's log.  The whole path through Snakemake:
tests/test_run_says_what_went_wrong.py."""

import logging
import os
import subprocess
import sys

from snakemake_interface_logger_plugins.common import LogEvent

from rectrain import log as stage_log
from rectrain.snakefile.causes import Causes, ShortErrors, keep_in_logs

STAGE = """
import logging, sys
from rectrain import log
log.setup("train", elapsed=True)
logging.getLogger("rectrain.train.x").warning("not an error")
logging.getLogger("rectrain.progress").error("rank 0: training diverged at epoch 1 step 4; lower train.lr")
logging.getLogger("rectrain.train.y").error("a later error is not the cause")
"""


def job_error(log_path, rule="train") -> logging.LogRecord:
    return logging.makeLogRecord(
        {"levelno": logging.ERROR, "msg": None, "event": LogEvent.JOB_ERROR, "rule_name": rule, "jobid": 3,
         "log": [str(log_path)], "input": ["a.py", "b.py"], "output": ["model.pt"], "shellcmd": "python -m x --big",
         "rule_msg": None, "conda_env": None, "aux": {}}
    )  # fmt: skip


def test_a_stage_leaves_its_first_error_line_with_its_log_and_the_run_names_it_for_that_job(tmp_path, monkeypatch):
    causes = Causes()
    try:
        log_file = tmp_path / "logs" / "train.log"
        log_file.parent.mkdir()
        env = {**os.environ, stage_log.CAUSE_ENV: str(causes.folder), "RECTRAIN_CONSOLE": "0"}
        with open(log_file, "w") as stderr:
            subprocess.run([sys.executable, "-c", STAGE], env=env, stderr=stderr, check=True, timeout=60)
        left = causes.left()
        assert len(left) == 1 and left[0]["log"] == str(log_file.resolve()), left
        assert left[0]["line"].startswith("[train ") and left[0]["line"].endswith(
            "training diverged at epoch 1 step 4; lower train.lr"
        )
        causes.note(job_error(log_file))
        monkeypatch.chdir(tmp_path)
        assert causes.lines() == [
            "train failed: rank 0: training diverged at epoch 1 step 4; lower train.lr (log: logs/train.log)"
        ]
    finally:
        causes.close()
    assert not causes.folder.exists()


def test_without_a_cause_left_the_line_is_the_last_line_of_the_jobs_log(tmp_path, monkeypatch):
    causes = Causes()
    try:
        log_file = tmp_path / "index.log"
        log_file.write_text("[index] reading\nTraceback (most recent call last):\nValueError: bad \x1b[31mname\n====\n")
        keep_in_logs(job_error(log_file, rule="index_raw"))  # Snakemake's block, appended as the job failed
        causes.note(job_error(log_file, rule="index_raw"))
        causes.note(logging.makeLogRecord({"msg": "an ordinary line"}))
        monkeypatch.chdir(tmp_path)
        assert causes.lines() == ["index_raw failed: ValueError: bad \\x1b[31mname (log: index.log)"]
    finally:
        causes.close()


def test_snakemakes_error_block_is_short_on_the_console_and_whole_at_the_end_of_the_jobs_log(tmp_path):
    from snakemake.logging import DefaultFormatter

    log_file = tmp_path / "train.log"
    log_file.write_text("[train] the job's own lines\n")
    short = ShortErrors(DefaultFormatter(show_failed_logs=True)).format(job_error(log_file))
    assert short == (
        f"Error in rule train (job 3): its log {log_file} ends with Snakemake's whole error block; the cause is the "
        "last line of this run"
    )
    kept = log_file.read_text()
    assert kept.startswith("[train] the job's own lines\n") and kept.count("[train] the job's own lines") == 1
    block = kept[kept.index("---- Snakemake's error block for this job ----") :]
    assert "Error in rule train:" in block and "input: a.py, b.py" in block and "python -m x --big" in block
    rule = logging.makeLogRecord(
        {"levelno": logging.ERROR, "event": LogEvent.ERROR, "exception": "RuleException",
         "msg": "RuleException:\nCalledProcessError in file rules/train.smk, line 55:\nCommand 'set -euo pipefail; python -m x --config-json '{...}'' returned non-zero exit status 1."}
    )  # fmt: skip
    text = ShortErrors(DefaultFormatter()).format(rule)
    assert "--config-json" not in text and text.endswith("line 55:\nits shell command exited with status 1.")
