"""The workflow as a whole: the dry-run schedules the full chain and the lint is clean."""

import re
from collections import Counter

from helpers import job_headers, job_reasons, scheduled_rules, snakemake

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


def test_each_job_header_is_one_line_naming_its_rule_dataset_and_split(tmp_path):
    """profiles/default and the rules' message: no input listing (the stage's source files), no shell
    command with its JSON params, no Reason line - the timestamp and one line per job."""
    proc = snakemake("-n", "--directory", str(tmp_path), "results/report.html", timeout=120)
    assert proc.returncode == 0, proc.stderr
    headers = job_headers(proc.stdout)
    assert Counter(rule for rule, _ in headers) == Counter(scheduled_rules(proc.stdout)), proc.stdout
    assert all(rest.startswith("demo") for _, rest in headers), headers
    assert sorted(rest.split(":")[0] for rule, rest in headers if rule == "pack") == ["demo train", "demo val"]
    block = proc.stdout.split("Job stats:")[1].split("\n\n\n", 1)[1]  # between the two job-stats tables
    other = [line for line in block.splitlines() if not re.match(r"^(\[.*\]|Job \d+: \w+ .*)$", line)]
    assert not other, f"lines in the job headers other than a timestamp or the job's line: {other}"
    assert "--config-json" not in proc.stdout and "input:" not in proc.stdout


def test_the_reason_of_each_job_comes_back_with_quiet_host_after_the_target(tmp_path):
    """The docs' way (docs/rerun-semantics.md) to see why each job would run (any --quiet replaces the profile's list)."""
    proc = snakemake("-n", "--directory", str(tmp_path), "results/report.html", "--quiet", "host", timeout=120)
    assert proc.returncode == 0, proc.stderr
    reasons = job_reasons(proc.stdout)
    assert set(reasons) == set(scheduled_rules(proc.stdout)), reasons
    assert all(r.startswith("Missing output files: ") for rs in reasons.values() for r in rs), reasons


def test_every_rule_has_a_description_for_list_rules():
    proc = snakemake("--list-rules", timeout=120)
    assert proc.returncode == 0, proc.stderr
    rules = [line for line in proc.stdout.splitlines() if re.match(r"^\w+( |$)", line)]
    assert set(CHAIN) <= {line.split()[0] for line in rules}, rules
    assert all(re.match(r"^\w+ \(.+\)$", line) for line in rules), rules
