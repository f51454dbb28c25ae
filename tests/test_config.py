"""Bad configs fail before any job runs, and the message names the key and the bad value."""

import importlib.metadata
import json

import pytest
import yaml
from helpers import REPO, snakemake

from rectrain.config import ConfigError
from rectrain.snakefile.checks import check_config, known_models

SCHEMA = REPO / "config" / "schema.yaml"


def demo_config():
    with open(REPO / "config" / "config.yaml") as fh:
        return yaml.safe_load(fh)


BAD = {
    "wrong_type": ({"pack": {"resize": "abc"}}, ["pack.resize", "'abc'", "integer"]),
    "unknown_key": ({"train": {"learning_rate": 0.1}}, ["train.learning_rate", "unknown"]),
    "negative_size": ({"demo": {"min_size": -3}}, ["demo.min_size", "-3", "minimum"]),
    "missing_raw": ({"raw": "/nonexistent/ILSVRC2012"}, ["'raw'", "/nonexistent/ILSVRC2012", "no such directory"]),
    "fast_storage_is_file": ({"pack": {"fast_storage": "/etc/hostname/ssd"}}, ["pack.fast_storage", "not a directory"]),
    "bad_devices": ({"train": {"devices": "gpu0"}}, ["train.devices", "'gpu0'"]),
    "bad_precision": ({"train": {"precision": "fp8"}}, ["train.precision", "'fp8'"]),
    "bad_workers": ({"evaluate": {"workers": "many"}}, ["evaluate.workers", "'many'"]),
}


def merged(update):
    cfg = demo_config()
    for key, value in update.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_is_rejected_naming_the_key(name):
    update, expected = BAD[name]
    with pytest.raises(ConfigError) as info:
        check_config(merged(update), SCHEMA, workdir=REPO)
    for fragment in expected:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"


def test_numbers_snakemake_passes_as_strings_from_the_command_line_are_read_as_numbers():
    cfg = check_config(
        merged(
            {
                "train": {
                    "epochs": "1",
                    "lr": "0.05",
                    "batch_size": "auto",
                    "channels_last": "false",
                    "dali_preallocate": "[64, 48]",
                }
            }
        ),
        SCHEMA,
        workdir=REPO,
    )
    t = cfg["train"]
    assert (t["epochs"], t["lr"], t["batch_size"], t["channels_last"]) == (1, 0.05, "auto", False)
    assert t["dali_preallocate"] == [64, 48]
    with pytest.raises(ConfigError, match="pack.resize"):  # still no number: still refused, by key
        check_config(merged({"pack": {"resize": "abc"}}), SCHEMA, workdir=REPO)


def test_model_args_from_the_command_line_reach_the_constructor_as_a_config_file_types_them():
    """train.model_args is free-form (a constructor's keywords), so no schema types its values: --config's
    strings were handed on as strings ('0.1' to timm's drop_path_rate failed in torch.linspace)."""
    given = {"drop_path_rate": "0.1", "img_size": "32", "global_pool": "avg", "flag": "true", "sizes": ["1", "2"]}
    t = check_config(merged({"train": {"model_args": given}}), SCHEMA, workdir=REPO)["train"]
    assert t["model_args"] == {
        "drop_path_rate": 0.1,
        "img_size": 32,
        "global_pool": "avg",
        "flag": True,
        "sizes": [1, 2],
    }


def test_nested_command_line_config_reaches_the_rules(tmp_path):
    proc = snakemake(
        "-n",
        "--directory",
        str(tmp_path),
        "results/report.html",
        "--config",
        "train={epochs: 1, image_size: 32}",
        "demo={classes: 3}",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "is not of type" not in proc.stdout + proc.stderr


def test_demo_config_is_valid_and_defaults_are_filled():
    cfg = check_config(demo_config(), SCHEMA, workdir=REPO)
    assert cfg["train"]["precision"] in {"auto", "bf16", "fp16", "fp32"}
    assert cfg["pack"]["threads"] >= 1 and cfg["evaluate"]["workers"] >= 0


def test_reference_box_config_passes_every_check_without_a_warning(tmp_path, caplog):
    with open(REPO / "config" / "imagenet-2gpu.yaml") as fh:
        cfg = yaml.safe_load(fh)
    cfg["raw"] = str(tmp_path)  # its real paths do not exist here
    cfg["pack"]["fast_storage"] = str(tmp_path / "ssd")
    with caplog.at_level("WARNING", logger="rectrain.snakefile.checks"):
        filled = check_config(cfg, SCHEMA, workdir=REPO)
    assert [r.message for r in caplog.records] == [], "the shipped config must not need a warning"
    assert filled["evaluate"]["crop"] is None and filled["report"]["title"], "defaults were filled"


@pytest.mark.parametrize("name", ["wrong_type", "unknown_key", "negative_size", "missing_raw", "fast_storage_is_file"])
def test_snakemake_stops_before_any_job_on_bad_config(name, tmp_path):
    update, expected = BAD[name]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(merged(update)))
    work = tmp_path / "work"
    work.mkdir()
    proc = snakemake("--cores", "1", "--configfile", str(bad), "--directory", str(work), timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert expected[0] in out, out
    created = [p for p in work.rglob("*") if ".snakemake" not in p.parts]
    assert created == [], f"files created although the config is invalid: {created}"


# ---------------------------------------------------------------------------------------------
# Cross-checks: combinations every schema rule passes but a later job would fail on.


def refusal(update) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(merged(update), SCHEMA, workdir=REPO)
    return str(info.value)


@pytest.mark.parametrize(
    ("update", "key", "fix"),
    [
        ({"train": {"epochs": 2.0}}, "train.epochs", "write 2"),
        ({"train": {"dali_preallocate": [64.0, 48]}}, "train.dali_preallocate.0", "write 64"),
        ({"train": {"batch_size": 32.0}}, "train.batch_size", "write 32"),
    ],
)
def test_integer_key_given_a_float_is_refused_naming_the_key(update, key, fix):
    message = refusal(update)
    assert f"config key '{key}'" in message and "whole number" in message and fix in message, message


@pytest.mark.parametrize(
    "update", [{"raw": ""}, {"pack": {"fast_storage": ""}}, {"pack": {"local_storage": ""}}], ids=str
)
def test_empty_path_string_is_refused_naming_the_key(update):
    block, value = next(iter(update.items()))
    key = block if not isinstance(value, dict) else f"{block}.{next(iter(value))}"
    assert f"config key '{key}' is an empty string" in refusal(update)


def test_check_crop_above_check_resize_is_refused():
    message = refusal({"check": {"crop": 100, "resize": 90}})
    assert "config key 'check.crop' = 100 is larger than the image after 'check.resize' = 90" in message


def test_evaluate_crop_above_evaluate_resize_is_refused():
    message = refusal({"evaluate": {"crop": 100, "resize": 90}})
    assert "'evaluate.crop'" in message and "centre crop 100" in message and "'evaluate.resize' = 90" in message
    # crop: null means train.image_size, and the message says so
    message = refusal({"train": {"image_size": 64}, "evaluate": {"resize": 48}})
    assert "centre crop 64 (from train.image_size" in message, message


@pytest.mark.parametrize(
    "ramp, key, fix",
    [
        (dict(min_res=192, max_res=160, start_ramp=0, end_ramp=2), "progressive.min_res", "min_res <= max_res"),
        (dict(min_res=160, max_res=192, start_ramp=5, end_ramp=2), "progressive.start_ramp", "start_ramp <= end_ramp"),
    ],
)
def test_a_reversed_progressive_ramp_is_refused_naming_the_key_and_the_fix(ramp, key, fix):
    message = refusal({"train": {"progressive": ramp}})
    assert f"config key 'train.{key}'" in message and fix in message, message


def test_a_progressive_ramp_in_order_passes_the_checks():
    ramp = dict(min_res=32, max_res=64, start_ramp=0, end_ramp=2)
    assert check_config(merged({"train": {"progressive": ramp}}), SCHEMA, workdir=REPO)["train"]["progressive"] == ramp


def test_unknown_torchvision_model_is_refused_with_similar_names():
    message = refusal({"train": {"model": "resnet1000"}})
    assert "config key 'train.model' = 'resnet1000' is not a torchvision model" in message
    assert "resnet101" in message, message


def test_pack_resize_below_train_image_size_warns(caplog):
    with caplog.at_level("WARNING", logger="rectrain.snakefile.checks"):
        check_config(merged({"pack": {"resize": 32}, "train": {"image_size": 64}}), SCHEMA, workdir=REPO)
    assert any("'pack.resize' = 32" in r.message and "'train.image_size' = 64" in r.message for r in caplog.records)


def test_pack_resize_and_max_side_together_are_refused_naming_both_keys_and_the_fix():
    message = refusal({"pack": {"resize": 256, "max_side": 500}})
    assert "'pack.resize' = 256 and 'pack.max_side' = 500 are both set" in message
    assert "pack.resize: 0" in message and "pack.max_side: null" in message


def test_pack_max_side_whose_4_3_shorter_side_is_below_train_image_size_warns(caplog):
    with caplog.at_level("WARNING", logger="rectrain.snakefile.checks"):
        check_config(merged({"pack": {"max_side": 80}, "train": {"image_size": 64}}), SCHEMA, workdir=REPO)
        quiet = len(caplog.records)
        check_config(merged({"pack": {"max_side": 86}, "train": {"image_size": 64}}), SCHEMA, workdir=REPO)
    warned = [r.message for r in caplog.records[:quiet] if "'pack.max_side' = 80" in r.message]
    assert warned and "80x60" in warned[0] and "pack.max_side >= 86" in warned[0], warned
    assert not any("pack.max_side" in r.message for r in caplog.records[quiet:]), "86x64 holds a 64 px crop"


def test_a_ramp_the_epochs_end_before_and_a_pack_smaller_than_its_largest_crop_warn(caplog):
    ramp = dict(min_res=64, max_res=128, start_ramp=1, end_ramp=5)
    update = {"pack": {"resize": 80}, "train": {"image_size": 64, "epochs": 4, "progressive": ramp}}
    with caplog.at_level("WARNING", logger="rectrain.snakefile.checks"):
        check_config(merged(update), SCHEMA, workdir=REPO)
    messages = [r.message for r in caplog.records]
    # epochs 0-3 of a ramp 64 -> 128 over epochs 1-5: 64, 64, 80 rounded to 64 (half to even), 96
    assert any("'train.progressive.max_res' = 128 is never reached" in m and "96 px" in m for m in messages)
    assert any("'pack.resize' = 80" in m and "largest training crop 96 px" in m for m in messages), messages


def test_model_list_is_read_from_the_cache_for_this_torchvision_version(tmp_path, monkeypatch):
    version = importlib.metadata.version("torchvision")
    cache = tmp_path / "rectrain" / f"torchvision-{version}-models.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps(["only_this_model"]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert known_models() == {"only_this_model"}


def test_out_of_range_number_given_on_the_command_line_says_so(tmp_path):
    proc = snakemake("-n", "--directory", str(tmp_path), "--config", "train={batch_size: 0}", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "config key 'train.batch_size' = 0 is invalid: 0 is less than the minimum of 1" in out, out[-2000:]
    assert "is not of type" not in out


def command_line(*entries: str) -> dict:
    """What Snakemake makes of --config entries (YAML's BaseLoader: every scalar inside is a string)."""
    from snakemake.cli import parse_config

    return parse_config(list(entries))


def test_lists_and_nested_values_from_the_command_line_are_read_as_the_schema_types_them():
    given = command_line(
        "train={devices: [0, 1], dali_preallocate: [64, 48], epochs: 2}", "index={absent_splits: [val]}"
    )
    assert given["train"]["devices"] == ["0", "1"], "Snakemake hands list items over as strings"
    cfg = check_config(merged(given), SCHEMA, workdir=REPO)
    assert (cfg["train"]["devices"], cfg["train"]["dali_preallocate"], cfg["train"]["epochs"]) == ([0, 1], [64, 48], 2)
    assert cfg["index"]["absent_splits"] == ["val"]
    assert check_config(merged(command_line("train={devices: cpu}")), SCHEMA, workdir=REPO)["train"]["devices"] == "cpu"


def test_a_nullable_block_from_the_command_line_is_read_as_the_schema_types_its_keys():
    """train.progressive is null or a block: shortening a preset's schedule on the command line."""
    given = command_line("train={epochs: 3, progressive: {min_res: 32, max_res: 64, start_ramp: 0, end_ramp: 2}}")
    cfg = check_config(merged(given), SCHEMA, workdir=REPO)
    assert cfg["train"]["progressive"] == {"min_res": 32, "max_res": 64, "start_ramp": 0, "end_ramp": 2}
    off = check_config(merged(command_line("train={progressive: null}")), SCHEMA, workdir=REPO)
    assert off["train"]["progressive"] is None


def test_a_list_item_out_of_range_from_the_command_line_is_refused_for_its_value_not_its_type():
    with pytest.raises(ConfigError) as info:
        check_config(merged(command_line("train={devices: [0, -1]}")), SCHEMA, workdir=REPO)
    assert "config key 'train.devices' = [0, -1] is invalid: -1 is less than the minimum of 0" in str(info.value)
    assert "is not of type" not in str(info.value)


def test_a_device_list_on_the_command_line_reaches_the_dry_run(tmp_path):
    proc = snakemake("-n", "--directory", str(tmp_path), "results/report.html", "--config", "train={devices: [0]}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-2000:]
    assert "is not of type" not in out
