"""The report knows the training order and its reads (rectrain.report.reads): the input-efficiency
section names the order and the read rate; when the step waited on reads, a finding names the order
or the storage that fixes it."""

import pytest
from helpers.synthetic_run import REPORT_CFG, write_run
from helpers.views import report_html, view

from rectrain.report import load
from rectrain.report.reads import reads_limit, summary

QUASI = {
    "requested": "auto",
    "used": "quasi-random",
    "reason": "auto: the .rec /hdd/train.rec is on a rotational disk (sdb): ...",
    "block_bytes": 8 << 20,
    "window_batches": 152,
    "window_bytes": 1 << 30,
}
PERMUTATION = {"requested": "auto", "used": "permutation", "reason": "auto: the .rec /hdd/train.rec is on ..."}


def reads(wait_s: float, busy_s: float = 50.0, order: str = "quasi-random") -> dict:
    """One rank's reads over 100 s: 6,000 records of 110 KB read in busy_s."""
    return {"order": order, "threads": 1, "records": 6000, "bytes": 660_000_000, "requests": 80,
            "busy_s": busy_s, "elapsed_s": 100.0, "wait_s": wait_s}  # fmt: skip


def run(order: dict, *ranks, rotational: bool = True) -> dict:
    return {"order": order, "reads": list(ranks), "rec_device": {"path": "/hdd/train.rec", "rotational": rotational}}


def test_the_summary_names_the_order_and_the_read_rate_while_reading():
    s = summary(run(QUASI, reads(2.0), reads(6.0, busy_s=60.0)))
    assert s["order"] == "quasi-random" and "rotational disk (sdb)" in s["line"]
    # 12,000 records, 1,320 MB over the busiest rank's 60 s of reading
    assert "200 records/s, 22.0 MB/s while reading" in s["line"] and "busy 60 % of the time" in s["line"]
    assert s["wait_share"] == pytest.approx(0.06) and "waited on them 6.0 %" in s["line"]
    assert "not measured" in summary(run(PERMUTATION, None))["line"]  # the torch loader: no reads counted
    assert summary({}) is None  # a run.json from before the order was recorded


@pytest.mark.parametrize(
    "order,rotational,fix",
    [
        (PERMUTATION, True, "set train.order: quasi-random"),
        (PERMUTATION, False, "served random reads at 13.2 MB/s: move the .rec to an SSD/NVMe"),
        (QUASI, True, "only faster storage helps"),
    ],
)
def test_a_run_that_waited_on_its_reads_is_told_the_order_or_the_storage_that_fixes_it(order, rotational, fix):
    report = view("report", dict(REPORT_CFG))
    limit = float(report.data_wait_share)
    waited = run(order, reads(100 * (limit + 0.1), order=order["used"]), rotational=rotational)
    finding = reads_limit(waited, report)
    assert finding is not None and finding.id == "reads_limit" and fix in finding.fix, finding
    assert reads_limit(run(order, reads(100 * limit / 2)), report) is None, "a wait under the threshold flagged"


def test_the_report_shows_the_order_and_its_reads_and_the_diagnosis_flags_the_waits(tmp_path):
    waited = run(PERMUTATION, reads(60.0, order="permutation"), reads(55.0, order="permutation"))
    paths = write_run(tmp_path, rotational=True, run_overrides=waited)
    data = load(paths["train"], paths["eval"], paths["pack"], paths["index"], [paths["benchmarks"]], "demo")
    config = {"dataset": "demo", "report": dict(REPORT_CFG), "train": {"model": "resnet18", "epochs": 2}}
    html = report_html(data, config, repo=tmp_path)
    line = html[html.index('id="reads"') :]
    assert "Training order: permutation" in line and "records/s" in line
    assert 'id="finding-reads_limit"' in html and "No problems found" not in html
