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


def test_summary_needs_no_cores_and_lists_every_output_as_missing(tmp_path):
    """Rules' threads are read when a job is expanded, not when the Snakefile is parsed, so commands
    that run no job work without --cores (tests/test_pipeline_e2e.py runs each on a finished pipeline)."""
    proc = snakemake("--summary", "--directory", str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Workflow requires a total number of cores" not in proc.stderr
    rows = [line.split("\t") for line in proc.stdout.splitlines() if line.startswith("results/")]
    assert {row[2] for row in rows} == set(CHAIN), rows
    assert all(row[-2:] == ["missing", "update pending"] for row in rows), rows
