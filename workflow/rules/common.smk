# Shared set-up for every stage: config validation, names and paths all rules agree on.
import json
import os
import sys
from pathlib import Path

# The rules run `python -m rectrain.<stage>`: make the package importable (also in conda envs,
# where it is not pip-installed) and make jobs use this interpreter unless a conda env is active.
_PKG_DIR = str(Path(workflow.basedir) / "workflow")
sys.path.insert(0, _PKG_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_DIR, os.environ.get("PYTHONPATH")) if p)
os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))

from rectrain.config import ConfigError, check_config

try:
    check_config(config, Path(workflow.basedir) / "config" / "schema.yaml")
except ConfigError as err:
    raise WorkflowError(str(err)) from None

DS = config["dataset"]
DEMO_ROOT = "results/demo/raw"
RAW_ROOT = config["raw"] or DEMO_ROOT
# Where the .rec/.idx pairs live: the user's SSD, per dataset.
FAST = f"{config['pack']['fast_storage'].rstrip('/')}/{DS}"
SPLITS = ["train", "val"]
ENV = "../../envs/rectrain.yaml"


def cfg_json(block):
    """The config block a rule depends on, as its params: a change here reruns that rule only."""
    return json.dumps(config[block], sort_keys=True)
