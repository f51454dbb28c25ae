"""The config as every stage sees it: validated against config/schema.yaml, defaults filled from it
(their only home), and split by what each key changes.

Snakemake's `validate` fills the schema defaults; when it rejects a config we re-walk the same
schema with jsonschema (the library Snakemake uses) only to turn its errors into one line per key,
because the raw message buries the key under a dump of the schema.

Rerun relevance lives in the schema too: a key marked `x-rerun: false` is operational - it changes
how fast or how chatty a stage is (intervals, timeouts, worker and thread counts, read order,
calibration, autotuning), never what the stage writes. Rules pass only the other keys as `params:`
(`output_part`), so Snakemake, which compares params, reruns nothing for an operational edit; the
operational values reach the jobs through the environment (OPERATIONAL_ENV, set while the Snakefile
is parsed) and `stage_block` puts them back, so a stage's config holds every configured value.
Training's resume identity is the same `output_part`: a killed run resumes across operational edits.
The Snakefile-time checks (cross-field rules, paths, the job environment) are in rectrain.snakefile,
which no stage imports.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import jsonschema
import yaml

# config/schema.yaml of this checkout: every key, its type and its default.
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"
# The generated demo's config, which the Snakefile reads under the given ones when none names a raw root.
DEMO_CONFIG = SCHEMA_PATH.parent / "config.yaml"

# Every block's operational values (x-rerun: false), as JSON, from the Snakefile to the jobs it starts.
OPERATIONAL_ENV = "RECTRAIN_OPERATIONAL"
# Each run's own operational values ({run: {block: values}}), and the run a job belongs to (the rules
# set it): a sweep's run may set its own workers or intervals, still rerunning nothing.
RUNS_OPERATIONAL_ENV, RUN_ENV = "RECTRAIN_RUNS_OPERATIONAL", "RECTRAIN_RUN"


class ConfigError(ValueError):
    """A config value the pipeline cannot run with; the message names key, value and fix."""


def key_path(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def describe_errors(instance: dict, schema: dict) -> list[str]:
    """One readable line per schema violation: 'pack.resize = -3: -3 is less than the minimum of 0'."""
    validator = jsonschema.Draft202012Validator(schema)
    lines = []
    for err in sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.absolute_path))):
        path = list(err.absolute_path)
        if err.validator == "additionalProperties":
            allowed = sorted(err.schema.get("properties", {}))
            extra = sorted(set(err.instance) - set(allowed))
            for name in extra:
                lines.append(f"unknown config key '{key_path(path + [name])}' (allowed here: {', '.join(allowed)})")
            continue
        if err.validator == "minLength" and err.instance == "":
            lines.append(
                f"config key '{key_path(path)}' is an empty string: give a path, or leave the key out for its default"
            )
            continue
        if err.validator == "oneOf" and err.context:
            reasons = "; or ".join(sorted({c.message for c in _matching_branch_errors(err.context)}))
            lines.append(f"config key '{key_path(path)}' = {err.instance!r} is invalid: {reasons}")
            continue
        lines.append(f"config key '{key_path(path)}' = {err.instance!r} is invalid: {err.message}")
    return lines


def _matching_branch_errors(context: list) -> list:
    """The oneOf alternatives of the value's own type ('0 is less than the minimum of 1' rather than
    also "0 is not of type 'string'"); all of them when the value has none of the types."""
    by_branch: dict = {}
    for err in context:
        by_branch.setdefault(err.relative_schema_path[0], []).append(err)
    typed = [e for errs in by_branch.values() if not any(e.validator == "type" for e in errs) for e in errs]
    return typed or list(context)


def load_schema(schema_path) -> dict:
    """The schema as a dict of the caller's own. A Snakefile parse (every dry-run) asks for it about ten
    times (config checks, defaults, each block's operational keys): the file is read once while it is
    unchanged, and each caller gets a copy, so none can alter what the next one reads."""
    st = os.stat(schema_path)
    return json.loads(_parsed_schema(str(Path(schema_path).resolve()), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=8)
def _parsed_schema(path: str, mtime_ns: int, size: int) -> str:
    """The schema as JSON text (a fresh dict per json.loads, much faster than a deep copy); libyaml's
    safe loader when built in; mtime and size in the key: an edited schema is read again."""
    with open(path) as fh:
        return json.dumps(yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))


def coerce_strings(instance: dict, schema: dict) -> None:
    """Snakemake's --config reads nested values with YAML's BaseLoader, so every scalar inside arrives as
    a string (train='{epochs: 1, devices: [0]}' gives '1' and ['0']). Each value the schema rejects and
    that holds a string is read again, in place, as the types the schema wants, through nested blocks
    and list items alike, so an out-of-range number is reported as such ('0 is less than the minimum of
    1'), not as "'0' is not of type 'integer'"."""
    for key, sub in schema.get("properties", {}).items():
        if key in instance:
            instance[key] = _coerced(instance[key], sub)


def _coerced(value, schema: dict):
    """`value` as the schema types it: a string read as YAML (number, boolean, null, list, ...), a list
    item by item, a block key by key; unchanged when it is valid, holds no string or cannot be read."""
    if isinstance(value, dict):
        block = _object_schema(schema)
        if "properties" not in block:  # a free-form block (train.model_args): each string as a YAML file reads it
            return {k: _read_as_yaml(v) for k, v in value.items()}
        coerce_strings(value, block)
        return value
    if not _holds_string(value) or jsonschema.Draft202012Validator(schema).is_valid(value):
        return value
    if isinstance(value, list):
        return _coerced_items(value, schema)
    if not value.strip():  # YAML reads "" as null: an empty path stays empty, and is refused as such
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return value if isinstance(parsed, str) else _coerced(parsed, schema)


def _read_as_yaml(value):
    """A value of a block the schema does not describe key by key (train.model_args: a constructor's keyword
    arguments) read as a config file gives it: '0.1' a number, 'true' a boolean, through nested blocks and
    lists; an empty string stays one."""
    if isinstance(value, dict):
        return {k: _read_as_yaml(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_read_as_yaml(v) for v in value]
    if not isinstance(value, str) or not value.strip():
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _object_schema(schema: dict) -> dict:
    """The schema of a block's keys: its own, or that of the oneOf/anyOf alternative that is a block
    (train.progressive is null or {min_res, ...})."""
    branches = (schema, *schema.get("oneOf", []), *schema.get("anyOf", []))
    return next((b for b in branches if "properties" in b), schema)


def _coerced_items(items: list, schema: dict) -> list:
    """The list read with the item schema of each alternative (oneOf/anyOf) in turn: the first reading
    the schema accepts, else the first reading (so the error names the item's own problem)."""
    item_schemas = [b["items"] for b in (schema, *schema.get("oneOf", []), *schema.get("anyOf", [])) if "items" in b]
    readings = [[_coerced(item, sub) for item in items] for sub in item_schemas if isinstance(sub, dict)]
    valid = jsonschema.Draft202012Validator(schema).is_valid
    return next((r for r in readings if valid(r)), readings[0] if readings else items)


def _holds_string(value) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, list) and any(_holds_string(v) for v in value)


def _defaulting(validator_class):
    """`validator_class` that also sets each property's schema default where the instance lacks it, as
    Snakemake's `validate(..., set_default=True)` does (both follow jsonschema's FAQ). Not Snakemake's
    validate itself: it parses the schema file again at every call with a pure-Python YAML reader (a
    one-process tiny training spent 0.3 of its 3.1 CPU-s there; bench/RESULTS.md, "The test suite's wall
    time for issue 48"), where load_schema parses it once."""
    check_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        for name, sub in properties.items():
            if "default" in sub and isinstance(instance, dict):
                instance.setdefault(name, sub["default"])
        yield from check_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_DefaultingValidator = _defaulting(jsonschema.Draft202012Validator)


# Every block by nature: the schema validates and completes the config as one document.
def fill_defaults(config: dict, schema_path=SCHEMA_PATH) -> dict:
    """Validate against the schema and fill its defaults in place (the schema is the only home of a
    default); raise ConfigError naming every bad key."""
    schema = load_schema(schema_path)
    coerce_strings(config, schema)
    try:
        _DefaultingValidator(schema).validate(config)
    except jsonschema.ValidationError as exc:  # re-described below key by key
        lines = describe_errors(config, schema) or [exc.message]
        raise ConfigError(format_problems(lines)) from None
    expand_paths(config, schema)
    return config


# $NAME or ${NAME}, as os.path.expandvars reads them
_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


def path_keys(schema: dict, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key the schema marks `x-path: true`, as a key path (("pack", "fast_storage"))."""
    keys = []
    for name, spec in schema.get("properties", {}).items():
        if spec.get("x-path"):
            keys.append((*path, name))
        keys += path_keys(spec, (*path, name))
    return keys


def _path_slots(instance: dict, schema: dict):
    """(dotted key, the dict or list holding it, its name or index) for every path key set to a string,
    and for each string of a path key set to a list of them (index.allow_outside_root)."""
    for keys in path_keys(schema):
        block = instance
        for key in keys[:-1]:
            block = block.get(key) if isinstance(block, dict) else None
        value = block.get(keys[-1]) if isinstance(block, dict) else None
        if isinstance(value, str):
            yield key_path(keys), block, keys[-1]
        elif isinstance(value, list):
            yield from ((f"{key_path(keys)}[{i}]", value, i) for i, item in enumerate(value) if isinstance(item, str))


def path_values(instance: dict, schema: dict) -> dict[str, str]:
    """'pack.fast_storage' -> its value as given, for every path key set to a string."""
    return {dotted: block[name] for dotted, block, name in _path_slots(instance, schema)}


def expand_path(value: str, key: str) -> str:
    """value with $VAR / ${VAR} and then ~ / ~user expanded; a variable that is not set is an error (a
    path with the variable's name in it would be created or looked for instead)."""
    unset = sorted({m.group(1).strip("{}") for m in _VARIABLE.finditer(value)} - set(os.environ))
    if unset:
        raise ConfigError(
            format_problems(
                [
                    f"config key '{key}' = {value!r} names the environment variable(s) {', '.join(unset)}, not set "
                    "where the config is read: set it (export it before running Snakemake), or write the path out"
                ]
            )
        )
    expanded = os.path.expanduser(os.path.expandvars(value))
    if not expanded.strip():  # "" would be the working directory
        raise ConfigError(
            format_problems([f"config key '{key}' = {value!r} expands to an empty path: set the variable to a path"])
        )
    return expanded


def expand_paths(instance: dict, schema: dict) -> None:
    """Expand every path key (`x-path: true` in the schema) in place; see expand_path."""
    for dotted, block, name in list(_path_slots(instance, schema)):
        block[name] = expand_path(block[name], dotted)


def shown_path(key: str, value: str, written: dict[str, str]) -> str:
    """How an error names a path key: config key 'raw' = '~/x' (expanded: /home/me/x), without the
    parenthesis where expansion changed nothing."""
    given = written.get(key, value)
    return f"config key '{key}' = {given!r}" + (f" (expanded: {value})" if given != value else "")


def stage_block(block: str, block_json_text: str, schema_path=SCHEMA_PATH) -> dict:
    """A stage's config block from its --config-json, checked and completed: the operational values the
    Snakefile exported (OPERATIONAL_ENV) under the given ones, then the schema's defaults. A partial
    block typed by hand works, and a wrong key fails here, named (not as a KeyError later)."""
    try:
        given = json.loads(block_json_text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--config-json is not valid JSON ({err}); pass the {block} block, e.g. '{{}}'") from None
    if not isinstance(given, dict):
        raise ConfigError(f"--config-json must be a JSON object (the {block} block), got {given!r}")
    return fill_defaults({block: {**exported_operational().get(block, {}), **given}}, schema_path)[block]


def complete_config(given: dict, schema_path=SCHEMA_PATH) -> dict:
    """A whole config (the report's --config-json) with every block's exported operational values put
    back under the given ones, checked and completed from the schema."""
    merged = dict(given)
    for block, ops in exported_operational().items():
        if isinstance(merged.get(block, {}), dict):
            merged[block] = {**ops, **merged.get(block, {})}
    return fill_defaults(merged, schema_path)


def merged_files(paths: list, demo_config: Path | str = DEMO_CONFIG) -> dict:
    """The config files merged in order as Snakemake merges them, over the demo's config file
    (demo_config: its path) when none names a raw root (the Snakefile's rule); not yet completed."""
    from snakemake.utils import update_config  # Snakemake's own merge: nested blocks key by key

    given: dict = {}
    for path in paths:
        try:
            update_config(given, yaml.safe_load(Path(path).read_text()) or {})
        except OSError as err:
            raise ConfigError(
                f"config file {path} cannot be read ({err.strerror}): give the file `make run` was given"
            ) from None
    if given.get("raw") is None:
        demo = yaml.safe_load(Path(demo_config).read_text())
        update_config(demo, given)
        given = demo
    return given


def from_files(paths: list, demo_config: Path | str = DEMO_CONFIG) -> dict:
    """The whole config `snakemake --configfile <paths>` runs with, for a command that runs outside
    Snakemake (rectrain.report.live): the files merged in order as Snakemake merges them, over the
    demo's config file (demo_config: its path) when none names a raw root (the Snakefile's rule), completed
    from the schema."""
    return complete_config(merged_files(paths, demo_config))


def exported_operational() -> dict:
    """{block: operational values} as the Snakefile exported them; {} outside a Snakemake job."""
    text = os.environ.get(OPERATIONAL_ENV)
    found = json.loads(text) if text else {}
    own = json.loads(os.environ.get(RUNS_OPERATIONAL_ENV) or "{}").get(os.environ.get(RUN_ENV, ""), {})
    return {**found, **own}


@functools.lru_cache(maxsize=None)
def operational_keys(block: str, schema_path=SCHEMA_PATH) -> frozenset[str]:
    """The keys of `block` marked `x-rerun: false` in the schema."""
    props = load_schema(schema_path)["properties"].get(block, {}).get("properties", {})
    return frozenset(k for k, spec in props.items() if spec.get("x-rerun") is False)


def output_part(block: str, values: dict, schema_path=SCHEMA_PATH) -> dict:
    """The block's values that change what its stage writes (the rule's params, the resume identity)."""
    ops = operational_keys(block, schema_path)
    return {k: v for k, v in values.items() if k not in ops}


def operational_part(block: str, values: dict, schema_path=SCHEMA_PATH) -> dict:
    ops = operational_keys(block, schema_path)
    return {k: v for k, v in values.items() if k in ops}


def format_problems(lines: list[str]) -> str:
    return "invalid configuration (nothing was run):\n" + "\n".join(f"  - {line}" for line in lines)
