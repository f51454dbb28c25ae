"""What `train.model` names, and which source files define it (torch-free: the Snakefile reads it).

    resnet50                       a torchvision registry name (torchvision.models.get_model)
    timm:convnext_tiny             a timm model, built with pretrained=False
    path/to/net.py:factory         a factory in your own file (relative to the working directory, or
                                   absolute; ~ and $VAR expanded)
    mypackage.nets:factory         a factory in an importable module

A factory is called as factory(num_classes=K, **train.model_args).  For a file or module factory, the
file and the local modules it imports (those found beside it, followed through their own imports) are
inputs of the train job: editing one retrains, editing an unrelated file does not.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

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


def module_origin(name: str) -> Path | None:
    """The file of an importable module, or None where it is not found (or not a file)."""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found and found.origin and found.origin.endswith(".py") else None


def local_sources(path: str | os.PathLike) -> list[Path]:
    """`path` and every module it imports that is a file beside it (or in a package beside it),
    followed through their own imports: what defines the model, in a stable order."""
    root = Path(path).resolve().parent
    seen: dict[Path, None] = {}
    todo = [Path(path).resolve()]
    while todo:
        f = todo.pop()
        if f in seen or not f.is_file():
            continue
        seen[f] = None
        todo += [m for m in _imported_files(f, root) if m not in seen]
    return sorted(seen)


def _imported_files(f: Path, root: Path) -> list[Path]:
    """The files under `root` that the import statements of `f` name (absolute and relative imports)."""
    try:
        tree = ast.parse(f.read_bytes(), str(f))
    except SyntaxError:
        return []  # the factory check reports it when it imports the file
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = f.parent if node.level else root
            for _ in range(max(0, node.level - 1)):
                base = base.parent
            module = node.module or ""
            names += [(base, module, a.name) for a in node.names]
    files = []
    for name in names:
        base, dotted = (root, name) if isinstance(name, str) else (name[0], name[1])
        candidates = [dotted] if isinstance(name, str) else [f"{dotted}.{name[2]}".strip("."), dotted]
        for cand in candidates:
            if not cand:
                continue
            stem = base.joinpath(*cand.split("."))
            for file in (stem.with_suffix(".py"), stem / "__init__.py"):
                if file.is_file():
                    files.append(file.resolve())
    return files


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
