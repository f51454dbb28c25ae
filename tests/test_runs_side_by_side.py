"""Many runs of one dataset side by side (issue 50), end to end through Snakemake on a tiny demo, one
pipeline serving every assertion: a sweep of three runs - a torchvision model, a timm model and a model
of the test's own file - on one CPU process each, under `--resources gpu=2` (two runs train at once),
paused until two train together, stopped by `make stop` while the own model trains its second epoch, and
finished by the same command, which trains none of the finished runs again; compare.html with the three
rows and its plots in headless Chromium; a fourth run added to the sweep - a branch from the torchvision
run's epoch_0.pt (train.resume_from) - is the only one to train, and trains on from that checkpoint; an
edit of one run's key reruns that run only."""

import json
import os
import shutil
import subprocess
import time

import pandas as pd
import pytest
import yaml
from helpers import (
    REPO,
    VENV_BIN,
    copy_workflow,
    job_headers,
    launcher_of,
    scheduled_rules,
    snakemake,
    tiny_demo,
    tiny_train,
)
from helpers.browser import CHROMIUM, NO_CHROMIUM, chromium

from rectrain.train.lifecycle import faults
from rectrain.train.lifecycle.status import EXIT_STOPPED

pytestmark = pytest.mark.slow

TARGET = "results/demo/compare.html"
RUNS = {
    "tv": {"train": {"model": "squeezenet1_1"}},
    "timm": {"train": {"model": "timm:resnet10t"}},
    # steps of 0.3 s and three epochs: `make stop` lands inside its second or third epoch
    "own": {
        "train": {
            "model": "nets/net.py:tiny",
            "model_args": {"width": 8, "step_delay_s": 0.3},
            "zero_init_residual": False,
            "epochs": 3,
        }
    },
}
SWEEP = {
    "demo": tiny_demo(train_per_class=16),
    "train": tiny_train(cpu_processes=1, epochs=1, batch_size=8, calibration_steps=1, progress_s=1),
    "runs": RUNS,
}
# The fourth run: a branch of tv from its epoch_0.pt, trained to epoch 2.
BRANCH = {
    "train": {"model": "squeezenet1_1", "resume_from": "results/demo/tv/train/checkpoints/epoch_0.pt", "epochs": 2}
}


def command(work, configfile="sweep.yaml", *args, target=TARGET):
    """The sweep's command; the target first: --resources and --configfile take every word after them."""
    return [str(VENV_BIN / "snakemake"), "--snakefile", str(work / "Snakefile"), "--directory", str(work), target,
            "--cores", "2", "--resources", "gpu=2", *args, "--configfile", str(work / configfile)]  # fmt: skip


def env():
    return dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def telemetry_rows(work, run) -> list[str]:
    path = work / "results" / "demo" / run / "train" / "telemetry" / "steps_rank0.csv"
    return path.read_text().splitlines()[1:] if path.is_file() else []


def wait_for(condition, proc, deadline, what):
    while not condition():
        assert proc.poll() is None, f"Snakemake ended before {what}: {proc.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The sweep run twice: paused after each train job's step 1 until two are paused together (then
    released), stopped by `make stop` in the own model's second epoch, and run again to its end."""
    started = time.monotonic()
    work = copy_workflow(tmp_path_factory.mktemp("runs"))
    shutil.copytree(REPO / "tests" / "helpers" / "own_model", work / "nets")
    (work / "sweep.yaml").write_text(yaml.safe_dump(SWEEP))
    gate = work / "gate"
    paused = dict(env(), **{faults.PAUSE_AT_ENV: f"0:0:1:{gate}"})
    first = subprocess.Popen(command(work), cwd=work, env=paused, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)  # fmt: skip
    deadline = time.monotonic() + 900
    launcher_of(first, deadline)

    def paused_runs():  # each pauses after its step 1, its first step logged
        return [r for r in RUNS if telemetry_rows(work, r)]

    wait_for(lambda: len(paused_runs()) == 2, first, deadline, "two train jobs trained their first step together")
    together = paused_runs()
    gate.touch()
    wait_for(lambda: any(row.startswith("0,1,") for row in telemetry_rows(work, "own")), first, deadline,
             "the own model trained its second epoch")  # fmt: skip
    stop = subprocess.run(["make", "-f", str(REPO / "Makefile"), "stop"], cwd=work, env=env(), capture_output=True,
                          text=True)  # fmt: skip
    assert "asked Snakemake" in stop.stdout, stop.stdout + stop.stderr
    out, _ = first.communicate(timeout=600)
    assert first.returncode == EXIT_STOPPED, out[-6000:]
    finished = {r for r in RUNS if (work / "results" / "demo" / r / "train" / "model.pt").is_file()}
    second = subprocess.run(command(work), cwd=work, env=env(), capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    return {
        "work": work,
        "together": together,
        "stopped_out": out,
        "finished_first": finished,
        "second": second.stdout + second.stderr,
        "seconds": time.monotonic() - started,
    }


def test_two_one_process_runs_train_at_the_same_time_under_resources_gpu_2(sweep):
    """Their step logs' timestamps overlap: each trained steps while the other was between its first
    and last step."""
    spans = []
    for run in sweep["together"]:
        steps = pd.read_csv(sweep["work"] / "results" / "demo" / run / "train" / "steps.csv")
        spans.append((steps["time"].min(), steps["time"].max()))
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1, spans
    print(f"\nthe sweep's two Snakemake runs took {sweep['seconds']:.0f} s")


def test_make_stop_mid_sweep_then_the_same_command_finishes_the_stopped_run_and_trains_no_finished_one(sweep):
    work, finished = sweep["work"], sweep["finished_first"]
    assert finished and "own" not in finished, finished
    assert "[rectrain] stopped on SIGTERM after epoch " in sweep["stopped_out"], sweep["stopped_out"][-3000:]
    trained = {rest.split()[1].rstrip(":") for rule, rest in job_headers(sweep["second"]) if rule == "train"}
    assert trained == set(RUNS) - finished, (trained, finished)
    assert "continuing at epoch " in (work / "logs" / "train" / "demo" / "own.log").read_text()
    for run in RUNS:
        info = json.loads((work / "results" / "demo" / run / "train" / "run.json").read_text())
        assert info["model"] == RUNS[run]["train"]["model"] and info["finished"], run


def test_every_run_has_its_own_folder_weights_json_with_params_and_flops_and_report(sweep):
    for run in RUNS:
        folder = sweep["work"] / "results" / "demo" / run
        published = json.loads((folder / "train" / "weights.json").read_text())
        assert published["cost"]["params"] > 0 and published["cost"]["flops"] > 0, published
        assert published["cost"]["image_size"] == 32 and "2 per multiply-add" in published["cost"]["unit"]
        assert 'id="model-cost"' in (folder / "report.html").read_text()


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_compare_html_renders_three_rows_the_plots_and_every_runs_name_in_chromium(sweep, tmp_path):
    from PIL import Image, ImageStat

    page = sweep["work"] / TARGET
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert dom.count('<tr class="run') == 3
    for run, given in RUNS.items():
        assert f'id="run-{run}"' in dom and given["train"]["model"] in dom
    assert 'id="curves-plot"' in dom and 'id="pareto-plot"' in dom and 'id="differences-table"' in dom
    assert "GFLOPs" in dom and "2 per multiply-add" in dom and "finished" in dom
    shot = tmp_path / "compare.png"
    chromium(tmp_path, "--window-size=1400,2400", f"--screenshot={shot}", page.as_uri())
    assert ImageStat.Stat(Image.open(shot).convert("L")).stddev[0] > 20, "the screenshot is not blank"


def test_editing_one_runs_key_reruns_that_run_only(sweep):
    work = sweep["work"]
    edited = {**SWEEP, "runs": {**RUNS, "timm": {"train": {**RUNS["timm"]["train"], "lr": 0.05}}}}
    (work / "edited.yaml").write_text(yaml.safe_dump(edited))
    proc = snakemake("-n", *command(work, "edited.yaml")[5:], cwd=work, snakefile=work / "Snakefile")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert scheduled_rules(proc.stdout) == {"train": 1, "evaluate": 1, "report": 1, "compare": 1}
    assert [rest.split()[1].rstrip(":") for rule, rest in job_headers(proc.stdout) if rule == "train"] == ["timm"]


def test_a_fourth_run_a_branch_from_an_epoch_checkpoint_trains_alone_and_names_its_parent(sweep):
    """Added to the sweep, the branch of tv from its epoch_0.pt is the only run the comparison needs
    trained (the dry-run), and trained (its own train target, to keep this test short) it trains epoch 1
    alone, from that checkpoint (train.resume_from), and its run.json names the parent."""
    work = sweep["work"]
    (work / "four.yaml").write_text(yaml.safe_dump({**SWEEP, "runs": {**RUNS, "branch": BRANCH}}))
    dry = snakemake("-n", *command(work, "four.yaml")[5:], cwd=work, snakefile=work / "Snakefile")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert scheduled_rules(dry.stdout) == {"train": 1, "evaluate": 1, "report": 1, "compare": 1}
    assert [rest.split()[1].rstrip(":") for rule, rest in job_headers(dry.stdout) if rule == "train"] == ["branch"]
    model = "results/demo/branch/train/model.pt"
    proc = subprocess.run(command(work, "four.yaml", target=model), cwd=work, env=env(), capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert [rule for rule, _ in job_headers(proc.stdout + proc.stderr)] == ["train"]
    branch = work / "results" / "demo" / "branch" / "train"
    parent = json.loads((branch / "run.json").read_text())["parent"]
    assert parent["run"] == "tv" and parent["epoch"] == 0 and parent["checkpoint"] == BRANCH["train"]["resume_from"]
    assert list(pd.read_csv(branch / "epochs.csv")["epoch"]) == [1], "it trains on from epoch 1"
    assert (
        "branching from results/demo/tv/train/checkpoints/epoch_0.pt (run tv, epoch 0)"
        in (work / "logs" / "train" / "demo" / "branch.log").read_text()
    )
