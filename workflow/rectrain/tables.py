"""The pipeline's tab-separated tables (index/{train,val,classes,unclassified}.tsv): one reader."""

from __future__ import annotations

import csv
import os


def read_tsv(path: str | os.PathLike, required: tuple[str, ...] = ()) -> list[dict]:
    """Rows of a TSV with a header line, as dicts of strings.  A missing column named in `required`
    is an error naming the file and the stage that writes it."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t")
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} lacks the column(s) {', '.join(missing)}: rerun the index stage (index_raw)")
        return list(reader)


def read_classes(path: str | os.PathLike) -> list[dict]:
    """classes.tsv (label, wnid, name): one row per class in label order; an empty table is an error."""
    rows = read_tsv(path, required=("label", "wnid", "name"))
    if not rows:
        raise ValueError(f"{path} lists no classes: rerun the index stage (index_raw)")
    return rows


# A cell starting with one of these is a formula to a spreadsheet (=HYPERLINK(...) sends data away,
# =cmd|... ran programs in old Excel): class names come from the dataset.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(value):
    """A text cell for a CSV that people open in a spreadsheet: one that would start a formula gets a
    leading ' (the OWASP advice on CSV injection), so it is shown as text. Numbers are left alone."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value
