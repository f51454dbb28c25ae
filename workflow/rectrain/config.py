"""Config validation that fails before any job runs, naming the key and the bad value.

Snakemake's `validate` fills the schema defaults; when it rejects a config we re-walk the same
schema with jsonschema (the library Snakemake uses) only to turn its errors into one line per key,
because the raw message buries the key under a dump of the schema.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shlex
import sys
from pathlib import Path

import jsonschema
import yaml

# config/schema.yaml of this checkout: every key, its type and its default.
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"

log = logging.getLogger(__name__)


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
        if err.validator == "minLength" and err.instance == "":
            lines.append(
                f"config key '{_key(path)}' is an empty string: give a path, or leave the key out for its default"
            )
            continue
        if err.validator == "oneOf" and err.context:
            reasons = "; or ".join(sorted({c.message for c in _matching_branch_errors(err.context)}))
            lines.append(f"config key '{_key(path)}' = {err.instance!r} is invalid: {reasons}")
            continue
        lines.append(f"config key '{_key(path)}' = {err.instance!r} is invalid: {err.message}")
    return lines


def _matching_branch_errors(context: list) -> list:
    """The oneOf alternatives of the value's own type ('0 is less than the minimum of 1' rather than
    also "0 is not of type 'string'"); all of them when the value has none of the types."""
    by_branch: dict = {}
    for err in context:
        by_branch.setdefault(err.relative_schema_path[0], []).append(err)
    typed = [e for errs in by_branch.values() if not any(e.validator == "type" for e in errs) for e in errs]
    return typed or list(context)


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
    # libyaml's safe loader when built in: the schema is read on every Snakefile parse (the dry-run).
    with open(schema_path) as fh:
        return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def coerce_strings(config: dict, schema: dict) -> None:
    """Snakemake's --config hands nested values over as strings (train='{epochs: 1}' gives '1'): a
    string the schema rejects becomes its YAML reading, in place, whenever YAML reads it as a typed
    value (number, boolean, list, ...), so an out-of-range number is reported as such ('0 is less
    than the minimum of 1'), not as "'0' is not of type 'integer'"."""
    for key, sub in schema.get("properties", {}).items():
        value = config.get(key)
        if isinstance(value, dict):
            coerce_strings(value, sub)
        elif isinstance(value, str) and value.strip():  # YAML reads "" as null: an empty path stays empty
            if jsonschema.Draft202012Validator(sub).is_valid(value):
                continue
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                continue
            if not isinstance(parsed, str):
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
    """Validate and fill defaults in place, then cross-check keys and paths; raise ConfigError listing
    every problem, and log a warning for each combination that runs but is probably not meant."""
    fill_defaults(config, schema_path)
    problems = whole_numbers(config, load_schema(schema_path)) + cross_check(config)
    problems += check_paths(config, Path(workdir))
    if problems:
        raise ConfigError(_format(problems))
    for line in cross_warnings(config):
        log.warning("config: %s", line)
    return config


def _branches(schema: dict) -> list[dict]:
    return [schema, *schema.get("oneOf", [])]


def _types(schema: dict) -> set[str]:
    types: set[str] = set()
    for branch in _branches(schema):
        given = branch.get("type", [])
        types.update([given] if isinstance(given, str) else given)
    return types


def whole_numbers(value, schema: dict, path=()) -> list[str]:
    """Integer keys given a float: JSON Schema counts 2.0 as an integer, but the code would get a
    float (range(2.0) fails hours later), so it is refused here."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return [line for k, v in value.items() if k in props for line in whole_numbers(v, props[k], (*path, k))]
    if isinstance(value, list):
        items = next((b["items"] for b in _branches(schema) if "items" in b), None)
        return [line for i, v in enumerate(value) if items for line in whole_numbers(v, items, (*path, i))]
    types = _types(schema)
    if isinstance(value, float) and "integer" in types and "number" not in types:
        return [f"config key '{_key(path)}' = {value!r} must be a whole number: write {int(value)}"]
    return []


def cross_check(config: dict) -> list[str]:
    """Combinations of keys that every schema check passes but that can only fail in a later job."""
    problems = []
    train, ev = config["train"], config["evaluate"]
    crop = ev["crop"] or train["image_size"]
    if ev["resize"] is not None and crop > ev["resize"]:
        source = "evaluate.crop" if ev["crop"] else "train.image_size (evaluate.crop: null)"
        problems.append(
            f"config key 'evaluate.crop': the centre crop {crop} (from {source}) is larger than the image after "
            f"'evaluate.resize' = {ev['resize']}; set evaluate.resize >= {crop}, or null for {crop} / 0.875"
        )
    models = known_models()
    if models is not None and train["model"] not in models:
        near = sorted(m for m in models if m.startswith(train["model"].rstrip("0123456789")))[:8]
        problems.append(
            f"config key 'train.model' = {train['model']!r} is not a torchvision model"
            + (f" (similar: {', '.join(near)})" if near else " (torchvision.models.list_models() lists them)")
        )
    return problems


def cross_warnings(config: dict) -> list[str]:
    """Combinations that run but waste work or are ignored."""
    lines = []
    pack, train = config["pack"], config["train"]
    if pack["resize"] and pack["resize"] < train["image_size"]:
        lines.append(
            f"'pack.resize' = {pack['resize']} stores images smaller than 'train.image_size' = {train['image_size']}: "
            "every training crop is upscaled; set pack.resize >= train.image_size (or 0 to keep the originals)"
        )
    if train["global_batch"] is not None and train["batch_size"] != "auto":
        lines.append(
            f"'train.global_batch' = {train['global_batch']} is used only with batch_size: auto and is ignored "
            f"with batch_size: {train['batch_size']}"
        )
    return lines


def known_models() -> set[str] | None:
    """torchvision's model names (what train.model may be), or None where torchvision is not installed
    beside Snakemake (the jobs' own environment decides then). Importing torchvision costs seconds,
    so the list is cached per torchvision version and a dry-run stays fast."""
    try:
        version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return None
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = cache_home / "rectrain" / f"torchvision-{version}-models.json"
    try:
        return set(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    import torchvision.models

    from rectrain.atomic import write_json

    names = sorted(torchvision.models.list_models())
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json(cache, names)
    except OSError as err:  # a read-only home only costs the import next time
        log.debug("model list not cached at %s: %s", cache, err)
    return set(names)


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


def prepare_job_env(package_dir, executable: str = sys.executable) -> None:
    """Make jobs' `python -m rectrain.<stage>` find this package and, unless a conda env is
    activated for the job (its activation puts the env's python first), the interpreter Snakemake
    itself runs in (an unactivated .venv, or a system python3 with no `python` beside it)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(package_dir), os.environ.get("PYTHONPATH")) if p)
    first = dict.fromkeys([str(python_dir(executable)), str(Path(executable).parent)])
    os.environ["PATH"] = os.pathsep.join((*first, os.environ.get("PATH", "")))


def python_dir(executable: str, workdir=".") -> Path:
    """A folder whose `python` runs `executable`: the interpreter's own folder when its `python` is that
    program, else .snakemake/rectrain-bin/ holding a wrapper (many machines have only `python3`, and a
    `python` found further along the PATH lacks the packages).  A wrapper, not a link: a venv's
    interpreter finds its packages only when started by its own path."""
    exe = Path(executable)
    own = exe.parent / "python"
    if own.is_file() and os.path.samefile(own, exe):
        return exe.parent
    folder = (Path(workdir) / ".snakemake" / "rectrain-bin").resolve()
    wrapper, text = folder / "python", f'#!/bin/sh\nexec {shlex.quote(str(exe))} "$@"\n'
    if not wrapper.is_file() or wrapper.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".python.{os.getpid()}"
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, wrapper)  # whole, executable, even when several Snakemake processes parse at once
    return folder
