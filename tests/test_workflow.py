"""The workflow as a whole: the dry-run schedules the full chain and the lint is clean."""
import re

from conftest import snakemake

CHAIN = ["demo_data", "index_raw", "pack", "train", "evaluate", "report"]


def scheduled_rules(dryrun_stdout: str) -> dict:
    """Rule -> job count from the dry-run's job-stats table."""
    table = dryrun_stdout.split("Job stats:", 1)[1] if "Job stats:" in dryrun_stdout else ""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M) if m.group(1) != "total"}


def test_dryrun_schedules_the_whole_chain(tmp_path):
    proc = snakemake("-n", "--directory", str(tmp_path), "results/report.html", timeout=120)
    assert proc.returncode == 0, proc.stderr
    rules = scheduled_rules(proc.stdout)
    for rule in CHAIN:
        assert rules.get(rule, 0) >= 1, f"{rule} not scheduled: {rules}"


def test_lint_is_clean():
    proc = snakemake("--lint", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
