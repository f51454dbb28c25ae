"""The workflow as a whole: the dry-run schedules the full chain and the lint is clean."""

from helpers import scheduled_rules, snakemake

CHAIN = ["demo_data", "index_raw", "pack", "train", "evaluate", "report"]


def test_dryrun_schedules_the_whole_chain(tmp_path):
    proc = snakemake("-n", "--directory", str(tmp_path), "results/report.html", timeout=120)
    assert proc.returncode == 0, proc.stderr
    rules = scheduled_rules(proc.stdout)
    for rule in CHAIN:
        assert rules.get(rule, 0) >= 1, f"{rule} not scheduled: {rules}"


def test_lint_is_clean():
    proc = snakemake("--lint", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
