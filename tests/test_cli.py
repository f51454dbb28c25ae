"""The stage CLIs' scaffold (rectrain.cli): config completed, errors mapped to exit codes in one place."""

import subprocess
import sys

import pytest

from rectrain import cli, settings


class Base(Exception):
    pass


class Special(Base):
    pass


def _no_options(parser):
    parser.add_argument("--out")


def test_the_block_is_completed_from_the_schema_and_run_gets_its_view_and_the_command_line_as_given():
    seen = {}

    def run(args, view):
        seen.update(view=view, argv=args.argv, out=args.out)

    argv = ["--config-json", '{"classes": 3}', "--out", "o"]
    assert cli.main("demo", "demo", _no_options, run, argv) == 0
    assert isinstance(seen["view"], settings.DemoSettings), "the block's frozen view, not the raw dict"
    assert seen["view"].classes == 3 and seen["view"].seed is not None, "defaults filled from config/schema.yaml"
    assert seen["argv"] == argv and seen["out"] == "o"


def test_training_gets_its_train_settings_and_the_report_the_whole_configs_view():
    seen = []

    def run(args, view):
        seen.append(view)

    assert cli.main("train", "train", _no_options, run, ["--config-json", '{"lr": 0.5}']) == 0
    assert cli.main("report", cli.WHOLE, _no_options, run, ["--config-json", '{"dataset": "demo"}']) == 0
    train, whole = seen
    assert isinstance(train, settings.TrainSettings) and train.optim.lr == 0.5
    assert isinstance(whole, settings.WholeSettings) and whole.dataset == "demo"
    assert isinstance(whole.report, settings.ReportSettings) and isinstance(whole.train, settings.TrainSettings)


def test_a_config_error_is_one_tagged_line_and_the_stage_exit_code(capsys):
    def run(args, cfg):
        raise AssertionError("not reached")

    assert cli.main("demo", "demo", _no_options, run, ["--config-json", '{"clases": 3}']) == 1
    err = capsys.readouterr().err
    assert err.startswith("[demo] invalid configuration") and "unknown config key 'demo.clases'" in err
    whole = ["--config-json", "[1]"]
    assert cli.main("report", cli.WHOLE, _no_options, run, whole, errors={cli.ConfigError: 2}) == 2
    assert "[report] --config-json must be a JSON object (the whole config)" in capsys.readouterr().err


def test_the_most_specific_listed_error_wins_and_bare_logs_keep_the_tag_on_errors(capsys):
    def run(args, cfg):
        raise Special("the disk is full: free 3 GB")

    assert cli.main("pack", None, _no_options, run, [], errors={Base: 2, Special: 4}, bare=True) == 4
    assert capsys.readouterr().err == "[pack] the disk is full: free 3 GB\n"


def test_an_unlisted_error_propagates_with_its_traceback():
    def run(args, cfg):
        raise KeyError("bug")

    with pytest.raises(KeyError):  # a bug is not an exit code
        cli.main("pack", None, _no_options, run, [], errors={Base: 2})


def test_ctrl_c_is_one_line_in_the_log_and_on_the_terminal_and_exit_130(tmp_path, monkeypatch, capsys):
    def run(args, cfg):
        raise KeyboardInterrupt

    terminal = tmp_path / "tty"
    monkeypatch.setenv("RECTRAIN_TTY", str(terminal))  # the terminal the job was started from
    monkeypatch.delenv("RECTRAIN_CONSOLE", raising=False)
    assert cli.main("index", "index", _no_options, run, ["--config-json", "{}"]) == cli.EXIT_INTERRUPTED == 130
    line = f"[index] index interrupted: {cli.NOTHING_PUBLISHED}\n"
    assert capsys.readouterr().err == line and terminal.read_text() == line


def test_a_stage_that_handles_ctrl_c_itself_gets_the_interrupt():
    def run(args, cfg):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cli.main("train", "train", _no_options, run, ["--config-json", "{}"], interrupted=None)


def test_a_process_ended_by_cli_end_keeps_its_exit_status_atexit_handlers_and_unclosed_files(tmp_path):
    """cli.end skips only the interpreter's last garbage collections (gc.freeze): the status, logging's
    atexit flush and a file left open (flushed as its last reference goes) are as with sys.exit."""
    script = (
        "import atexit, gc, logging, sys\n"
        "from rectrain import cli\n"
        f"logging.basicConfig(filename={str(tmp_path / 'log')!r})\n"
        "logging.getLogger().error('logged')\n"
        f"left_open = open({str(tmp_path / 'out')!r}, 'w'); left_open.write('written')\n"
        "atexit.register(lambda: print('atexit ran, frozen:', gc.get_freeze_count() > 0))\n"
        "cli.end(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == "atexit ran, frozen: True"
    assert (tmp_path / "out").read_text() == "written"
    assert "logged" in (tmp_path / "log").read_text()
