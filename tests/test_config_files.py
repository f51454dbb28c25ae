"""How config files combine, as Snakemake parses the real Snakefile: the demo's settings
(config/config.yaml) apply only to the generated demo (raw null); a config with a raw root of its own
gets the schema's defaults. docs/configuration.md, "How config files combine"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import REPO, copy_workflow, snakemake

from rectrain.config import load_schema

SCHEMA = load_schema(REPO / "config" / "schema.yaml")
DEMO = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
MARK = "PROBE-CONFIG "


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """A copy of the workflow plus probe.smk: the real Snakefile, then the config it ended with."""
    work = tmp_path_factory.mktemp("probe")
    copy_workflow(work)
    (work / "probe.smk").write_text(f'include: "Snakefile"\n\n\nprint("{MARK}" + json.dumps(config))\n')
    return work


def parsed_config(probe: Path, *args: str) -> dict:
    proc = snakemake("-n", *args, cwd=probe, snakefile=probe / "probe.smk", timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith(MARK))
    return json.loads(line[len(MARK) :])


def schema_default(block: str, key: str):
    return SCHEMA["properties"][block]["properties"][key]["default"]


# The keys config/config.yaml tunes for the demo away from the schema's defaults.
DEMO_TUNED = [
    (block, key)
    for block, values in DEMO.items()
    if isinstance(values, dict)
    for key, value in values.items()
    if value != schema_default(block, key)
]


def test_the_demo_config_tunes_keys_away_from_the_schema_defaults():
    assert ("report", "title") in DEMO_TUNED and ("train", "calibration_steps") in DEMO_TUNED, DEMO_TUNED


def test_a_config_with_only_raw_and_dataset_gets_the_schema_defaults_not_the_demo_settings(probe, tmp_path):
    (tmp_path / "mydata" / "train" / "cat").mkdir(parents=True)
    own = tmp_path / "mine.yaml"
    own.write_text(yaml.safe_dump({"dataset": "mydata", "raw": str(tmp_path / "mydata")}))
    cfg = parsed_config(probe, "--configfile", str(own))
    got = {(block, key): cfg[block][key] for block, key in DEMO_TUNED}
    assert got == {(block, key): schema_default(block, key) for block, key in DEMO_TUNED}
    assert "demo" not in cfg["report"]["title"]


def test_a_config_with_its_own_raw_trains_at_imagenet_size_unless_it_says_otherwise(probe, tmp_path):
    """The schema's train defaults are a real run's (224 px, 90 epochs), the demo's 64 px and 4 epochs
    are config/config.yaml's; a key the config sets still wins."""
    (tmp_path / "mydata" / "train" / "cat").mkdir(parents=True)
    own = tmp_path / "mine.yaml"
    own.write_text(yaml.safe_dump({"dataset": "mydata", "raw": str(tmp_path / "mydata"), "train": {"epochs": 3}}))
    train = parsed_config(probe, "--configfile", str(own))["train"]
    assert (train["image_size"], train["epochs"]) == (224, 3)
    assert (DEMO["train"]["image_size"], DEMO["train"]["epochs"]) == (64, 4), "the demo keeps its own sizes"


def test_without_a_config_file_the_run_is_the_demo_with_its_settings(probe):
    cfg = parsed_config(probe)
    assert cfg["dataset"] == "demo" and cfg["raw"] is None
    assert {(b, k): cfg[b][k] for b, k in DEMO_TUNED} == {(b, k): DEMO[b][k] for b, k in DEMO_TUNED}


def test_a_generated_demo_of_another_config_gets_the_demo_settings_under_its_own(probe):
    """config/gpu.yaml (raw null) is a demo too: its keys win, the demo's fill the rest."""
    cfg = parsed_config(probe, "--configfile", "config/gpu.yaml")
    assert (cfg["dataset"], cfg["report"]["title"], cfg["train"]["image_size"]) == (
        "gpudemo",
        "rectrain GPU check",
        224,
    )
    assert cfg["train"]["calibration_steps"] == DEMO["train"]["calibration_steps"]


def test_a_raw_root_without_a_dataset_name_is_refused_naming_the_key(probe, tmp_path):
    own = tmp_path / "unnamed.yaml"
    own.write_text(yaml.safe_dump({"raw": str(tmp_path)}))
    proc = snakemake("-n", "--configfile", str(own), cwd=probe, snakefile=probe / "Snakefile", timeout=180)
    assert proc.returncode != 0
    assert "config key 'dataset' = 'demo' with raw" in proc.stdout + proc.stderr
    assert "(e.g. dataset: mydata)" in proc.stdout + proc.stderr
