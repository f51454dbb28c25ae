"""CPU time and peak memory of a stage's own processes, measured by the stage itself.

Snakemake's `benchmark:` samples the job's process tree every 30 s, starting with the shell that
wraps the command: a stage that ends before a later sample is recorded as that shell (the pack was
"CPU 0.0 s, max RSS 3.0 MB").  So each stage reads getrusage for itself and the child processes it
waited for (loader workers, decoder processes) when it is done, and puts it in the output the report
already reads (pack manifest, run.json, metrics.json); the report's stage table prefers it.
"""

from __future__ import annotations

import resource

WHAT = "the stage's processes (getrusage of each process and the children it waited for)"


def own() -> dict:
    """This process's CPU seconds (user + system, its waited-for children included) and peak RSS in
    MB (the larger of its own and its largest child's: ru_maxrss is a peak, not a sum)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "cpu_s": round(me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, 2),
        "max_rss_mb": round(max(me.ru_maxrss, kids.ru_maxrss) / 1024, 1),  # Linux: kilobytes
        "processes": 1,
        "measured_by": WHAT,
    }


def combined(parts: list[dict]) -> dict:
    """Several processes of one job (the ranks' own(), all_gather-ed: every node's count): CPU seconds summed; peak RSS summed too, an upper
    bound (the ranks run side by side, their peaks need not coincide)."""
    return {
        "cpu_s": round(sum(p["cpu_s"] for p in parts), 2),
        "max_rss_mb": round(sum(p["max_rss_mb"] for p in parts), 1),
        "processes": sum(p["processes"] for p in parts),
        "measured_by": WHAT + ("; peak RSS summed over the ranks" if len(parts) > 1 else ""),
    }
