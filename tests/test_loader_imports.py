"""rectrain.loaders imports the loaders it builds (dali.py, pytorch.py, jpeg.py, inside its functions),
so none of its modules may import the package back: what they share lives in loaders/spec.py."""

import ast
import inspect

from rectrain.sources import PACKAGE_DIR

LOADERS = PACKAGE_DIR / "loaders"


def imports_of_the_package(path) -> list[str]:
    """`from rectrain.loaders import X` lines in `path` where X is no submodule: a name from __init__.py."""
    submodules = {p.stem for p in LOADERS.glob("*.py")}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "rectrain.loaders":
            found += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name not in submodules]
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno}" for a in node.names if a.name == "rectrain.loaders"]
    return found


def test_no_loader_module_imports_a_name_back_from_the_loaders_package():
    back = [
        line
        for path in sorted(LOADERS.glob("*.py"))
        if path.name != "__init__.py"
        for line in imports_of_the_package(path)
    ]
    assert back == [], f"import these from rectrain.loaders.spec (or their own module) instead: {back}"


def test_every_name_the_loaders_share_is_still_importable_from_the_package():
    """Stages, tests and benches import them from rectrain.loaders, as before spec.py."""
    import rectrain.loaders as package
    from rectrain.loaders import spec

    public = {
        name
        for name, value in vars(spec).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and getattr(value, "__module__", spec.__name__) == spec.__name__  # not imported into spec
    }
    assert public <= set(package.__all__)
    assert all(getattr(package, n) is getattr(spec, n) for n in public)
