"""Which source files each pipeline stage runs, derived from its imports - never typed by hand.

A rule lists `stage_sources(<stage>)` as its `code` input, so editing any module the stage imports
(directly, inside a function, or through another rectrain module) reruns that stage and what follows
it, and nothing before.  Training's resume fingerprint hashes the same files, so a checkpoint written
by other code is not resumed.  Package data beside a package's modules (the report's templates) counts
as that package's code.  See docs/architecture.md, "Rerun semantics".
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
from pathlib import Path

from rectrain.atomic import write_json

PACKAGE = "rectrain"
PACKAGE_DIR = Path(__file__).resolve().parent

# The module each rule runs (`python -m ...` in workflow/rules/<stage>.smk).  The train rule runs the
# one command, python -m rectrain.train (its __main__), which runs torchrun (rectrain._torchrun) on itself.
STAGE_ENTRIES = {
    "demo_data": ("rectrain.data.demo",),
    "index_raw": ("rectrain.data.index",),
    "pack": ("rectrain.data.pack",),
    "check_recordio": ("rectrain.data.byo_recordio",),
    "train": ("rectrain.train.__main__", "rectrain._torchrun"),
    "evaluate": ("rectrain.evaluate",),
    "check": ("rectrain.check",),
    "report": ("rectrain.report.__main__",),
    "compare": ("rectrain.report.compare",),
}


def module_file(name: str, package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The file of rectrain module `name` (a package's __init__.py), or None if there is none."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = package_dir.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path, package_dir: Path) -> str:
    rel = path.relative_to(package_dir).with_suffix("")
    parts = [PACKAGE, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_statements(tree: ast.Module):
    """Import statements anywhere in the module's statements (function and class bodies, if/try/with
    blocks): only statements are walked, never expressions, which are most of a tree's nodes and can
    hold no import statement."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            todo.extend(getattr(node, field, None) or ())


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@functools.lru_cache(maxsize=None)
def _imports(path: Path, digest: str) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """(level, module, names) of each import statement; parsed once per file content (every stage's
    closure visits the shared modules: the dry-run parses each file once instead of once per stage)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node in _import_statements(tree):
        if isinstance(node, ast.Import):
            out.extend((0, alias.name, ()) for alias in node.names)
        else:
            out.append((node.level, node.module or "", tuple(alias.name for alias in node.names)))
    return tuple(out)


def imported_names(path: Path, package_dir: Path = PACKAGE_DIR) -> set[str]:
    """rectrain modules `path` imports anywhere in its body (lazy imports inside functions too).
    `from a.b import c` names a.b and, when c is a submodule, a.b.c."""
    this = _module_name(path, package_dir)
    is_pkg = path.name == "__init__.py"
    names: set[str] = set()
    for level, module, imported in _imports(path, _sha256(path)):
        if not imported:  # import a.b
            names.add(module)
            continue
        if level:  # relative: resolve against this module's package
            anchor = this.split(".")
            anchor = anchor[: len(anchor) - level + (1 if is_pkg else 0)]
            base = ".".join([*anchor, *([module] if module else [])])
        else:
            base = module
        names.add(base)
        names.update(f"{base}.{name}" for name in imported)
    return {n for n in names if n.split(".")[0] == PACKAGE}


def _with_parents(name: str) -> list[str]:
    """Importing a.b.c runs a/__init__.py and a/b/__init__.py first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_closure(entries, package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """Every rectrain source file the entry modules can import, sorted."""
    seen: set[Path] = set()
    todo = [n for entry in entries for n in _with_parents(entry)]
    while todo:
        path = module_file(todo.pop(), package_dir)
        if path is None or path in seen:
            continue
        seen.add(path)
        for name in imported_names(path, package_dir):
            todo.extend(_with_parents(name))
    return sorted(seen | _package_data(seen))


def _package_data(modules: set[Path]) -> set[Path]:
    """Non-Python files in folders of the closure's packages that are not packages themselves
    (report/templates/*.j2): code the package reads at run time."""
    data = set()
    for init in (p for p in modules if p.name == "__init__.py"):
        for sub in init.parent.iterdir():
            if sub.is_dir() and not (sub / "__init__.py").exists() and sub.name != "__pycache__":
                data.update(f for f in sub.rglob("*") if f.is_file() and f.suffix not in (".pyc",))
    return data


# Every stage's closure, saved beside the bytecode with the package's file listing it was derived
# from: a dry-run then stats the package's files instead of parsing ~50 modules (0.2 s of its start-up).
CACHE = Path("__pycache__") / "rectrain-stage-sources.json"


def package_listing(package_dir: Path) -> dict[str, str]:
    """sha256 of every file in the package but bytecode: the closures depend on nothing else (which
    files exist, and what each one imports). Content, not size and time: an edit that keeps both (a
    copy with preserved times, an editor that restores them) changes an import all the same."""
    listing = {}
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in files:
            if not name.endswith(".pyc"):
                path = os.path.join(folder, name)
                listing[os.path.relpath(path, package_dir)] = _sha256(path)
    return listing


def _closures(package_dir: Path) -> dict[str, list[str]]:
    return {
        stage: [str(f.relative_to(package_dir)) for f in import_closure(entries, package_dir)]
        for stage, entries in STAGE_ENTRIES.items()
    }


@functools.lru_cache(maxsize=None)
def all_stage_sources(package_dir: Path) -> dict[str, list[str]]:
    """{stage: its files, relative to the package}, from the cache when no file of the package changed."""
    listing, cache = package_listing(package_dir), package_dir / CACHE
    try:
        saved = json.loads(cache.read_text(encoding="utf-8"))
        _touch_edited(package_dir, saved["listing"], listing)
        if saved["listing"] == listing and saved["stages"].keys() == STAGE_ENTRIES.keys():
            return saved["stages"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no cache yet, or an unreadable one: derive the closures
    stages = _closures(package_dir)
    try:
        cache.parent.mkdir(exist_ok=True)
        write_json(cache, {"listing": listing, "stages": stages})
    except OSError:
        pass  # a read-only install: derive them again next time
    return stages


def _touch_edited(package_dir: Path, saved: dict[str, str], listing: dict[str, str]) -> None:
    """Give every file whose content changed since the saved listing the time of now. Snakemake
    reruns a rule when an input is newer than its outputs: an edit that kept the file's time (a copy
    with preserved times, an editor or a checkout that restores them) would rerun nothing."""
    for name, digest in listing.items():
        if isinstance(old := saved.get(name), str) and old != digest:  # not in an old listing: no edit seen
            try:
                os.utime(package_dir / name)
            except OSError:
                pass  # a file we may not touch is one nobody edits in place (a read-only install)


def _stage_sources(stage: str, package_dir: Path) -> tuple[Path, ...]:
    if stage not in STAGE_ENTRIES:
        raise KeyError(f"unknown pipeline stage {stage!r}; known: {', '.join(STAGE_ENTRIES)}")
    return tuple(package_dir / f for f in all_stage_sources(package_dir)[stage])


def stage_sources(stage: str, package_dir: str | Path = PACKAGE_DIR) -> list[Path]:
    """The source files of one pipeline stage (its rule's code input)."""
    return list(_stage_sources(stage, Path(package_dir).resolve()))


def fingerprint(stage: str, package_dir: str | Path = PACKAGE_DIR) -> dict[str, str]:
    """sha256 of each of the stage's source files, keyed by path inside the package."""
    root = Path(package_dir).resolve()
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in stage_sources(stage, root)}
