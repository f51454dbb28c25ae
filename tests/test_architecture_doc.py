"""docs/architecture.md walks a reader through one training step and one stop signal, naming the functions
in order: every name it gives must exist in the code, so the two walks cannot drift from it."""

import importlib
import re

import pytest
import yaml
from helpers import REPO

DOC = REPO / "docs" / "architecture.md"
WALKS = ("## Follow one training step", "## Follow one stop signal")
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`")
FILE_SUFFIXES = {"csv", "pt", "json", "py", "smk", "tsv", "html", "yaml", "rec", "idx"}


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end > 0 else len(text)]


def config_keys() -> set[str]:
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    return {f"{block}.{key}" for block, spec in schema["properties"].items() for key in spec.get("properties", {})}


def named_in(heading: str) -> list[str]:
    keys = config_keys()
    names = DOTTED.findall(section(DOC.read_text(), heading))
    return [n for n in names if n not in keys and n.rsplit(".", 1)[1] not in FILE_SUFFIXES]


def resolve(name: str):
    """`name` as the doc writes it - relative to rectrain.train, its lifecycle package, or rectrain - to the
    object it names."""
    parts = name.split(".")
    for base in ("rectrain.train", "rectrain.train.lifecycle", "rectrain"):
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join([base, *parts[:cut]]))
            except ModuleNotFoundError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return obj
    return None


@pytest.mark.parametrize("heading", WALKS)
def test_every_function_a_walk_in_architecture_md_names_exists(heading):
    names = named_in(heading)
    assert len(names) >= 15, f"{heading}: the walk names too few functions to be a walk: {names}"
    missing = [n for n in names if resolve(n) is None]
    assert not missing, f"{heading} in docs/architecture.md names what the code does not have: {missing}"


def test_the_name_check_refuses_a_function_that_does_not_exist():
    assert resolve("midepoch.MidEpoch.poll") is not None and resolve("train.launch.start") is not None
    assert resolve("midepoch.MidEpoch.no_such_step") is None and resolve("supervise.no_such_function") is None
