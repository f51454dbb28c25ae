"""Path keys expand `~` and environment variables (issue 24, point 2), and errors about a path show it
as written and as expanded."""

import os
import re
from pathlib import Path

import pytest
import yaml
from helpers import REPO, snakemake

from rectrain.config import ConfigError, load_schema, path_keys, stage_block
from rectrain.snakefile.checks import check_config

SCHEMA = REPO / "config" / "schema.yaml"


def demo_config() -> dict:
    with open(REPO / "config" / "config.yaml") as fh:
        return yaml.safe_load(fh)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """HOME and two variables pointing into tmp_path; the model-name cache stays where it was."""
    home = tmp_path / "home"
    (home / "data" / "raw").mkdir(parents=True)
    monkeypatch.setenv("XDG_CACHE_HOME", os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RECTRAIN_TEST_SSD", str(tmp_path / "ssd"))
    monkeypatch.setenv("RECTRAIN_TEST_SCRATCH", str(tmp_path / "scratch"))
    return home


def test_tilde_and_variables_in_every_path_key_are_expanded_by_the_config_loader(home, tmp_path):
    cfg = demo_config()
    cfg["raw"] = "~/data/raw"
    cfg["pack"] = {"fast_storage": "$RECTRAIN_TEST_SSD/fast", "local_storage": "${RECTRAIN_TEST_SCRATCH}/stage"}
    filled = check_config(cfg, SCHEMA, workdir=REPO)
    assert filled["raw"] == str(home / "data" / "raw")
    assert filled["pack"]["fast_storage"] == str(tmp_path / "ssd" / "fast")
    assert filled["pack"]["local_storage"] == str(tmp_path / "scratch" / "stage")
    # a stage completing its own block (the job side) expands the same way
    block = stage_block("pack", '{"local_storage": "~/stage"}', SCHEMA)
    assert block["local_storage"] == str(home / "stage")


def test_every_key_named_like_a_path_is_marked_x_path_so_it_is_expanded():
    schema = load_schema(SCHEMA)
    marked = {".".join(k) for k in path_keys(schema)}
    byo = {f"recordio.{split}.{kind}" for split in ("train", "val") for kind in ("rec", "idx", "lst")}
    assert marked == {
        "raw",
        "pack.fast_storage",
        "pack.local_storage",
        "index.allow_outside_root",
        "recordio.classes",
        "train.init_weights",
        "train.resume_from",
        "check.weights",
        *byo,
    }

    def named_like_paths(spec, path=()):
        for name, sub in spec.get("properties", {}).items():
            if re.search(r"(^raw$|_storage$|_dir$|_path$|_root$|_file$|_folder$)", name):
                yield ".".join((*path, name))
            yield from named_like_paths(sub, (*path, name))

    assert set(named_like_paths(schema)) <= marked, "a new path key needs x-path: true in config/schema.yaml"


def test_missing_raw_shows_the_path_as_written_and_as_expanded(home):
    cfg = demo_config()
    cfg["raw"] = "~/data/missing"
    with pytest.raises(ConfigError) as err:
        check_config(cfg, SCHEMA, workdir=REPO)
    assert f"config key 'raw' = '~/data/missing' (expanded: {home}/data/missing): no such directory" in str(err.value)


def test_unwritable_fast_storage_shows_the_path_as_written_and_as_expanded(home, monkeypatch):
    monkeypatch.setenv("RECTRAIN_TEST_SSD", "/etc/hostname")
    cfg = demo_config()
    cfg["pack"] = {"fast_storage": "$RECTRAIN_TEST_SSD/ssd"}
    with pytest.raises(ConfigError) as err:
        check_config(cfg, SCHEMA, workdir=REPO)
    assert (
        "config key 'pack.fast_storage' = '$RECTRAIN_TEST_SSD/ssd' (expanded: /etc/hostname/ssd): "
        "/etc/hostname is a file, not a directory."
    ) in str(err.value)


def test_unset_variable_in_a_path_key_is_refused_naming_the_key_and_the_variable(home, monkeypatch):
    monkeypatch.delenv("RECTRAIN_TEST_UNSET", raising=False)
    cfg = demo_config()
    cfg["pack"] = {"fast_storage": "${RECTRAIN_TEST_UNSET}/ssd"}
    with pytest.raises(ConfigError) as err:
        check_config(cfg, SCHEMA, workdir=REPO)
    assert (
        "config key 'pack.fast_storage' = '${RECTRAIN_TEST_UNSET}/ssd' names the environment variable(s) "
        "RECTRAIN_TEST_UNSET, not set where the config is read"
    ) in str(err.value)


def test_dry_run_reads_a_raw_root_and_fast_storage_given_with_tilde_and_a_variable(home, tmp_path):
    for split in ("train", "val"):
        (home / "data" / "raw" / split / "c0").mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    proc = snakemake(
        "-n",
        "-p",
        "--directory",
        str(work),
        "results/report.html",
        "--config",
        "raw=~/data/raw",
        "dataset=mine",
        "pack={fast_storage: $RECTRAIN_TEST_SSD}",
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"--raw {home}/data/raw " in out, "the index rule reads the expanded raw root"
    assert f"{tmp_path}/ssd/mine/train.rec" in out, "the pack writes under the expanded fast storage"


def test_path_key_whose_variable_is_empty_is_refused(home, monkeypatch):
    monkeypatch.setenv("RECTRAIN_TEST_EMPTY", "")
    cfg = demo_config()
    cfg["raw"] = "$RECTRAIN_TEST_EMPTY"
    with pytest.raises(ConfigError, match="config key 'raw' = '\\$RECTRAIN_TEST_EMPTY' expands to an empty path"):
        check_config(cfg, SCHEMA, workdir=REPO)
