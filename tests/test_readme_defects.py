"""The defect table (bad data, docs/bad-data.md) and the faults table (interrupted or broken training,
docs/training.md), moved there from the README, name for each row the tests that prove what happens:
every test they name must exist, so the tables cannot drift from the tests."""

import re

from helpers import REPO

DEFECTS_PAGE = "docs/bad-data.md"
FAULTS_PAGE = "docs/training.md"


def table_rows(page: str, heading: str) -> list[str]:
    text = (REPO / page).read_text(encoding="utf-8")
    assert heading in text, f"{page} has no section {heading!r}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "`test_" in line]


def defect_rows():
    return table_rows(DEFECTS_PAGE, "## What happens to bad data")


FAULTS = (
    "SIGTERM",
    "time limit",
    "Ctrl-C",
    "SIGKILL",
    "node crashes",
    "rank crashes",
    "rank hangs",
    "disk fills",
    "code or config edit",
    "out of GPU memory",
)


def test_the_defect_table_has_rows():
    assert len(defect_rows()) >= 20


def test_every_test_the_defect_and_faults_tables_name_exists():
    defined = set()
    for path in (REPO / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    rows = defect_rows() + table_rows(FAULTS_PAGE, "## What a run survives")
    named = [name for row in rows for name in re.findall(r"`(test_\w+)`", row)]
    missing = [name for name in named if name not in defined]
    assert not missing, f"the docs' tables name tests that do not exist: {missing}"


def test_the_faults_table_has_a_row_naming_a_test_for_every_fault_the_issue_lists():
    rows = table_rows(FAULTS_PAGE, "## What a run survives")
    missing = [fault for fault in FAULTS if not any(fault in row.split("|")[1] for row in rows)]
    assert not missing, f"faults without a row that names its test: {missing}"
