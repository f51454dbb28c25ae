"""A model of the test's own through the whole pipeline (issue 33 item 1): a network defined in
tests/helpers/own_model/net.py (copied into the scratch working directory as nets/, with the local module
it imports) trains with DDP over two CPU processes, is stopped mid-epoch by `make stop` (SIGTERM to the
Snakemake process alone) and resumed by the same command, is evaluated through its published weights, and the report names it as configured.
A second pipeline run in the same folder while the training goes on leaves `make stop` finding the
training (issue 47 item 6); evaluate refuses the run once its model file is edited (item 7).
Editing its file or its local import reruns train, evaluate and report; editing another file there
reruns nothing; changing train.model_args retrains."""

import os
import re
import shutil
import subprocess
import time

import pytest
import yaml
from helpers import (
    REPO,
    VENV_BIN,
    copy_workflow,
    job_headers,
    launcher_of,
    readme_python,
    scheduled_rules,
    snakemake,
    tiny_demo,
    tiny_train,
)
from helpers.browser import CHROMIUM, NO_CHROMIUM, chromium

from rectrain.snakefile import runs
from rectrain.train.lifecycle import faults
from rectrain.train.lifecycle.status import EXIT_STOPPED

pytestmark = pytest.mark.slow

MODEL = "nets/net.py:tiny"
TINY = {
    "demo": tiny_demo(train_per_class=24),
    "train": tiny_train(
        model=MODEL,
        # steps of ~0.3 s: long enough to signal the job inside epoch 1
        model_args={"width": 8, "step_delay_s": 0.3},
        zero_init_residual=False,
        optimizer="adamw",
        lr=0.002,
        weight_decay=0.05,
        cpu_processes=2,
        epochs=2,
        batch_size=4,
        calibration_steps=1,
        progress_s=1,
    ),
}
REPORT = "results/demo/main/report.html"


def smk(work, *args, timeout=600):
    return snakemake("--directory", str(work), *args, "--configfile", str(work / "own.yaml"),
                     cwd=work, snakefile=work / "Snakefile", timeout=timeout)  # fmt: skip


def dry_run(work) -> set[str]:
    proc = smk(work, "-n", REPORT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return set(scheduled_rules(proc.stdout))


LIVE = "results/demo/main/live.html"


def make(work, *targets, timeout=300):
    """This checkout's Makefile run in `work`, with the test interpreter's environment as its VENV."""
    venv = VENV_BIN.parent
    cmd = ["make", "-f", str(REPO / "Makefile"), "-o", f"{venv}/.installed", f"VENV={venv}", *targets]
    return subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout)


def rendered(tmp_path, page) -> tuple[str, list[str]]:
    """A live page's banner and the epochs of its epoch table, as Chromium renders it."""
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    start = dom.index('<div id="live-banner"')
    table = dom[dom.index('<section id="learning">') : dom.index('<section id="classes">')]
    return dom[start : dom.index("</div>", start)], re.findall(r"<tr[^>]*>\s*<td>(\d+)", table)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The tiny pipeline with the test's own model, its live page built while rank 0 waits after epoch
    1's second step (faults.PAUSE_AT_ENV: until a stop signal), stopped there by `make stop` (the run ends
    in one line, status 75), and finished by the same command."""
    work = copy_workflow(tmp_path_factory.mktemp("own_model"))
    shutil.copytree(REPO / "tests" / "helpers" / "own_model", work / "nets")
    (work / "own.yaml").write_text(yaml.safe_dump(TINY))
    args = [str(VENV_BIN / "snakemake"), "--snakefile", str(work / "Snakefile"), "--directory", str(work)]
    command = [*args, "--cores", "2", REPORT, "--configfile", str(work / "own.yaml")]
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    # rank 0 waits after epoch 1's second step until the stop signal: the second pipeline runs meanwhile
    paused = dict(env, **{faults.PAUSE_AT_ENV: f"0:1:1:{work / 'no-gate'}"})
    first = subprocess.Popen(command, cwd=work, env=paused, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 900
    launcher_of(first, deadline)
    steps = work / "results" / "demo" / "main" / "train" / "telemetry" / "steps_rank0.csv"
    # steps_rank0.csv rows: rank, epoch, step, ...
    while not (steps.is_file() and any(line.startswith("0,1,") for line in steps.read_text().splitlines())):
        assert first.poll() is None and time.monotonic() < deadline, "the train job never reached epoch 1"
        time.sleep(0.05)
    # A second pipeline in the same folder (another dataset's demo images) runs and ends during the training
    second = subprocess.run([*args, "--cores", "1", "results/other/raw/.done", "--configfile", str(work / "own.yaml"),
                             "--config", "dataset=other"], cwd=work, env=env, capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    built = make(work, "live", "CONFIG=own.yaml")
    assert built.returncode == 0 and "In progress: epoch 1 (of 2)" in built.stderr, built.stdout + built.stderr
    # `make stop` from another shell: SIGTERM to the Snakemake process of each run registered in this folder
    stop = subprocess.run(["make", "-f", str(REPO / "Makefile"), "stop"], cwd=work, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert stop.stdout.splitlines() == [
        f"make stop: asked Snakemake (pid {first.pid}) to stop; it ends after training's checkpoint"
    ], stop.stdout + stop.stderr
    out, _ = first.communicate(timeout=600)
    assert runs.runs_here(work) == [], "each run's entry goes with its Snakemake"
    log_file = work / "logs" / "train" / "demo" / "main.log"
    stopped_at = re.search(r"it resumes at (epoch 1 step \d+)", log_file.read_text()).group(1)
    assert first.returncode == EXIT_STOPPED and "Error in rule" not in out, out[-8000:]
    assert out.strip().splitlines()[-1].startswith("[rectrain] stopped on SIGTERM after epoch 1 step "), out[-3000:]
    assert out.strip().endswith(f"continue at {stopped_at} (exit status 75: stopped, resumable)"), out[-3000:]
    # the live page the run left behind (made again as it ended), and `make live` after `make stop`
    shutil.copy(work / LIVE, work / "left-behind.html")
    again = make(work, "live", "CONFIG=own.yaml")
    assert again.returncode == 0, again.stdout + again.stderr
    shutil.copy(work / LIVE, work / "make-live.html")
    rerun = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"continuing at {stopped_at}" in log_file.read_text()
    return work


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_after_make_stop_the_live_page_left_behind_and_make_live_show_the_stopped_banner_and_epoch_0(work, tmp_path):
    """Snakemake removed the stopped job's outputs (run.json among them); the page the run left behind
    was made again as it ended, and `make live` after `make stop` reads what survives: both say Stopped
    at the step it stopped (no stale "In progress"), with epoch 0's row, in Chromium."""
    stopped_at = re.search(r"continuing at epoch 1 step (\d+)", (work / "logs/train/demo/main.log").read_text()).group(
        1
    )
    for page in ("left-behind.html", "make-live.html"):
        banner, epochs = rendered(tmp_path, work / page)
        assert 'class="live-stopped"' in banner and f"Stopped at epoch 1 (of 2) step {stopped_at}/9" in banner, banner
        assert "In progress" not in banner and epochs == ["0"], (page, epochs)


def test_own_model_trains_over_two_processes_resumes_after_make_stop_is_evaluated_and_reported(work):
    import json

    results = work / "results" / "demo" / "main"
    run = json.loads((results / "train" / "run.json").read_text())
    assert run["model"] == MODEL and run["world_size"] == 2, run
    metrics = json.loads((results / "eval" / "metrics.json").read_text())
    published = json.loads((results / "train" / "weights.json").read_text())
    assert metrics["images"] == 6 and published["top1"] == metrics["top1"]
    assert published["model"] == MODEL and published["model_args"] == TINY["train"]["model_args"]
    assert MODEL in (work / REPORT).read_text()
    assert dry_run(work) == set(), "a finished run is up to date"


def test_editing_the_model_or_its_local_import_reruns_train_evaluate_report_and_another_file_nothing(work):
    downstream = {"train", "evaluate", "report"}
    for name in ("net.py", "blocks.py"):
        f = work / "nets" / name
        original = f.read_text()
        f.write_text(original + "\n# edited\n")
        assert dry_run(work) == downstream, name
        f.write_text(original)
    unrelated = work / "nets" / "unrelated.py"
    unrelated.write_text(unrelated.read_text() + "# edited\n")
    assert dry_run(work) == set()


def test_changing_train_model_args_retrains(work):
    edited = {**TINY, "train": {**TINY["train"], "model_args": {"width": 12, "step_delay_s": 0.3}}}
    (work / "args.yaml").write_text(yaml.safe_dump(edited))
    proc = snakemake("--directory", str(work), "-n", REPORT, "--configfile", str(work / "args.yaml"),
                     cwd=work, snakefile=work / "Snakefile")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(scheduled_rules(proc.stdout)) == {"train", "evaluate", "report"}


def test_own_models_weights_loaded_by_the_readme_lines_in_a_fresh_process_give_the_evaluate_stage_logits(
    work, tmp_path, monkeypatch
):
    """README's rectrain.model.load_weights lines, in a new process in the working directory, rebuild
    the network of the test's own file from weights.safetensors and give the evaluate stage's logits."""
    import torch

    from rectrain import metrics, weights
    from rectrain.evaluate import model_from_weights
    from rectrain.train.lifecycle.checkpoint import load

    monkeypatch.chdir(work)  # train.model's file is relative to the working directory
    path = "results/demo/main/train/" + weights.FILE
    torch.manual_seed(0)
    batch = torch.randn(4, 3, 32, 32)
    torch.save(batch, tmp_path / "batch.pt")
    with torch.inference_mode():  # fp32: the run's precision
        expected = metrics.predict(model_from_weights(path, load("results/demo/main/train/model.pt")), batch)
    # a model of your own: its factory named, README's example file being this run's
    rectrain_lines = readme_python("Using the trained weights")[2].replace("nets/mynet.py:build", MODEL)
    assert MODEL in rectrain_lines
    script = rectrain_lines + (
        f"import torch\nwith torch.inference_mode():\n"
        f"    torch.save(model(torch.load({str(tmp_path / 'batch.pt')!r})), {str(tmp_path / 'out.pt')!r})\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    proc = subprocess.run([str(VENV_BIN / "python"), "-c", script], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=0, atol=1e-5)


def test_evaluate_refuses_the_run_once_its_model_file_is_edited_and_publishes_nothing(work, tmp_path):
    """Issue 47 item 7: the model file edited after training imported it (a sign flip appended): the
    evaluate stage's process refuses in one line, naming the file and the fix, instead of measuring the
    edited network on the trained weights."""
    net = work / "nets" / "net.py"
    original = net.read_text()
    train, fast = work / "results" / "demo" / "main" / "train", work / "results" / "fast_storage" / "demo"
    argv = [
        "--config-json",
        "{}",
        "--checkpoint",
        str(train / "model.pt"),
        "--weights",
        str(train / "weights.safetensors"),
    ]
    argv += [
        "--weights-json",
        str(tmp_path / "weights.json"),
        "--rec",
        str(fast / "val.rec"),
        "--idx",
        str(fast / "val.idx"),
    ]
    argv += ["--classes", str(work / "results" / "demo" / "index" / "classes.tsv"), "--out", str(tmp_path / "eval")]
    flip = "\n_trained = tiny\n\n\ndef tiny(*args, **kwargs):\n    net = _trained(*args, **kwargs)\n"
    flip += "    net.register_forward_hook(lambda module, args, out: -out)\n    return net\n"
    try:
        net.write_text(original + flip)
        proc = subprocess.run([str(VENV_BIN / "python"), "-m", "rectrain.evaluate", *argv, "--single-process"],
                              cwd=work, capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        net.write_text(original)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"{net} changed since training imported it" in proc.stderr and "--forcerun train" in proc.stderr
    assert not (tmp_path / "weights.json").exists() and not (tmp_path / "eval" / "metrics.json").exists()


def test_a_timm_model_trains_is_evaluated_through_its_weights_and_loads_with_timm_alone(work):
    """The same data, train.model: timm:resnet18 (zero_init_residual through timm's zero_init_last):
    train, evaluate and report run; weights.json's top-1 is the evaluate stage's, and the file loads
    strictly into timm.create_model(name, num_classes=K)."""
    import json

    import timm
    from safetensors.torch import load_file

    cfg = {**TINY, "train": {**TINY["train"], "model": "timm:resnet18", "model_args": {}, "zero_init_residual": True}}
    (work / "timm.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake("--directory", str(work), "--cores", "2", REPORT, "--configfile", str(work / "timm.yaml"),
                     cwd=work, snakefile=work / "Snakefile", timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {rule for rule, _ in job_headers(proc.stdout + proc.stderr)} >= {"train", "evaluate", "report"}
    results = work / "results" / "demo" / "main"
    published = json.loads((results / "train" / "weights.json").read_text())
    metrics = json.loads((results / "eval" / "metrics.json").read_text())
    assert published["model"] == "timm:resnet18" and published["top1"] == metrics["top1"]
    net = timm.create_model("resnet18", num_classes=published["num_classes"])
    net.load_state_dict(load_file(str(results / "train" / "weights.safetensors")), strict=True)
    assert "timm:resnet18" in (work / REPORT).read_text()
