"""bench/config_flow.py finds what it should on small made-up packages, and the issue's targets on
rectrain: at most 10 functions take a whole config, the train block's walk from train.trainer.train
visits at most 10 modules and climbs back at most 5 times, and no import circle anywhere, not even one
closed by an import inside a function.  The counting rule is bench/config_flow.py's docstring."""

import sys
import textwrap

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import config_flow  # noqa: E402

MAX_WHOLE_FUNCTIONS = 10
MAX_WALK_MODULES = 10
MAX_CLIMBS = 5


def make_package(tmp_path, files: dict):
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    for folder in {p.parent for p in root.rglob("*.py")}:
        (folder / "__init__.py").touch()
    return config_flow.load_package(root)


# A known walk: top.start -> low.use (-> low.helper) -> mid.step(run) -> back up to top.finish
WALK = {
    "top.py": """
        from pkg import low
        from pkg.mid import Run, step

        def start(args, cfg: dict):
            low.use(cfg, 1)
            run = Run(cfg)
            step(run)
            print(cfg["x"])
            finish(cfg)
            low.use(cfg, 2)

        def finish(cfg):
            return cfg["y"]
        """,
    "mid.py": """
        from dataclasses import dataclass
        from pkg.low import helper

        @dataclass
        class Run:
            cfg: dict

        def step(run: Run):
            helper(other=run.cfg)
            untouched(3)

        def untouched(n):
            return n
        """,
    "low.py": """
        def use(cfg, n):
            helper(other=cfg)
            return cfg["a"], cfg["b"]

        def helper(*, other):
            return other
        """,
}


def test_whole_config_functions_by_name_and_annotation(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "a.py": """
                def one(cfg: dict): return cfg["k"]
                def two(train_cfg): return train_cfg
                def three(s: "TrainSettings"): return s
                def four(settings: TrainSettings): return settings
                def none(args, cfg: None): return args
                def part(cfg: TrainOptim): return cfg
                def part_name(optim): return optim
                def flag(config_required: bool): return config_required
                def other(n: int): return n["k"]
                """,
            "b/c.py": """
                class Packer:
                    def __init__(self, config: dict): self.config = config["z"]
                """,
        },
    )
    found = {(f.module, f.function) for f in config_flow.whole_config_functions(pkg)}
    assert found == {
        ("a.py", "one"),
        ("a.py", "two"),
        ("a.py", "three"),
        ("a.py", "four"),
        ("b/c.py", "Packer.__init__"),
    }
    on_param, other = config_flow.config_lookups(pkg)
    assert on_param == {"a.py": 1, "b/c.py": 1}
    assert not other


def test_a_blocks_own_view_is_listed_apart_and_the_whole_and_train_views_are_counted(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "stage.py": """
                from pkg.settings import PackSettings, TrainSettings, WholeSettings

                def pack_view(pack: PackSettings): return pack.threads
                def named_cfg(cfg: "settings.EvaluateSettings"): return cfg
                def train_whole(s: TrainSettings): return s
                def whole_view(config: WholeSettings): return config
                def raw(args, cfg): return cfg["k"]
                def both(pack: PackSettings, train_cfg): return train_cfg
                def part(optim, loaders: TrainLoaders): return optim
                """,
        },
    )
    counted = {f.function for f in config_flow.whole_config_functions(pkg)}
    apart = {f.function for f in config_flow.whole_config_functions(pkg, "view")}
    assert counted == {"train_whole", "whole_view", "raw", "both"}
    assert apart == {"pack_view", "named_cfg"}
    measured = config_flow.measure(pkg, ("stage.py", "raw"))
    printed = "\n".join(config_flow.report(measured))
    assert "whole-config functions: 4 in 1 modules" in printed
    assert "one block's view (a stage's own view, not counted above): 2 in 1 modules" in printed
    assert "stage.py:4 pack_view(pack)" in printed


def test_lookups_on_aliases_are_counted_apart(tmp_path):
    pkg = make_package(tmp_path, WALK)
    on_param, other = config_flow.config_lookups(pkg)
    assert on_param == {"top.py": 2, "low.py": 2}
    assert not other
    pkg = make_package(tmp_path / "b", {"m.py": "def f(run):\n    cfg = run.cfg\n    return cfg['a'], run.cfg['b']\n"})
    assert config_flow.config_lookups(pkg) == ({}, {"m.py": 2})


def test_the_walk_follows_the_block_in_reading_order(tmp_path):
    pkg = make_package(tmp_path, WALK)
    walk = config_flow.walk_from(pkg, "top.py", "start")
    assert [(s.module, s.function) for s in walk.stops] == [
        ("top.py", "start"),
        ("low.py", "use"),
        ("low.py", "helper"),
        ("mid.py", "step"),  # run holds the block (Run.cfg): a carrier
        ("top.py", "finish"),
    ]
    assert [s.depth for s in walk.stops] == [0, 1, 2, 1, 1]
    assert walk.modules == ["top.py", "low.py", "mid.py"]
    # mid imports low: mid is higher; top imports both
    assert [(s.module, s.function) for s in walk.climbs] == [("mid.py", "step"), ("top.py", "finish")]
    assert not walk.calls_up
    entries, returns = walk.entries()
    assert entries == {"top.py": 2, "low.py": 1, "mid.py": 1}
    assert returns == 1
    assert walk.again == 2  # helper from step, use a second time
    assert any("Run(...) keeps the block" in n for n in walk.notes)


def test_the_walk_resolves_aliases_methods_and_reexports(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "api.py": "from pkg.impl.core import Builder as Builder\n",
            "impl/core.py": """
                class Builder:
                    @classmethod
                    def from_config(cls, cfg): return cls()._use(cfg)
                    def _use(self, cfg): return cfg
                """,
            "entry.py": """
                from pkg import api as facade

                def go(holder):
                    d, cfg = holder.d, holder.cfg
                    facade.Builder.from_config(cfg)
                    missing(cfg)
                """,
        },
    )
    walk = config_flow.walk_from(pkg, "entry.py", "go")
    assert [(s.module, s.function) for s in walk.stops] == [
        ("entry.py", "go"),
        ("impl/core.py", "Builder.from_config"),
        ("impl/core.py", "Builder._use"),
    ]
    assert not walk.notes  # `missing` is no name of the package: not followed, no note


def test_a_call_up_is_a_call_into_a_module_that_imports_the_callers(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "high.py": "from pkg import low\n\ndef top(cfg):\n    low.down(cfg)\n\ndef back(cfg):\n    return cfg\n",
            "low.py": "def down(cfg):\n    from pkg.high import back\n    back(cfg)\n",
        },
    )
    walk = config_flow.walk_from(pkg, "high.py", "top")
    assert [(s.function, s.call_up, s.climb) for s in walk.stops] == [
        ("top", False, False),
        ("down", False, False),
        ("back", True, True),
    ]
    circles = config_flow.import_circles(pkg)
    assert circles.module_level == []
    assert circles.hidden_only == [["high.py", "low.py"]]


def test_import_circles_module_level_type_only_and_hidden(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "a.py": "from pkg.b import B\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\nclass B: ...\n",
            "c.py": "from . import d\n",
            "d.py": "def f():\n    from pkg import c\n",
            "e.py": "import json\nfrom pkg import a\n",
        },
    )
    circles = config_flow.import_circles(pkg)
    assert circles.module_level == [["a.py", "b.py"]]
    assert circles.hidden_only == [["c.py", "d.py"]]
    assert circles.edges[("a.py", "b.py")] == ["a.py:1 -> b.py", "b.py:3 -> a.py (type-only)"]
    assert circles.edges[("c.py", "d.py")] == ["c.py:1 -> d.py", "d.py:2 -> c.py (hidden)"]


def test_the_script_prints_the_numbers(capsys):
    assert config_flow.main(["--quiet"]) == 0
    out = capsys.readouterr().out
    assert "whole-config functions:" in out and "stops in" in out


# ---------------------------------------------------------------- the targets, on rectrain


@pytest.fixture(scope="module")
def measured():
    return config_flow.measure(config_flow.load_package())


def test_the_tool_sees_the_package(measured):
    assert measured["stops"] >= 1 and measured["walk"].stops[0].function == "train"


def test_at_most_ten_functions_take_a_whole_config(measured):
    functions = measured["functions"]
    listed = "; ".join(f"{f.module}:{f.line} {f.function}({f.param})" for f in functions)
    assert len(functions) <= MAX_WHOLE_FUNCTIONS, (
        f"{len(functions)} functions in {len(measured['function_modules'])} modules take a whole config"
        f" (target: at most {MAX_WHOLE_FUNCTIONS}): {listed}"
    )


def test_the_train_block_visits_at_most_ten_modules(measured):
    walk = measured["walk"]
    path = "; ".join(f"{s.module} {s.function}" for s in walk.stops)
    assert len(walk.modules) <= MAX_WALK_MODULES, (
        f"the train block from train.trainer.train reaches {len(walk.modules)} modules (target: at most"
        f" {MAX_WALK_MODULES}): {', '.join(walk.modules)}; {len(walk.stops)} stops: {path}"
    )


def test_the_train_block_climbs_back_at_most_five_times(measured):
    walk = measured["walk"]
    climbs = "; ".join(f"{s.module} {s.function} (called from {s.caller}:{s.line})" for s in walk.climbs)
    ups = "; ".join(f"{s.caller}:{s.line} -> {s.module} {s.function}" for s in walk.calls_up)
    assert len(walk.climbs) <= MAX_CLIMBS and len(walk.calls_up) <= MAX_CLIMBS, (
        f"{len(walk.climbs)} climbs back (target: at most {MAX_CLIMBS}): {climbs};"
        f" {len(walk.calls_up)} calls up: {ups or 'none'}"
    )


def test_no_import_circle_not_even_through_an_import_inside_a_function(measured):
    """Module-level circles fail, and so does one closed only by an import inside a function (as
    loaders/__init__.py's lazy DALI and torch loaders once closed one: they now take what they share from
    loaders/spec.py)."""
    circles = measured["circles"]

    def described(found):
        return "; ".join(f"{' <-> '.join(c)} ({', '.join(circles.edges[tuple(c)])})" for c in found) or "none"

    assert not circles.module_level and not circles.hidden_only, (
        f"import circles: {described(circles.module_level)}; closed only by hidden imports: {described(circles.hidden_only)}"
    )
