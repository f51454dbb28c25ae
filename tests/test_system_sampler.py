"""The system sampler's CPU columns (rectrain.train.telemetry.SystemSampler): cpu_percent is the
machine's, job_cpu_percent the job's own processes' on the same scale, so a busy process outside the
job shows as the difference the report names; a resumed run appending to a system CSV an older run
wrote gets its header brought up to date."""

import csv
import subprocess
import sys
import time

import psutil

from rectrain.train import telemetry

BUSY = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"


def busy(seconds):
    return subprocess.Popen([sys.executable, "-c", BUSY.format(s=seconds)])


def test_the_jobs_own_cpu_is_apart_from_a_busy_process_outside_it(tmp_path):
    """One busy process is the job, another is not.  A shared machine lends a busy loop anything up to a
    core, so the job's column is held to the CPU time the job process itself reports over the same
    seconds, and the machine's column holds the other one's too."""
    job, other = busy(3.0), busy(3.0)
    path = tmp_path / "system.csv"
    proc = psutil.Process(job.pid)
    sampler = telemetry.SystemSampler(path, 0.25, None, [proc])
    sampler.start()
    time.sleep(0.3)
    before, started = sum(proc.cpu_times()[:2]), time.time()
    time.sleep(2.0)
    used, seconds = sum(proc.cpu_times()[:2]) - before, time.time() - started
    sampler.stop()
    job.wait(), other.wait()
    rows = [r for r in csv.DictReader(open(path)) if started <= float(r["time"]) <= started + seconds]
    assert list(rows[0]) == telemetry.SYSTEM_BASE_COLUMNS and len(rows) >= 4
    expected = 100.0 * used / (seconds * psutil.cpu_count())
    mine = sum(float(r["job_cpu_percent"]) for r in rows) / len(rows)
    everyone = sum(float(r["cpu_percent"]) for r in rows) / len(rows)
    assert 0.6 * expected < mine < 1.5 * expected, (mine, expected)
    assert everyone - mine > 0.5 * mine, "the busy process outside the job is the machine's, not the job's"


def test_a_resumed_run_rewrites_an_older_header_before_appending(tmp_path):
    path = tmp_path / "system_node0.csv"
    path.write_text("time,cpu_percent,iowait_percent,disk_read_mb_s,rss_mb\n1.0,50.0,1.0,,100.0\n")
    sampler = telemetry.SystemSampler(path, 0.1, None, [psutil.Process()], append=True)
    sampler.start()
    time.sleep(0.35)
    sampler.stop()
    rows = list(csv.DictReader(open(path)))
    assert list(rows[0]) == telemetry.SYSTEM_BASE_COLUMNS
    assert rows[0]["cpu_percent"] == "50.0" and rows[0]["job_cpu_percent"] == "", "the old row, the new column empty"
    assert len(rows) >= 2 and all(r["job_cpu_percent"] != "" for r in rows[1:])
