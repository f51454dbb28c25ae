"""What `train.model` names, and which source files define it (torch-free: the Snakefile reads it).

    resnet50                       a torchvision registry name (torchvision.models.get_model)
    timm:convnext_tiny             a timm model, built with pretrained=False
    path/to/net.py:factory         a factory in your own file (relative to the working directory, or
                                   absolute; ~ and $VAR expanded)
    mypackage.nets:factory         a factory in an importable module

A factory is called as factory(num_classes=K, **train.model_args).  For a file or module factory, the
file and the local modules it imports (those found beside it, followed through their own imports) are
inputs of the train job: editing one retrains, editing an unrelated file does not.  A name of the
standard library is never a local module (a graphlib.py planted beside the file is not its source, and
rectrain.model never imports it: the standard library's own module comes first).
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from rectrain import safefs

TIMM = "timm:"
# train.init_weights' prefix for torchvision's weight enums (rectrain.train.init_weights)
TORCHVISION_WEIGHTS = "torchvision:"


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # torchvision | timm | file | module
    target: str  # the registry name, the file's path (expanded, absolute), or the module's name
    factory: str | None = None

    @property
    def custom(self) -> bool:
        return self.kind in ("file", "module")


def parse(value: str, cwd: str | os.PathLike | None = None) -> ModelSpec:
    """train.model's value as a ModelSpec; a file path is expanded (~, $VAR) and made absolute from `cwd`
    (default: the working directory)."""
    if value.startswith(TIMM):
        return ModelSpec("timm", value[len(TIMM) :])
    if ":" not in value:
        return ModelSpec("torchvision", value)
    where, _, factory = value.rpartition(":")
    if where.endswith(".py") or os.sep in where or where.startswith(("~", "$", ".")):
        path = Path(os.path.expanduser(os.path.expandvars(where)))
        return ModelSpec("file", str(Path(cwd or os.getcwd()) / path if not path.is_absolute() else path), factory)
    return ModelSpec("module", where, factory)


def standard_library(name: str) -> bool:
    """`name` (dotted) is a module of Python's standard library, or built into the interpreter."""
    return name.partition(".")[0] in sys.stdlib_module_names or name in sys.builtin_module_names


def module_origin(name: str) -> Path | None:
    """The source file of an importable module, or None where it is not found (or not a .py file);
    found without importing it or its parent packages, whose __init__ would run (PathFinder walks
    each package's folders: importlib.util.find_spec imports the parents)."""
    path, found = None, None
    parts = name.split(".")
    for i in range(len(parts)):
        try:
            found = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), path)
        except (ImportError, ValueError):
            return None
        if found is None or (i < len(parts) - 1 and not found.submodule_search_locations):
            return None
        path = found.submodule_search_locations
    return Path(found.origin) if found.origin and found.origin.endswith(".py") else None


def read_sources(path: str | os.PathLike) -> dict[Path, bytes]:
    """The bytes of `path` (first) and of every module it imports that is a file beside it (or in a
    package beside it), followed through their own imports, each file read once: its imports are
    taken from the very bytes returned, so what is hashed is what rectrain.model imports.  A file
    that is not a regular file is left out (a FIFO is never opened)."""
    first = Path(path).resolve()
    root, read, todo = first.parent, {}, [first]
    while todo:
        f = todo.pop(0)
        if f in read or not f.is_file():
            continue
        try:
            with safefs.open_regular(f, "a model source file") as fh:
                read[f] = fh.read()
        except OSError:
            continue  # gone or swapped meanwhile: an import of it fails, naming it
        todo += [m for m in _imported_files(f, read[f], root) if m not in read]
    return read


def local_sources(path: str | os.PathLike) -> list[Path]:
    """`path` and every module it imports that is a file beside it (read_sources): what defines the
    model, in a stable order."""
    return sorted(read_sources(path))


def _imported_names(f: Path, data: bytes, root: Path) -> list[tuple[Path, str, str | None]]:
    """(folder, dotted module, imported name or None) of every import statement in `data` (the file f)."""
    try:
        tree = ast.parse(data, str(f))
    except (SyntaxError, ValueError):
        return []  # the factory check reports it when it imports the file
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(root, a.name, None) for a in node.names if not standard_library(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if not node.level and standard_library(node.module or ""):
                continue
            base = f.parent if node.level else root
            for _ in range(max(0, node.level - 1)):
                base = base.parent
            names += [(base, node.module or "", a.name) for a in node.names]
    return names


def _imported_files(f: Path, data: bytes, root: Path) -> list[Path]:
    """The files under `root` that the import statements of `data` (the file f) name (absolute and
    relative imports; never a standard-library name)."""
    files = []
    for base, dotted, name in _imported_names(f, data, root):
        candidates = [dotted] if name is None else [f"{dotted}.{name}".strip("."), dotted]
        for cand in candidates:
            if not cand:
                continue
            stem = base.joinpath(*cand.split("."))
            for file in (stem.with_suffix(".py"), stem / "__init__.py"):
                if file.is_file():
                    files.append(file.resolve())
    return files


def defines(data: bytes, filename: str, name: str) -> bool:
    """Whether the module source `data` binds `name` at its top level (a def, a class, an assignment or
    an import, also inside a top-level if or try): checked before the module is imported, so a wrong
    factory name is refused without running the module.  SyntaxError as Python raises it."""
    pending = list(ast.parse(data, filename).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.partition(".")[0]) == name for a in node.names):
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                return True
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            pending += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            pending += [s for h in getattr(node, "handlers", []) for s in h.body]
    return False


def sources(value: str, cwd: str | os.PathLike | None = None) -> list[str]:
    """The source files that define train.model's network (none for torchvision and timm names, whose
    code is a pinned package); a file that does not exist is left out (the factory check names it)."""
    spec = parse(value, cwd)
    if spec.kind == "file":
        origin = Path(spec.target) if Path(spec.target).is_file() else None
    elif spec.kind == "module":
        origin = module_origin(spec.target)
    else:
        origin = None
    return [str(p) for p in local_sources(origin)] if origin else []
