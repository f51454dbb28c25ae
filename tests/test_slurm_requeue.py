"""A train job stopped by its time limit's warning is requeued by itself; any other stop is not
(rectrain.train.lifecycle.supervise).  squeue/scontrol are faked here; tests/test_slurm.py drives the real thing."""

import subprocess
from datetime import datetime

import pytest

from rectrain.train.lifecycle import supervise

NOW = datetime(2026, 12, 1, 12, 0, 0).timestamp()


class FakeSlurm:
    """squeue answers the job's end time `left` seconds from NOW; scontrol records what it was asked."""

    def __init__(self, left=None, end_text=None, requeue_rc=0):
        self.end = end_text or datetime.fromtimestamp(NOW + left).isoformat(timespec="seconds")
        self.requeue_rc = requeue_rc
        self.requeued = []

    def __call__(self, argv, **kwargs):
        if argv[0] == "squeue":
            return subprocess.CompletedProcess(argv, 0, self.end + "\n", "")
        assert argv[:2] == ["scontrol", "requeue"]
        self.requeued.append(argv[2])
        return subprocess.CompletedProcess(argv, self.requeue_rc, "", "Job is not requeueable" * bool(self.requeue_rc))


def test_a_stop_inside_the_warning_window_requeues_the_job_by_its_id():
    slurm = FakeSlurm(left=240)
    said = supervise.after_stop({"SLURM_JOB_ID": "41", "SLURM_PROCID": "0"}, slurm, NOW)
    assert slurm.requeued == ["41"]
    assert "requeued" in said and "240 s before its time limit" in said


def test_a_stop_with_more_time_left_is_a_preemption_or_scancel_and_is_not_requeued():
    slurm = FakeSlurm(left=3600)
    said = supervise.after_stop({"SLURM_JOB_ID": "41"}, slurm, NOW)
    assert slurm.requeued == []
    assert "3600 s of its time limit left" in said and "not requeued" in said


def test_the_window_follows_the_configured_warning_plus_slurms_early_delivery():
    env = {"SLURM_JOB_ID": "7", supervise.WARNING_ENV: "600"}
    inside, outside = FakeSlurm(left=600 + supervise.EARLY_S - 1), FakeSlurm(left=600 + supervise.EARLY_S + 1)
    supervise.after_stop(env, inside, NOW), supervise.after_stop(env, outside, NOW)
    assert inside.requeued == ["7"] and outside.requeued == []
    assert supervise.stop_signal_option(env) == "--signal=TERM@600"


def test_an_unknown_end_time_is_not_requeued_and_says_so():
    slurm = FakeSlurm(end_text="N/A")
    said = supervise.after_stop({"SLURM_JOB_ID": "9"}, slurm, NOW)
    assert slurm.requeued == [] and "unknown of its time limit left" in said


def test_only_the_jobs_first_task_requeues_and_outside_slurm_nothing_is_asked():
    slurm = FakeSlurm(left=60)
    supervise.after_stop({"SLURM_JOB_ID": "3", "SLURM_PROCID": "1"}, slurm, NOW)
    assert supervise.after_stop({}, slurm, NOW) is None
    assert slurm.requeued == []


@pytest.mark.parametrize(
    "env, waits",
    [
        ({"SLURM_JOB_ID": "3", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, [supervise.FIRST_TASK_WAIT_S]),
        ({"SLURM_JOB_ID": "3", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, []),
        ({"SLURM_JOB_ID": "3", "SLURM_NTASKS": "1"}, []),
        ({}, []),
    ],
)
def test_a_stopped_task_other_than_the_first_waits_for_the_first_to_requeue_before_it_exits(env, waits):
    """Its exit status 75 at once would make srun (--kill-on-bad-exit) kill the first task before its
    scontrol requeue: a CI run of tests/test_slurm.py saw task 1 exit first and the job fail."""
    slept = []
    supervise.wait_for_first_task(env, slept.append)
    assert slept == waits
    if waits:
        assert f"waits up to {supervise.FIRST_TASK_WAIT_S} s" in supervise.after_stop(env, FakeSlurm(left=60), NOW)


def test_a_refused_requeue_names_the_command_and_slurms_reason():
    said = supervise.after_stop({"SLURM_JOB_ID": "5"}, FakeSlurm(left=100, requeue_rc=1), NOW)
    assert "`scontrol requeue 5` failed (Job is not requeueable)" in said


@pytest.mark.parametrize("raw", ["0", "five", "-3"])
def test_a_warning_that_is_not_a_positive_number_of_seconds_names_the_variable(raw):
    with pytest.raises(ValueError, match=supervise.WARNING_ENV):
        supervise.stop_signal_option({supervise.WARNING_ENV: raw})
