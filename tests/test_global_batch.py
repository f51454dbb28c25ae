"""The recipe's global batch with any batch setting (issue 36): with train.global_batch set, a number in
train.batch_size is the per-device micro-batch and grad_accum is derived to keep the global batch; a
global batch that no grad_accum keeps is refused before any job, naming the nearest settings that do."""

import pytest
from helpers import REPO
from helpers.config_edits import filled
from helpers.train_data import train_settings

from rectrain import settings
from rectrain.config import ConfigError
from rectrain.snakefile.checks import check_config
from rectrain.train import batchplan
from rectrain.train.globalbatch import global_batch_problems

DEMO = REPO / "config" / "config.yaml"
RECIPES = REPO / "config" / "recipes"
TWO_CPU = {"batch_size": 64, "devices": "cpu", "cpu_processes": 2}


def preset_with(name: str, **train) -> dict:
    """The demo config with preset `name` over it and `train` after it, as `--config train=...` merges."""
    cfg = filled(DEMO, RECIPES / f"{name}.yaml")
    cfg["train"].update(train)
    return cfg


@pytest.mark.parametrize("name, accum", [("rn18-16ep", 8), ("rn50-88ep", 32)])
def test_a_preset_with_batch_size_64_on_two_cpu_processes_plans_the_presets_global_batch(name, accum):
    """rn18-16ep: 1024 = 64 x 8 x 2; rn50-88ep: 4096 = 64 x 32 x 2 (before: 64 x 1 x 2 = 128, another recipe)."""
    cfg = preset_with(name, **TWO_CPU)
    s = settings.train(cfg["train"])
    assert global_batch_problems(s.batch, s.launch) == []
    plan = batchplan.plan(s.batch, 2)
    assert (plan.batch, plan.grad_accum, plan.world_size) == (64, accum, 2)
    assert plan.global_batch == cfg["train"]["global_batch"] == batchplan.recipe_global_batch(s.batch)
    assert f"grad_accum {accum} (derived)" in plan.reason


def test_an_indivisible_global_batch_is_refused_before_any_job_naming_the_nearest_settings():
    """1024 over 2 processes is 512 per device: 96 divides it not; 64 and 128 do, as do the global
    batches 960 and 1152 around it (multiples of 96 x 2)."""
    cfg = preset_with("rn18-16ep", **{**TWO_CPU, "batch_size": 96})
    with pytest.raises(ConfigError) as err:
        check_config(cfg, workdir=REPO)
    text = str(err.value)
    assert "nothing was run" in text and "'train.global_batch' = 1024" in text and "96 x 2 process(es) = 192" in text
    assert "train.batch_size: 64 (grad_accum 8) or 128 (grad_accum 4)" in text
    assert "train.global_batch: 960 (grad_accum 5) or 1152 (grad_accum 6)" in text


def test_a_global_batch_the_processes_do_not_divide_names_only_global_batches_that_work():
    train = settings.train(preset_with("rn18-16ep", **{**TWO_CPU, "cpu_processes": 3})["train"])
    [problem] = global_batch_problems(train.batch, train.launch)
    assert "train.batch_size:" not in problem, "no per-device batch splits 1024 over 3 processes"
    assert "train.global_batch: 960 (grad_accum 5) or 1152 (grad_accum 6)" in problem


def test_a_grad_accum_that_contradicts_the_derived_one_is_refused():
    train = settings.train(preset_with("rn18-16ep", **TWO_CPU, grad_accum=4)["train"])
    [problem] = global_batch_problems(train.batch, train.launch)
    assert "'train.grad_accum' = 4" in problem and "needs grad_accum 8" in problem


def test_devices_auto_is_checked_with_the_gpus_here_and_not_guessed_while_parsing():
    """A GPU count is known to the onstart hook (prestart), not to the parse: None is 'unknown'."""
    train = settings.train(preset_with("rn18-16ep", batch_size=96, devices="auto", cpu_processes=2)["train"])
    assert global_batch_problems(train.batch, train.launch) == []
    assert "96 x 2 process(es)" in global_batch_problems(train.batch, train.launch, gpus_here=0)[0], "no GPU"
    assert "96 x 4 process(es)" in global_batch_problems(train.batch, train.launch, gpus_here=4)[0]
    larger = train.replaced(batch_size=128)
    assert global_batch_problems(larger.batch, larger.launch, gpus_here=4) == []


def test_every_rank_refuses_a_world_size_that_cannot_keep_the_global_batch():
    """Started another way (a launcher, another machine's GPUs), the plan itself refuses."""
    batch = train_settings({"batch_size": 64, "global_batch": 1024, "grad_accum": 1}).batch
    assert batchplan.plan(batch, 4).grad_accum == 4
    with pytest.raises(ConfigError, match=r"64 x 3 process\(es\) = 192"):
        batchplan.plan(batch, 3)


def test_without_global_batch_a_number_keeps_its_grad_accum_and_records_no_recipe_batch():
    batch = train_settings({"batch_size": 64, "global_batch": None, "grad_accum": 2}).batch
    plan = batchplan.plan(batch, 2)
    assert (plan.grad_accum, plan.global_batch, batchplan.recipe_global_batch(batch)) == (2, 256, None)
