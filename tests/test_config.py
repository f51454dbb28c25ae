"""Bad configs fail before any job runs, and the message names the key and the bad value."""

import pytest
import yaml
from helpers import REPO, snakemake

from rectrain.config import ConfigError, check_config

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
    assert cfg["train"]["precision"] in {"bf16", "fp16", "fp32"}
    assert cfg["pack"]["threads"] >= 1 and cfg["evaluate"]["workers"] >= 0


def test_reference_box_config_is_valid_except_its_raw_path(tmp_path):
    with open(REPO / "config" / "imagenet-2gpu.yaml") as fh:
        cfg = yaml.safe_load(fh)
    cfg["raw"] = str(tmp_path)
    cfg["pack"]["fast_storage"] = str(tmp_path / "ssd")
    check_config(cfg, SCHEMA, workdir=REPO)


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
