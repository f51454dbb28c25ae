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
from pathlib import Path

PACKAGE = "rectrain"
PACKAGE_DIR = Path(__file__).resolve().parent

# The module each rule runs (`python -m ...` in workflow/rules/<stage>.smk).  The train rule runs the
# launcher, which execs torchrun on rectrain.train (the package's __main__ runs the trainer).
STAGE_ENTRIES = {
    "demo_data": ("rectrain.data.demo",),
    "index_raw": ("rectrain.data.index",),
    "pack": ("rectrain.data.pack",),
    "train": ("rectrain.train.launch", "rectrain.train.__main__"),
    "evaluate": ("rectrain.evaluate",),
    "report": ("rectrain.report.__main__",),
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


def imported_names(path: Path, package_dir: Path = PACKAGE_DIR) -> set[str]:
    """rectrain modules `path` imports anywhere in its body (lazy imports inside functions too).
    `from a.b import c` names a.b and, when c is a submodule, a.b.c."""
    this = _module_name(path, package_dir)
    is_pkg = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                anchor = this.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
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


@functools.lru_cache(maxsize=None)
def _stage_sources(stage: str, package_dir: Path) -> tuple[Path, ...]:
    if stage not in STAGE_ENTRIES:
        raise KeyError(f"unknown pipeline stage {stage!r}; known: {', '.join(STAGE_ENTRIES)}")
    return tuple(import_closure(STAGE_ENTRIES[stage], package_dir))


def stage_sources(stage: str, package_dir: str | Path = PACKAGE_DIR) -> list[Path]:
    """The source files of one pipeline stage (its rule's code input)."""
    return list(_stage_sources(stage, Path(package_dir).resolve()))


def fingerprint(stage: str, package_dir: str | Path = PACKAGE_DIR) -> dict[str, str]:
    """sha256 of each of the stage's source files, keyed by path inside the package."""
    root = Path(package_dir).resolve()
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in stage_sources(stage, root)}
