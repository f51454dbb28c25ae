"""Hangs end (rectrain.watchdog): a rank that stops making progress ends the job, naming the stalled
rank and where it was, with every rank's Python stacks in the log."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from helpers.train_data import config_json, packed_dataset

from rectrain import watchdog


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_dataset(tmp_path_factory.mktemp("packed"))


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_naming_it_and_where_with_every_ranks_stacks(data, tmp_path):
    """Rank 1's loader sleeps before its second batch (RECTRAIN_STALL_RANK) while rank 0 waits for it in
    the gradient all-reduce; the tests' collective timeout (240 s) is far off, the watchdog (3 s) ends it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["RECTRAIN_STALL_RANK"] = "1"
    cfg = config_json(
        model="squeezenet1_1", precision="fp32", epochs=1, cpu_processes=2, watchdog_s=3, calibration_steps=0
    )
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", cfg, *data, "--out", str(tmp_path / "t")]
    t0 = time.monotonic()
    proc = subprocess.run([*cmd, "--threads", "2"], env=env, capture_output=True, text=True, timeout=120)
    log = proc.stderr
    assert proc.returncode != 0 and f"exitcode: {watchdog.STALL_EXIT}" in log, log[-3000:]
    assert time.monotonic() - t0 < 60, "the watchdog, not the collective timeout, ended the job"
    named = "stalled: rank 1, epoch 0: waiting for batch 1 from the loader, at rectrain/train/lifecycle/faults.py:"
    assert named in log and "in stall_loader" in log, log[-3000:]
    assert "rank 0: " in log and "since 'epoch 0: computing batch 1'" in log, "what the other rank was doing"
    for rank in (0, 1):
        assert f"Python stacks of rank {rank}, every thread:" in log
    assert 'step.py", line' in log and "in train_step" in log, "rank 0's stack: in the backward all-reduce"
    assert "most recent call first" in log and 'trainer.py", line' in log
    assert not (tmp_path / "t" / "model.pt").exists()


def test_a_single_process_without_collectives_is_ended_too(tmp_path):
    """Nothing else would end it: no peer, no collective timeout (a single-process run or evaluation)."""
    script = textwrap.dedent(
        """
        import time
        from rectrain import log, watchdog
        log.setup("evaluate")
        with watchdog.Watchdog(0.5):
            for batch in watchdog.watched(iter(lambda: time.sleep(60), 1), "evaluation"):
                pass
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == watchdog.STALL_EXIT, proc.stderr[-2000:]
    assert "stalled: rank 0, evaluation: waiting for batch 0 from the loader" in proc.stderr
    assert "Python stacks of rank 0" in proc.stderr and "in watched" in proc.stderr


def test_stalled_ranks_are_those_waiting_for_input_else_the_oldest():
    def p(rank, what, t):
        return {"rank": rank, "what": what, "last_progress": t, "where": "x"}

    one = [p(0, "epoch 2: computing batch 5", 100.2), p(1, "epoch 2: waiting for batch 5 from the loader", 100.1)]
    assert [r["rank"] for r in watchdog.stalled_ranks(one)] == [1]
    hung_fs = [
        p(0, "validation: waiting for batch 3 from the loader", 9),
        p(1, "epoch 0: waiting for batch 7 from the loader", 8),
    ]
    assert [r["rank"] for r in watchdog.stalled_ranks(hung_fs)] == [0, 1], "every rank waiting for input is named"
    none = [p(0, "epoch 1: writing the checkpoint", 50.0), p(1, "epoch 1: waiting for rank 0's checkpoint", 50.5)]
    assert [r["rank"] for r in watchdog.stalled_ranks(none)] == [0], "no input wait: the oldest progress"
