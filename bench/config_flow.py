"""How far the whole config travels through rectrain: three static measurements (stdlib `ast` only).

    python bench/config_flow.py [--root workflow/rectrain] [--start train/trainer.py:train] [--quiet]

1. Whole-config functions: every function (or method) with a parameter that holds a whole config
   block, and the `cfg["key"]` look-ups made on such a parameter.  Issue 32 (item 3) has each stage
   build ONE frozen typed view of its block at its entry point (rectrain.settings) and hand the train
   block on in parts; so the headline counts what should reach no function below an entry point, and
   lists apart what the issue asks for.  The rule, by annotation and name:

   - counted: a parameter annotated with the whole config's view (`WholeSettings`, settings.whole's
     class) or with `TrainSettings` (the train block is handed on in parts, not whole), whatever its
     name;
   - listed apart (own heading and count, not in the headline): a parameter annotated with the
     frozen view of ONE non-train block (`PackSettings`, `EvaluateSettings`, `ReportSettings`, ...:
     `settings.view(block, ...)`), whatever its name - the stage's one view;
   - neither: a parameter annotated with a part of the train block (`TrainOptim`, `TrainLoaders`, ...:
     the `Train<Part>` classes settings declares), or named after a part (a field of
     settings.TrainSettings: `optim`, `loaders`, `batch`, ...);
   - otherwise the name decides, and counts: a raw dict named `cfg`, `config`, `conf`, `settings`, or
     a name ending in `_cfg`, `_config`, `_settings` (`train_cfg`) - unless its annotation says it is
     no dict at all (`cfg: None` in a stage that takes no block, `bool`, `int`, `str`, `Path`, ...).

   A function with a counted parameter is counted once, even if it also takes a block's view.
   The issue counted 96 functions in 29 modules (raw dicts, before the views); before this rule
   split the views off, 67 (a view of any block counted); by this rule, before item 3's entry points
   and train functions changed: 35 counted, 32 listed apart.  Today: 19 counted in 12 modules - the
   Snakefile-time checks, config.py's and settings.whole's readers of the raw config (14), the report's entry point
   (the whole config's view), training's two entry points (launch, trainer: TrainSettings) and the
   two that keep the whole train block for the Run (trainer.train, run.build_run: Run.settings) -
   and 39 listed apart (each stage's entry point and the functions handed its one view).

   A look-up is a subscript with a string key on such a parameter, inside its function.  The issue
   counted 176 in 23 files; today 13 in 4 (the Snakefile-time checks).  The output also gives the
   look-ups the rule leaves out (an alias such as `cfg = run.cfg`, or `run.cfg["key"]` on an object
   holding the block): with them every `cfg["..."]` of the package is counted.

2. The walk: from one function (train.trainer.train), the calls that hand the whole block on, depth
   first in source order, as a reader follows them.  A call hands it on when an argument is

   - a name holding the block: the function's whole-config parameter (rule 1), the parameter the
     block arrived in, or an alias of either (`cfg = run.cfg`, `d, cfg = run.d, run.cfg`);
   - an attribute named like a whole block (`run.cfg`, `run.settings`, `self.cfg`, `painter.cfg`);
   - a carrier: an object of a class with a whole-block field (`Run.cfg`), typed from the
     parameter's annotation, the class's constructor or the return annotation of the function
     that made it (`run = build_run(...)` -> Run).  A reader follows `run` as far as `run.cfg`.

   Callees are resolved through the module's imports (module-level ones and those in the function),
   re-exports, local and nested functions, `Class.method`, `self.method` and methods on objects
   typed as above; a constructor is entered at its `__init__` (a dataclass has none: no stop).  A
   call that hands the block on to something this cannot resolve inside the package is listed as a
   note; calls out of the package (json, torch, ...) are not followed.  Lambda bodies count as part
   of the function they are written in (the closure hands the block on when it is called).

   Stop: a function entered.  A reader reads each function once: a later call of one already read
   is no stop (`again` counts those calls).  Levels come from the module-level import graph
   (TYPE_CHECKING imports included): a module that (transitively) imports another is higher.
   Along the stops, in the order read: an entry is a stop in another module than the previous stop;
   a return is an entry into a module entered before; a climb back is an entry into a module higher
   than the previous stop's (the reader goes back up: after loaders/__init__.py, on to resume.py).
   A call up (`calls_up`) is a call whose callee's module imports the caller's: a layering
   violation, none today (inside an import circle every call across it would be one).

   Today: 29 stops in 8 modules, 2 climbs back, 4 returns; batchplan.py, memory.py and
   loaders/__init__.py are never entered (they are handed the block's parts, never the block).  The issue's figures (44 stops in 17 modules, 13 climbs,
   27 returns; batchplan.py entered 7 times, memory.py 6, loaders/__init__.py 5) came from a reader
   who also followed calls handing on values read from the block - memory.py takes no whole block,
   but the preflight hands it the loader choice, the wanted batch and the spec built from cfg;
   loaders/__init__.py's resolve_workers, image_dtype, resolve_loader and build_loader get
   cfg["..."] values - and who counted entries at each call.  This walk follows the whole block
   (and objects holding it) only, which is what the refactor removes; reading a value is no hand-on.

3. Import circles: strongly connected components of the module-level import graph (an import inside
   a function is a `hidden` edge, listed separately; TYPE_CHECKING imports are module-level edges,
   marked `type-only`).  A circle that closes only through hidden edges is reported on its own line.
   `from pkg import name` is an edge to pkg.name when that is a module, else to pkg; importing a
   submodule is not counted as an import of its parent packages.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = REPO / "workflow" / "rectrain"
START = ("train/trainer.py", "train")

WHOLE_NAMES = frozenset({"cfg", "config", "conf", "settings"})
WHOLE_SUFFIXES = ("_cfg", "_config", "_settings")
# settings.TrainSettings' fields, when the package has no settings.py to read them from
DEFAULT_PARTS = frozenset({"launch", "network", "batch", "loaders", "optim", "resolution", "stops", "telemetry"})
# Views that count in the headline: the whole config's (settings.whole) and the train block's, which is
# handed on in parts; any other `<Block>Settings` is one stage's view of its own block, listed apart.
WHOLE_VIEWS = frozenset({"WholeSettings", "TrainSettings"})
BLOCK_VIEW = re.compile(r"^(?:\w+\.)*([A-Z]\w*Settings)$")
PART_VIEW = re.compile(r"^(?:\w+\.)*Train[A-Z]\w*$")
NOT_A_DICT = frozenset({"None", "bool", "int", "float", "str", "bytes", "Path", "pathlib.Path"})
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


# ---------------------------------------------------------------- the package, parsed once


@dataclass(frozen=True)
class Import:
    source: str  # module names, dotted
    target: str
    line: int
    hidden: bool  # inside a function: runs when the function does
    type_only: bool  # under `if TYPE_CHECKING:`


@dataclass
class Module:
    name: str  # rectrain.train.batchplan
    rel: str  # train/batchplan.py
    tree: ast.Module
    is_package: bool
    defs: dict = field(default_factory=dict)  # qualname -> FunctionDef | ClassDef ("f", "C", "C.m", "f.inner")
    bindings: dict = field(default_factory=dict)  # name -> (module, attr | None), module-level imports
    local_bindings: dict = field(default_factory=dict)  # function qualname -> {name: (module, attr | None)}
    imports: list = field(default_factory=list)


@dataclass
class Package:
    root: Path
    modules: dict  # dotted name -> Module
    parts: frozenset  # names of the train block's parts
    carriers: set = field(default_factory=set)  # (module, class qualname) with a whole-block field

    def by_rel(self, rel: str) -> Module:
        return next(m for m in self.modules.values() if m.rel == rel)


def module_name(root: Path, path: Path) -> tuple[str, bool]:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def load_package(root: Path = PACKAGE_ROOT) -> Package:
    """Every module under `root` (a package directory) parsed, with its definitions and imports."""
    root = Path(root)
    modules = {}
    for path in sorted(root.rglob("*.py")):
        name, is_package = module_name(root, path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        modules[name] = Module(name, path.relative_to(root).as_posix(), tree, is_package)
    pkg = Package(root, modules, _part_names(modules))
    for mod in modules.values():
        _collect_defs(mod, mod.tree.body, "")
        _collect_imports(pkg, mod)
    pkg.carriers = {(m.name, q) for m in modules.values() for q, d in m.defs.items() if _is_carrier(pkg, d)}
    return pkg


def _part_names(modules: dict) -> frozenset:
    """The fields of settings.TrainSettings (the train block's parts), read from the source."""
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef) and node.name == "TrainSettings":
                return frozenset(s.target.id for s in node.body if isinstance(s, ast.AnnAssign))
    return DEFAULT_PARTS


def _collect_defs(mod: Module, body: list, prefix: str) -> None:
    for node in body:
        if isinstance(node, (*FUNCS, ast.ClassDef)):
            qual = f"{prefix}{node.name}"
            mod.defs[qual] = node
            _collect_defs(mod, node.body, qual + ".")
        elif isinstance(node, (ast.If, ast.Try)) and not prefix:  # `if TYPE_CHECKING:`, try/except ImportError
            _collect_defs(mod, [n for part in _branches(node) for n in part], prefix)


def _branches(node) -> list:
    if isinstance(node, ast.If):
        return [node.body, node.orelse]
    return [node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody]


def _collect_imports(pkg: Package, mod: Module) -> None:
    def visit(node, func: str | None, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, FUNCS):
                visit(child, _qual_of(mod, child) if func is None else func, type_only)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                for name, binding, target in _import_targets(pkg, mod, child):
                    table = mod.bindings if func is None else mod.local_bindings.setdefault(func, {})
                    table[name] = binding
                    if target and (target, child.lineno) not in {(i.target, i.line) for i in mod.imports}:
                        mod.imports.append(Import(mod.name, target, child.lineno, func is not None, type_only))
            else:
                checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
                visit(child, func, type_only or checking)

    visit(mod.tree, None, False)


def _qual_of(mod: Module, node) -> str:
    return next(q for q, d in mod.defs.items() if d is node)


def _import_targets(pkg: Package, mod: Module, node):
    """(local name, (module, attr | None) | None, imported package module | None) per imported name."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = alias.name if alias.name in pkg.modules else None
            if alias.asname:
                yield alias.asname, (alias.name, None) if target else None, target
            else:
                top = alias.name.split(".")[0]
                yield top, (top, None) if top in pkg.modules else None, target
        return
    base = _from_base(mod, node)
    for alias in node.names:
        local = alias.asname or alias.name
        full = f"{base}.{alias.name}"
        if full in pkg.modules:
            yield local, (full, None), full
        elif base in pkg.modules:
            yield local, (base, alias.name), base
        else:
            yield local, None, None


def _from_base(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


# ---------------------------------------------------------------- 1. whole-config parameters


def annotation_names(annotation) -> set[str]:
    if annotation is None:
        return set()
    text = annotation.value if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str) else None
    text = text if text is not None else ast.unparse(annotation)
    return set(re.findall(r"[A-Za-z_][\w.]*", text))


def holds(name: str, annotation, parts: frozenset = DEFAULT_PARTS) -> str | None:
    """What a parameter (or field) `name: annotation` holds (module doc, rule 1): "whole" (a raw config
    dict, the whole config's view or TrainSettings: counted), "view" (one non-train block's view: listed
    apart) or None."""
    names = annotation_names(annotation)
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        names = {"None"}
    views = {m.group(1) for m in map(BLOCK_VIEW.match, names) if m}
    if views & WHOLE_VIEWS:
        return "whole"
    if views:
        return "view"
    if any(PART_VIEW.match(n) for n in names) or name in parts:
        return None
    if names and names <= NOT_A_DICT:
        return None
    return "whole" if name in WHOLE_NAMES or name.endswith(WHOLE_SUFFIXES) else None


def is_whole(name: str, annotation, parts: frozenset = DEFAULT_PARTS) -> bool:
    """Whether a parameter (or field) holds a config block, whole or one block's view: what the walk
    follows (a view of another block than train never meets it)."""
    return holds(name, annotation, parts) is not None


def _params(node) -> list:
    a = node.args
    return [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs]


@dataclass(frozen=True)
class WholeFunction:
    module: str  # rel path
    function: str  # qualname
    param: str
    line: int


def whole_config_functions(pkg: Package, kind: str = "whole") -> list[WholeFunction]:
    """The functions with a parameter holding `kind` ("whole": the headline; "view": one block's view
    and nothing whole, listed apart)."""
    found = []
    for mod in pkg.modules.values():
        for qual, node in mod.defs.items():
            if isinstance(node, FUNCS):
                held = [(holds(p.arg, p.annotation, pkg.parts), p.arg) for p in _params(node)]
                first = next((h for h in held if h[0] == "whole"), None) or next((h for h in held if h[0]), None)
                if first and first[0] == kind:
                    found.append(WholeFunction(mod.rel, qual, first[1], node.lineno))
    return found


def config_lookups(pkg: Package) -> tuple[Counter, Counter]:
    """(look-ups on a whole-config parameter per file, the other `<whole name>["key"]` look-ups per
    file: on aliases and attributes such as run.cfg)."""
    on_param, other = Counter(), Counter()
    for mod in pkg.modules.values():
        for node in mod.defs.values():
            if not isinstance(node, FUNCS):
                continue
            whole = {p.arg for p in _params(node) if is_whole(p.arg, p.annotation, pkg.parts)}
            for sub in _own_nodes(node):
                if isinstance(sub, ast.Subscript) and _string_key(sub):
                    holder = _whole_holder(sub.value, pkg.parts)
                    if holder is not None:
                        (on_param if holder in whole and isinstance(sub.value, ast.Name) else other)[mod.rel] += 1
    return on_param, other


def _string_key(sub: ast.Subscript) -> bool:
    return isinstance(sub.slice, ast.Constant) and isinstance(sub.slice.value, str)


def _whole_holder(node, parts: frozenset) -> str | None:
    """The name of `cfg` in `cfg[...]` or of `cfg` in `run.cfg[...]` when named like a whole block."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name is not None and is_whole(name, None, parts) else None


def _own_nodes(func):
    """The nodes of a function's body, without those of functions or classes defined in it (a lambda's
    are its own: it is read where it is written)."""
    stack = list(reversed(func.body))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*FUNCS, ast.ClassDef)):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


# ---------------------------------------------------------------- resolving names


@dataclass(frozen=True)
class Ref:
    kind: str  # "module", "function", "class", "instance"
    module: str
    qual: str = ""


def lookup(pkg: Package, module: str, attr: str, depth: int = 0) -> Ref | None:
    """`attr` as module `module` defines or imports it (following re-exports), or a submodule."""
    mod = pkg.modules.get(module)
    if mod is None or depth > 8:
        return None
    node = mod.defs.get(attr)
    if node is not None:
        return Ref("class" if isinstance(node, ast.ClassDef) else "function", module, attr)
    if attr in mod.bindings:
        return _bound(pkg, mod.bindings[attr], depth + 1)
    if f"{module}.{attr}" in pkg.modules:
        return Ref("module", f"{module}.{attr}")
    return None


def _bound(pkg: Package, binding, depth: int = 0) -> Ref | None:
    if binding is None:
        return None
    target, attr = binding
    return Ref("module", target) if attr is None else lookup(pkg, target, attr, depth)


def _member(pkg: Package, owner: Ref, attr: str) -> Ref | None:
    if owner.kind == "module":
        return lookup(pkg, owner.module, attr)
    if owner.kind in ("class", "instance"):
        node = pkg.modules[owner.module].defs.get(f"{owner.qual}.{attr}")
        return Ref("function", owner.module, f"{owner.qual}.{attr}") if isinstance(node, FUNCS) else None
    return None


def _is_carrier(pkg: Package, node) -> bool:
    """A class with a whole-block field: `cfg: dict` in its body, or `self.cfg = ...` in __init__."""
    if not isinstance(node, ast.ClassDef):
        return False
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if is_whole(stmt.target.id, stmt.annotation, pkg.parts):
                return True
        if isinstance(stmt, FUNCS) and stmt.name == "__init__":
            for sub in ast.walk(stmt):
                target = sub.targets[0] if isinstance(sub, ast.Assign) and len(sub.targets) == 1 else None
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    if is_whole(target.attr, None, pkg.parts):
                        return True
    return False


# ---------------------------------------------------------------- 2. the walk


class Scope:
    """One function as the walk enters it: which names hold the block, and the types it knows."""

    def __init__(self, pkg: Package, ref: Ref, block: set, types: dict):
        self.pkg, self.ref = pkg, ref
        self.mod = pkg.modules[ref.module]
        self.node = self.mod.defs[ref.qual]
        self.block = set(block) | {p.arg for p in _params(self.node) if is_whole(p.arg, p.annotation, pkg.parts)}
        self.types = dict(types)
        self._type_params()
        for _ in range(2):  # an alias of an alias
            self._aliases()

    def _type_params(self) -> None:
        params = _params(self.node)
        owner = _owner_class(self.mod, self.ref.qual)
        if owner and params and not _decorated(self.node, "staticmethod"):
            kind = "class" if _decorated(self.node, "classmethod") else "instance"
            self.types.setdefault(params[0].arg, Ref(kind, self.mod.name, owner))
        for p in params:
            cls = self.annotated_class(p.annotation)
            if cls and p.arg not in self.types:
                self.types[p.arg] = cls

    def annotated_class(self, annotation) -> Ref | None:
        for name in sorted(annotation_names(annotation)):
            ref = self.resolve(ast.parse(name, mode="eval").body)
            if ref is not None and ref.kind == "class":
                return Ref("instance", ref.module, ref.qual)
        return None

    def _aliases(self) -> None:
        for node in _own_nodes(self.node):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                cls = self.annotated_class(node.annotation)
                if cls:
                    self.types[node.target.id] = cls
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                for name, value in _pairs(target, node.value):
                    if self.hands(value) == "block":
                        self.block.add(name)
                    elif isinstance(value, ast.Call):
                        made = self.made_by(value)
                        if made:
                            self.types[name] = made

    def made_by(self, call: ast.Call) -> Ref | None:
        """The class of what `call` returns: a package class's constructor, or a package function's
        return annotation."""
        ref = self.resolve(call.func)
        if ref is None:
            return None
        if ref.kind == "class":
            return Ref("instance", ref.module, ref.qual)
        if ref.kind == "function":
            return Scope.lite(self.pkg, ref).annotated_class(self.pkg.modules[ref.module].defs[ref.qual].returns)
        return None

    @classmethod
    def lite(cls, pkg: Package, ref: Ref) -> Scope:
        """A scope only for resolving names in `ref`'s module (no aliases, no types)."""
        scope = cls.__new__(cls)
        scope.pkg, scope.ref, scope.mod = pkg, ref, pkg.modules[ref.module]
        scope.node, scope.block, scope.types = scope.mod.defs[ref.qual], set(), {}
        return scope

    def resolve(self, expr) -> Ref | None:
        if isinstance(expr, ast.Call):  # Builder()._use(cfg), cls().method(...)
            return self.made_by(expr)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve(expr.value)
            return _member(self.pkg, owner, expr.attr) if owner else None
        if not isinstance(expr, ast.Name):
            return None
        name = expr.id
        if name in self.types:
            return self.types[name]
        quals = self.ref.qual.split(".")
        for i in range(len(quals), 0, -1):  # nested functions, then imports inside the enclosing functions
            enclosing = ".".join(quals[:i])
            if isinstance(self.mod.defs.get(f"{enclosing}.{name}"), FUNCS):
                return Ref("function", self.mod.name, f"{enclosing}.{name}")
            if name in self.mod.local_bindings.get(enclosing, {}):
                return _bound(self.pkg, self.mod.local_bindings[enclosing][name])
        return lookup(self.pkg, self.mod.name, name)

    def hands(self, arg) -> str | None:
        """ "block" when `arg` is the whole block, "carrier" when an object holding it, else None."""
        if isinstance(arg, ast.Name) and arg.id in self.block:
            return "block"
        if isinstance(arg, ast.Attribute) and is_whole(arg.attr, None, self.pkg.parts):
            return "block"
        ref = self.types.get(arg.id) if isinstance(arg, ast.Name) else None
        if ref is not None and (ref.module, ref.qual) in self.pkg.carriers:
            return "carrier"
        return None


def _owner_class(mod: Module, qual: str) -> str | None:
    parent = qual.rpartition(".")[0]
    return parent if parent and isinstance(mod.defs.get(parent), ast.ClassDef) else None


def _decorated(node, name: str) -> bool:
    return any(ast.unparse(d).split(".")[-1] == name for d in node.decorator_list)


def _pairs(target, value):
    """(name, value) per plain name a single assignment binds; tuples element by element."""
    if isinstance(target, ast.Name):
        yield target.id, value
    elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        for t, v in zip(target.elts, value.elts, strict=True):
            yield from _pairs(t, v)


def calls_in_order(func) -> list[ast.Call]:
    """The calls of a function's own body (lambdas included) in source order, as a reader meets them."""
    calls = [n for n in _own_nodes(func) if isinstance(n, ast.Call)]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


@dataclass(frozen=True)
class Stop:
    module: str  # rel path
    function: str
    depth: int
    caller: str | None  # the calling module's rel path
    line: int  # of the call, in the caller
    climb: bool  # the reader climbs back: this module imports (transitively) the previous stop's
    call_up: bool  # the call itself goes up: the callee's module imports (transitively) the caller's


@dataclass
class Walk:
    stops: list = field(default_factory=list)
    again: int = 0  # calls into a function already read
    notes: list = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys(s.module for s in self.stops))

    @property
    def climbs(self) -> list[Stop]:
        return [s for s in self.stops if s.climb]

    @property
    def calls_up(self) -> list[Stop]:
        return [s for s in self.stops if s.call_up]

    def entries(self) -> tuple[Counter, int]:
        """(entries per module, returns: entries into a module entered before), along the stops."""
        entries, returns, previous = Counter(), 0, None
        for stop in self.stops:
            if stop.module != previous:
                returns += stop.module in entries
                entries[stop.module] += 1
            previous = stop.module
        return entries, returns


class Walker:
    def __init__(self, pkg: Package):
        self.pkg = pkg
        self.reach = reachable(import_graph(pkg))
        self.walk = Walk()
        self.read: set = set()

    def enter(self, ref: Ref, block: set, types: dict, via: tuple) -> None:
        """Read function `ref` (the block arrived in `block`, carriers in `types`), then every call in
        it that hands the block on.  `via`: (calling module, line, depth) of the call."""
        caller, line, depth = via
        mod = self.pkg.modules[ref.module]
        previous = self.pkg.by_rel(self.walk.stops[-1].module).name if self.walk.stops else None
        climb = previous not in (None, ref.module) and previous in self.reach[ref.module]
        call_up = caller not in (None, ref.module) and caller in self.reach[ref.module]
        self.walk.stops.append(Stop(mod.rel, ref.qual, depth, self.rel(caller), line, climb, call_up))
        self.read.add(ref)
        scope = Scope(self.pkg, ref, block, types)
        for call in calls_in_order(scope.node):
            handed = _handed(scope, call)
            if handed:
                self.follow(scope, call, handed, depth)

    def follow(self, scope: Scope, call: ast.Call, handed: list, depth: int) -> None:
        where = f"{scope.mod.rel}:{call.lineno}"
        ref = scope.resolve(call.func)
        if ref is not None and ref.kind == "class":
            init = Ref("function", ref.module, f"{ref.qual}.__init__")
            if init.qual not in self.pkg.modules[ref.module].defs:
                self.walk.notes.append(f"{where} {ast.unparse(call.func)}(...) keeps the block (no __init__ to read)")
                return
            ref = init
        if ref is None or ref.kind != "function":
            if _inside_package(scope, call.func):
                self.walk.notes.append(f"{where} {ast.unparse(call.func)}(...) not resolved: not followed")
            return
        if ref in self.read:
            self.walk.again += 1
            return
        block, types = _bind(self.pkg, ref, handed)
        self.enter(ref, block, types, (scope.mod.name, call.lineno, depth + 1))

    def rel(self, module: str | None) -> str | None:
        return self.pkg.modules[module].rel if module else None


def _handed(scope: Scope, call: ast.Call) -> list:
    """[(position or keyword name, "block" | "carrier", type)] for each argument handing the block on."""
    handed = []
    for i, arg in enumerate(call.args):
        kind = scope.hands(arg)
        if kind:
            handed.append((i, kind, scope.types.get(getattr(arg, "id", None))))
    for kw in call.keywords:
        kind = scope.hands(kw.value) if kw.arg else None
        if kind:
            handed.append((kw.arg, kind, scope.types.get(getattr(kw.value, "id", None))))
    return handed


def _bind(pkg: Package, ref: Ref, handed: list) -> tuple[set, dict]:
    """The callee's parameters the handed arguments arrive in: (block names, carriers' types)."""
    mod = pkg.modules[ref.module]
    node = mod.defs[ref.qual]
    positional = [p.arg for p in (*node.args.posonlyargs, *node.args.args)]
    if _owner_class(mod, ref.qual) and not _decorated(node, "staticmethod"):
        positional = positional[1:]
    named = {p.arg for p in _params(node)}
    block, types = set(), {}
    for where, kind, typ in handed:
        name = positional[where] if isinstance(where, int) and where < len(positional) else where
        if not isinstance(name, str) or name not in named:
            continue
        if kind == "block":
            block.add(name)
        elif typ is not None:
            types[name] = typ
    return block, types


def _inside_package(scope: Scope, func) -> bool:
    """Whether an unresolved callee's root name is one of the package's (not json, torch, a builtin)."""
    root = func
    while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
        root = root.value if not isinstance(root, ast.Call) else root.func
    if not isinstance(root, ast.Name):
        return False
    return root.id in scope.types or scope.resolve(root) is not None


def walk_from(pkg: Package, rel: str = START[0], function: str = START[1]) -> Walk:
    """The walk from `function` in module `rel` (module doc, 2), its whole-config parameters holding the block."""
    walker = Walker(pkg)
    walker.enter(Ref("function", pkg.by_rel(rel).name, function), set(), {}, (None, 0, 0))
    return walker.walk


# ---------------------------------------------------------------- 3. import circles


def import_graph(pkg: Package, hidden: bool = False) -> dict[str, set]:
    """Module -> the package modules it imports at module level (and in functions when `hidden`)."""
    graph = {name: set() for name in pkg.modules}
    for mod in pkg.modules.values():
        for imp in mod.imports:
            if hidden or not imp.hidden:
                graph[imp.source].add(imp.target)
    return graph


def reachable(graph: dict) -> dict[str, set]:
    """Module -> every module it imports, directly or through others."""
    out = {}
    for start in graph:
        seen, stack = set(), list(graph[start])
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(graph.get(node, ()))
        out[start] = seen
    return out


def strongly_connected(graph: dict) -> list[list[str]]:
    """The import circles: components of more than one module, or a module importing itself."""
    reach = reachable(graph)
    done, circles = set(), []
    for node in sorted(graph):
        if node in done or node not in reach[node]:
            continue
        component = sorted(n for n in reach[node] if node in reach[n])
        done.update(component)
        circles.append(component)
    return circles


@dataclass
class Circles:
    module_level: list  # [[rel, ...], ...]
    hidden_only: list  # circles that need an import inside a function to close
    edges: dict  # circle (tuple of rels) -> ["a.py:12 -> b.py (type-only)", ...]


def import_circles(pkg: Package) -> Circles:
    rel = {name: m.rel for name, m in pkg.modules.items()}
    static = strongly_connected(import_graph(pkg))
    full = [c for c in strongly_connected(import_graph(pkg, hidden=True)) if c not in static]
    edges = {}
    for component in static + full:
        inside = set(component)
        key = tuple(rel[n] for n in component)
        edges[key] = [
            f"{rel[imp.source]}:{imp.line} -> {rel[imp.target]}"
            + (" (hidden)" if imp.hidden else " (type-only)" if imp.type_only else "")
            for n in component
            for imp in pkg.modules[n].imports
            if imp.target in inside and imp.source != imp.target or imp.source == imp.target == n
        ]
    return Circles([[rel[n] for n in c] for c in static], [[rel[n] for n in c] for c in full], edges)


# ---------------------------------------------------------------- the numbers


def measure(pkg: Package, start: tuple = START) -> dict:
    """Every figure the issue gives, measured on `pkg`."""
    functions = whole_config_functions(pkg)
    views = whole_config_functions(pkg, "view")
    on_param, other = config_lookups(pkg)
    walk = walk_from(pkg, *start)
    entries, returns = walk.entries()
    circles = import_circles(pkg)
    return {
        "functions": functions,
        "function_modules": sorted({f.module for f in functions}),
        "views": views,
        "view_modules": sorted({f.module for f in views}),
        "lookups": sum(on_param.values()),
        "lookup_files": len(on_param),
        "other_lookups": sum(other.values()),
        "walk": walk,
        "stops": len(walk.stops),
        "modules": walk.modules,
        "climbs": len(walk.climbs),
        "calls_up": len(walk.calls_up),
        "returns": returns,
        "entries": entries,
        "circles": circles,
    }


def report(m: dict, quiet: bool = False) -> list[str]:
    lines = [f"whole-config functions: {len(m['functions'])} in {len(m['function_modules'])} modules (issue: 96 in 29)"]
    if not quiet:
        lines += [f"  {f.module}:{f.line} {f.function}({f.param})" for f in m["functions"]]
    lines.append(
        f"one block's view (a stage's own view, not counted above): {len(m['views'])} in {len(m['view_modules'])} modules"
    )
    if not quiet:
        lines += [f"  {f.module}:{f.line} {f.function}({f.param})" for f in m["views"]]
    lines.append(
        f"look-ups on a whole-config parameter: {m['lookups']} in {m['lookup_files']} files (issue: 176 in 23);"
        f" {m['other_lookups']} more on aliases and attributes (cfg = run.cfg, run.cfg[...])"
    )
    walk = m["walk"]
    lines.append("walk:")
    if not quiet:
        for s in walk.stops:
            mark = " [climbs back]" if s.climb else ""
            mark += " [call up]" if s.call_up else ""
            lines.append(f"  {'  ' * s.depth}{s.module} {s.function}{mark}")
        lines += [f"  note: {n}" for n in walk.notes]
    top = ", ".join(f"{mod} {n}" for mod, n in m["entries"].most_common(5))
    lines += [
        f"  {m['stops']} stops in {len(m['modules'])} modules, {m['climbs']} climbing back, {m['returns']} returns to a"
        f" module already left, {m['calls_up']} calls up, {walk.again} calls of a function already read"
        " (issue: 44 stops in 17 modules, 13 climbs, 27 returns)",
        f"  entries: {top} (issue: train/batchplan.py 7, train/memory.py 6, loaders/__init__.py 5)",
    ]
    circles = m["circles"]
    for kind, found in (("import circle", circles.module_level), ("hidden import circle", circles.hidden_only)):
        for component in found:
            lines.append(f"{kind}: {' <-> '.join(component)}: {'; '.join(circles.edges[tuple(component)])}")
    if not circles.module_level:
        lines.append("no module-level import circle")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--root", type=Path, default=PACKAGE_ROOT, help="the package directory (default: workflow/rectrain)"
    )
    ap.add_argument("--start", default=":".join(START), help="module:function the walk starts from")
    ap.add_argument("--quiet", action="store_true", help="the numbers only, not the lists")
    args = ap.parse_args(argv)
    start = tuple(args.start.split(":", 1))
    print("\n".join(report(measure(load_package(args.root), start), args.quiet)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
