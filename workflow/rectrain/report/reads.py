"""Which training order ran and what its reads saw (run.json's `order` and `reads`): the line of the
report's input-efficiency section, and the finding when reading limited the run (handed to
rectrain.report.diagnosis.diagnose with the learning findings, as rectrain.report.build does).

`reads` is one entry per rank (rectrain.loaders.readahead.ReadStats, written at the finish; null where
not measured - the torch loader reads in its worker processes).  Pure functions, like diagnosis.py.
"""

from __future__ import annotations

from typing import Mapping

from rectrain.report.diagnosis import Finding
from rectrain.settings import ReportSettings


def _measured(run: Mapping) -> list[Mapping]:
    return [r for r in (run.get("reads") or []) if r and r.get("elapsed_s")]


def summary(run: Mapping | None) -> dict | None:
    """{order, reason, line} for the report: the order in words and, when measured, the read rate while
    reading (records/s and MB/s, all ranks), how busy the reader threads were and how long the
    training step waited on them (`wait_share`, the most any rank waited); None for a run.json written
    before the order was recorded."""
    run = run or {}
    order = run.get("order")
    if not order:
        return None
    text = f"Training order: {order['used']} ({order['reason']})."
    reads = _measured(run)
    out = {"order": order["used"], "reason": order["reason"], "wait_share": None, "mb_s": None}
    if not reads:
        out["line"] = text + " Reads: not measured (the torch loader reads in its worker processes)."
        return out
    busy = max(r["busy_s"] for r in reads)
    records, nbytes = sum(r["records"] for r in reads), sum(r["bytes"] for r in reads)
    out["wait_share"] = max(min(1.0, r["wait_s"] / r["elapsed_s"]) for r in reads)
    out["mb_s"] = nbytes / 1e6 / busy if busy else None
    rate = f"{records / busy:,.0f} records/s, {out['mb_s']:.1f} MB/s" if busy else "no time reading"
    out["line"] = (
        f"{text} Reads ({len(reads)} rank(s), {reads[0].get('threads', '?')} reader threads each): {rate} while "
        f"reading, busy {100 * busy / max(r['elapsed_s'] for r in reads):.0f} % of the time; the training step "
        f"waited on them {100 * out['wait_share']:.1f} % of it."
    )
    return out


def reads_limit(run: Mapping | None, report: ReportSettings) -> Finding | None:
    """The training step waited on reads more than report.data_wait_share of the time on some rank: the
    finding names the order or the storage that would fix it."""
    s = summary(run)
    limit = float(report.data_wait_share)
    if s is None or s["wait_share"] is None or s["wait_share"] <= limit:
        return None
    rotational = ((run or {}).get("rec_device") or {}).get("rotational")
    speed = f"{s['mb_s']:.1f} MB/s" if s["mb_s"] else "little"
    if s["order"] == "permutation" and rotational:
        fix = (
            "The .rec is on a rotational disk and a full permutation reads it one seek per record: set "
            "train.order: quasi-random (or auto, which picks it there) to read blocks of 8 MiB whole, or move "
            "the .rec to an SSD (pack.fast_storage)."
        )
    elif s["order"] == "permutation":
        fix = (
            f"The storage served random reads at {speed}: move the .rec to an SSD/NVMe (pack.fast_storage) or "
            "node-local disk (pack.stage_to_local: true); on a network share or a disk that seeks, "
            "train.order: quasi-random reads blocks of 8 MiB whole instead."
        )
    else:
        fix = (
            f"The quasi-random order already reads whole 8 MiB blocks and the disk delivered {speed}, about its "
            "sequential rate: only faster storage helps - an SSD (pack.fast_storage), node-local disk "
            "(pack.stage_to_local: true), or a smaller .rec (pack.resize) that the page cache holds."
        )
    return Finding(
        id="reads_limit",
        severity="critical" if s["wait_share"] > 2 * limit else "warning",
        title="Reading the .rec limits training",
        measured=s["line"],
        threshold=f"report.data_wait_share = {100 * limit:.1f} % of the time waited on reads, on any rank",
        fix=fix,
    )


def findings(run: Mapping | None, report: ReportSettings) -> list[Finding]:
    """What diagnose adds for the reads: reads_limit's finding, when there is one."""
    found = reads_limit(run, report)
    return [found] if found else []
