"""A sweep file expanded into named runs (rectrain.snakefile.sweep), each run's share of the GPUs and
cores (rectrain.snakefile.resources), the layout before runs had names (rectrain.snakefile.runlayout),
and the comparison page's pure parts (rectrain.report.compare): no pipeline runs here."""

import re
from types import SimpleNamespace

import pytest
from helpers import REPO, scheduled_rules, snakemake

from rectrain.config import ConfigError
from rectrain.report import compare
from rectrain.snakefile import resources, runlayout, sweep

BASE = {"dataset": "demo", "train": {"epochs": 4, "lr": 0.1}}


def expand(found: dict, given: dict = BASE) -> dict:
    """{run: its config} as the Snakefile merges them."""
    return {
        name: sweep.merge(given, overlay) for name, overlay in sweep.overlays(found, given.get("run", "main")).items()
    }


def test_no_sweep_is_the_one_run_the_config_names_main_by_default():
    assert sweep.overlays({}) == {"main": {}} and sweep.overlays({}, "wide") == {"wide": {}}


def test_named_runs_merge_base_then_their_overlay_and_take_their_name():
    runs = expand({"base": {"train": {"epochs": 2}}, "runs": {"a": {"train": {"lr": 0.2}}, "b": None}})
    assert runs["a"]["train"] == {"epochs": 2, "lr": 0.2} and runs["a"]["run"] == "a"
    assert runs["b"]["train"] == {"epochs": 2, "lr": 0.1} and BASE["train"] == {"epochs": 4, "lr": 0.1}


def test_a_grid_is_every_combination_named_after_its_values_and_crossed_with_named_runs():
    runs = expand({"grid": {"train.lr": [0.1, 0.2], "train.epochs": [1]}})
    assert sorted(runs) == ["lr-0.1_epochs-1", "lr-0.2_epochs-1"]
    assert runs["lr-0.2_epochs-1"]["train"] == {"epochs": 1, "lr": 0.2}
    crossed = expand({"runs": {"rn": {"train": {"model": "resnet18"}}}, "grid": {"train.lr": [0.3]}})
    assert list(crossed) == ["rn_lr-0.3"] and crossed["rn_lr-0.3"]["train"]["model"] == "resnet18"


@pytest.mark.parametrize(
    ("found", "said"),
    [
        ({"runs": {"a": {"pack": {"quality": 50}}}}, "run 'a' sets pack: a run may set only"),
        ({"base": {"dataset": "other"}}, "sweep base sets dataset"),
        ({"runs": {"index": {}}}, "run name 'index' cannot name a run's folder"),
        ({"runs": {"a b": {}}}, "run name 'a b' cannot name"),
        ({"runs": {}, "grid": {}}, "neither runs: nor grid: names a run"),
        ({"grid": {"train.lr": 0.1}}, "sweep grid: expected {dotted.key: [value, ...]}"),
    ],
)
def test_a_sweep_that_cannot_be_run_is_refused_naming_the_key_and_the_fix(found, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        sweep.overlays(found)


def settings(cores, gpu=None):
    return SimpleNamespace(cores=cores, resources={} if gpu is None else {"gpu": SimpleNamespace(value=gpu)})


def test_a_run_takes_its_gpus_as_slots_and_its_share_of_the_cores_under_resources_gpu():
    assert resources.run_slots("cpu") == 1 and resources.run_slots([0, 1]) == 2 and resources.run_slots([3, 3]) == 1
    assert resources.train_threads(settings(8), [0]) == 8, "no --resources gpu: every core"
    assert resources.train_threads(settings(8, gpu=2), [0]) == 4, "two 1-GPU runs side by side"
    assert resources.train_threads(settings(8, gpu=2), [0, 1]) == 8
    assert resources.train_threads(settings(2, gpu=2), "cpu") == 1


def test_the_layout_before_runs_had_names_is_found_and_one_line_says_how_to_keep_it(tmp_path, caplog):
    assert runlayout.legacy_layout_line("demo", "main", tmp_path) is None
    (tmp_path / "demo" / "train" / "checkpoints").mkdir(parents=True)
    (tmp_path / "demo" / "report.html").write_text("old")
    line = runlayout.legacy_layout_line("demo", "main", tmp_path)
    assert f"mv {tmp_path}/demo/train {tmp_path}/demo/main/train" in line
    assert f"mv {tmp_path}/demo/report.html {tmp_path}/demo/main/report.html" in line and "eval" not in line
    assert line in caplog.text and (tmp_path / "demo" / "train").is_dir(), "said, nothing moved"


def test_the_config_differences_name_each_key_that_differs_and_the_pareto_front_drops_the_beaten_runs():
    found = compare.differences(
        {"a": {"run": "a", "train": {"lr": 0.1, "model": "x"}}, "b": {"run": "b", "train": {"lr": 0.2, "model": "x"}}}
    )
    assert found == [{"key": "train.lr", "values": [0.1, 0.2]}]
    rows = [
        {"name": n, "top1": a, "img_s": s} for n, a, s in [("fast", 50, 900), ("good", 80, 300), ("worse", 49, 800)]
    ]
    assert compare.pareto(rows) == ["fast", "good"]


def test_a_sweep_dry_run_plans_one_train_evaluate_and_report_per_run_and_the_comparison(tmp_path):
    (tmp_path / "sweep.yaml").write_text("runs:\n  a: {train: {lr: 0.1}}\n  b: {train: {lr: 0.2}}\n")
    proc = snakemake("-n", "--directory", str(tmp_path), "--configfile", str(tmp_path / "sweep.yaml"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = scheduled_rules(proc.stdout)
    assert {k: planned[k] for k in ("train", "evaluate", "report", "compare")} == {
        "train": 2,
        "evaluate": 2,
        "report": 2,
        "compare": 1,
    }
    assert "results/demo/a/train" in proc.stdout and "results/demo/b/report.html" in proc.stdout
    assert REPO.joinpath("config", "sweeps", "backbones.yaml").is_file()


def test_a_resume_from_that_names_no_file_is_refused_while_parsing_naming_the_key(tmp_path):
    from rectrain.snakefile.checks import resume_from_problems

    (found,) = resume_from_problems(str(tmp_path / "gone.pt"))
    assert "config key 'train.resume_from'" in found and "no such file" in found and "epoch_<k>.pt" in found
    (tmp_path / "epoch_1.pt").write_bytes(b"x")
    assert resume_from_problems(str(tmp_path / "epoch_1.pt")) == [] and resume_from_problems(None) == []
