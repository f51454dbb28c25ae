"""The README's defect table names, for each kind of bad data, the test that proves what happens:
every test it names must exist, so the table cannot drift from the tests."""

import re

from helpers import REPO


def defect_rows():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## What happens to bad data", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "`test_" in line]


def test_the_defect_table_has_rows():
    assert len(defect_rows()) >= 20


def test_every_test_the_defect_table_names_exists():
    defined = set()
    for path in (REPO / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    named = [name for row in defect_rows() for name in re.findall(r"`(test_\w+)`", row)]
    missing = [name for name in named if name not in defined]
    assert not missing, f"README names tests that do not exist: {missing}"
