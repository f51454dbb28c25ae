"""Config validation that fails before any job runs, naming the key and the bad value.

Snakemake's `validate` fills the schema defaults; when it rejects a config we re-walk the same
schema with jsonschema (the library Snakemake uses) only to turn its errors into one line per key,
because the raw message buries the key under a dump of the schema.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jsonschema
import yaml

# config/schema.yaml of this checkout: every key, its type and its default.
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


class ConfigError(ValueError):
    """A config value the pipeline cannot run with; the message names key, value and fix."""


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def describe_errors(config: dict, schema: dict) -> list[str]:
    """One readable line per schema violation: 'pack.resize = -3: -3 is less than the minimum of 0'."""
    validator = jsonschema.Draft202012Validator(schema)
    lines = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        path = list(err.absolute_path)
        if err.validator == "additionalProperties":
            allowed = sorted(err.schema.get("properties", {}))
            extra = sorted(set(err.instance) - set(allowed))
            for name in extra:
                lines.append(f"unknown config key '{_key(path + [name])}' (allowed here: {', '.join(allowed)})")
            continue
        if err.validator == "oneOf" and err.context:
            reasons = "; or ".join(sorted({c.message for c in err.context}))
            lines.append(f"config key '{_key(path)}' = {err.instance!r} is invalid: {reasons}")
            continue
        lines.append(f"config key '{_key(path)}' = {err.instance!r} is invalid: {err.message}")
    return lines


def check_paths(config: dict, workdir: Path) -> list[str]:
    """Paths that must exist (raw) or be creatable and writable (fast_storage)."""
    problems = []
    raw = config.get("raw")
    if raw is not None:
        raw_path = (workdir / raw) if not os.path.isabs(raw) else Path(raw)
        if not raw_path.is_dir():
            problems.append(
                f"config key 'raw' = {raw!r}: no such directory. Point it at the ImageNet root "
                "(holding train/ and val/, or ILSVRC2012_img_train.tar), or set raw: null for the demo set."
            )
    fast = config["pack"]["fast_storage"]
    fast_path = (workdir / fast) if not os.path.isabs(fast) else Path(fast)
    existing = fast_path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        problems.append(f"config key 'pack.fast_storage' = {fast!r}: {existing} is a file, not a directory.")
    elif not os.access(existing, os.W_OK):
        problems.append(
            f"config key 'pack.fast_storage' = {fast!r}: {existing} is not writable; "
            "choose a directory on an SSD you can write to."
        )
    return problems


def load_schema(schema_path) -> dict:
    with open(schema_path) as fh:
        return yaml.safe_load(fh)


def coerce_strings(config: dict, schema: dict) -> None:
    """Snakemake's --config hands nested values over as strings (train='{epochs: 1}' gives '1'): a
    string the schema rejects but whose YAML reading it accepts becomes that value, in place."""
    for key, sub in schema.get("properties", {}).items():
        value = config.get(key)
        if isinstance(value, dict):
            coerce_strings(value, sub)
        elif isinstance(value, str):
            check = jsonschema.Draft202012Validator(sub)
            if check.is_valid(value):
                continue
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                continue
            if check.is_valid(parsed):
                config[key] = parsed


def fill_defaults(config: dict, schema_path=SCHEMA_PATH) -> dict:
    """Validate against the schema and fill its defaults in place (the schema is the only home of a
    default); raise ConfigError naming every bad key."""
    from snakemake.utils import validate

    schema = load_schema(schema_path)
    coerce_strings(config, schema)
    try:
        validate(config, str(schema_path), set_default=True)
    except Exception as exc:  # WorkflowError; re-described below key by key
        lines = describe_errors(config, schema) or [str(exc)]
        raise ConfigError(_format(lines)) from None
    return config


def check_config(config: dict, schema_path=SCHEMA_PATH, workdir=".") -> dict:
    """Validate and fill defaults in place, then check paths; raise ConfigError listing every problem."""
    fill_defaults(config, schema_path)
    problems = check_paths(config, Path(workdir))
    if problems:
        raise ConfigError(_format(problems))
    return config


def _format(lines: list[str]) -> str:
    return "invalid configuration (nothing was run):\n" + "\n".join(f"  - {line}" for line in lines)


def stage_block(block: str, block_json_text: str, schema_path=SCHEMA_PATH) -> dict:
    """A stage's config block from its --config-json, checked and completed from the schema, so a
    partial block typed by hand works and a wrong key fails here, named (not as a KeyError later)."""
    try:
        given = json.loads(block_json_text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--config-json is not valid JSON ({err}); pass the {block} block, e.g. '{{}}'") from None
    if not isinstance(given, dict):
        raise ConfigError(f"--config-json must be a JSON object (the {block} block), got {given!r}")
    return fill_defaults({block: given}, schema_path)[block]


def block_json(config: dict, block: str) -> str:
    """A config block as canonical JSON: the `params:` of the rule that reads it."""
    return json.dumps(config[block], sort_keys=True)


def prepare_job_env(package_dir) -> None:
    """Make jobs' `python -m rectrain.<stage>` find this package and, unless a conda env is
    activated for the job, the interpreter Snakemake itself runs in (an unactivated .venv)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(package_dir), os.environ.get("PYTHONPATH")) if p)
    os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
