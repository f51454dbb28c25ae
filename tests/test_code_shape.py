"""Functions a reader can hold in their head: in workflow/rectrain no function is longer than about
60 lines unless its docstring says why ("Long because ..."), and none takes more than 6 positional
parameters (a longer list wants a small context object or keyword-only arguments)."""

import ast

from helpers import REPO

PACKAGE = REPO / "workflow" / "rectrain"
MAX_LINES = 60
MAX_POSITIONAL = 6


def functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}", node


def positional(node) -> int:
    names = [a.arg for a in node.args.posonlyargs + node.args.args]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


def test_the_package_has_functions_to_check():
    assert sum(1 for _ in functions()) > 100


def test_no_function_is_long_without_a_reason():
    long = [
        f"{where} ({node.end_lineno - node.lineno + 1} lines)"
        for where, node in functions()
        if node.end_lineno - node.lineno + 1 > MAX_LINES and "Long because" not in (ast.get_docstring(node) or "")
    ]
    assert not long, "split these into named steps, or say why in the docstring: " + "; ".join(long)


def test_no_function_takes_more_than_six_positional_parameters():
    wide = [f"{where} ({positional(node)})" for where, node in functions() if positional(node) > MAX_POSITIONAL]
    assert not wide, "use a small context object or keyword-only parameters: " + "; ".join(wide)
