"""Code inputs are derived from imports (rectrain.sources), so a module a stage uses cannot be left out."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import scheduled_rules, snakemake

from rectrain import sources
from rectrain.sources import PACKAGE_DIR, STAGE_ENTRIES, import_closure, stage_sources


def rel(paths, package_dir: Path = PACKAGE_DIR) -> set[str]:
    return {str(p.relative_to(package_dir)) for p in paths}


@pytest.mark.parametrize("stage", sorted(STAGE_ENTRIES))
def test_stage_sources_include_every_rectrain_module_the_stage_loads(stage):
    """Import the stage's entry modules in a fresh interpreter: every rectrain module that ends up in
    sys.modules must be among the rule's code inputs."""
    code = textwrap.dedent(f"""
        import importlib, json, sys
        for name in {list(STAGE_ENTRIES[stage])!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items()
                                if n.split('.')[0] == 'rectrain' and getattr(m, '__file__', None))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = {str(__import__("pathlib").Path(f).resolve().relative_to(PACKAGE_DIR)) for f in json.loads(out)}
    assert loaded, "the entry modules loaded no rectrain module"
    assert loaded <= rel(stage_sources(stage)), loaded - rel(stage_sources(stage))


def test_training_sources_include_what_the_old_hand_list_missed():
    # Both loaders read records through recordio; the launcher copies through local_copy; run.json is
    # written through atomic and names the .rec's disk through storage.
    train = rel(stage_sources("train"))
    assert {"recordio.py", "storage.py", "atomic.py", "train/local_copy.py", "loaders/dali.py"} <= train


# Each stage's package, in pipeline order: a stage's closure holds no module of a later stage's package.
STAGE_PACKAGES = [("train", "train/"), ("evaluate", "evaluate.py"), ("report", "report/")]


@pytest.mark.parametrize("stage", ["demo_data", "index_raw", "pack", "check_recordio", "train", "evaluate"])
def test_no_stage_imports_a_later_stages_code_so_editing_that_never_reruns_it(stage):
    order = [s for s, _ in STAGE_PACKAGES]
    later = (
        [prefix for s, prefix in STAGE_PACKAGES if s not in order[: order.index(stage) + 1]]
        if stage in order
        else [prefix for _, prefix in STAGE_PACKAGES]
    )
    mine = rel(stage_sources(stage))
    assert not [p for p in mine if p.startswith(tuple(later))], f"{stage} imports a later stage's code"


def test_report_sources_include_its_template_and_of_training_only_the_telemetry_contract():
    # the report imports the telemetry column names (the files' contract); no other training code
    report = rel(stage_sources("report"))
    assert "report/templates/report.html.j2" in report
    assert {p for p in report if p.startswith("train/")} == {"train/__init__.py", "train/telemetry.py"}


def test_closure_follows_imports_inside_functions_and_relative_imports(tmp_path):
    pkg = tmp_path / "rectrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "entry.py").write_text("def f():\n    from rectrain.sub import lazy\n    return lazy\n")
    (pkg / "sub" / "lazy.py").write_text("from . import sibling\n")
    (pkg / "sub" / "sibling.py").write_text("import os\n")
    (pkg / "unused.py").write_text("")
    found = {str(p.relative_to(pkg)) for p in import_closure(["rectrain.entry"], pkg)}
    assert found == {"__init__.py", "entry.py", "sub/__init__.py", "sub/lazy.py", "sub/sibling.py"}


def test_fingerprint_changes_when_a_source_changes(tmp_path):
    pkg = tmp_path / "rectrain"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "data" / "demo.py").write_text("X = 1\n")
    before = sources.fingerprint("demo_data", pkg)
    (pkg / "data" / "demo.py").write_text("X = 2\n")
    sources.all_stage_sources.cache_clear()
    after = sources.fingerprint("demo_data", pkg)
    assert set(before) == {"__init__.py", "data/__init__.py", "data/demo.py"}
    assert before["data/demo.py"] != after["data/demo.py"]


def small_package(root: Path) -> Path:
    pkg = root / "rectrain"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "data" / "demo.py").write_text("X = 1\n")
    return pkg


def closure_now(stage: str, pkg: Path) -> set[str]:
    """A new process's view: nothing remembered in memory, only what is on disk."""
    sources.all_stage_sources.cache_clear()
    return rel(stage_sources(stage, pkg), pkg)


def test_a_dry_run_reuses_the_saved_closures_without_parsing_any_module(tmp_path, monkeypatch):
    pkg = small_package(tmp_path)
    first = closure_now("demo_data", pkg)
    assert (pkg / sources.CACHE).is_file()

    def must_not_parse(*args):
        raise AssertionError("the closures were derived again although no file of the package changed")

    monkeypatch.setattr(sources, "_closures", must_not_parse)
    assert closure_now("demo_data", pkg) == first == {"__init__.py", "data/__init__.py", "data/demo.py"}


def test_the_saved_closures_follow_an_edited_import_and_a_new_module(tmp_path):
    pkg = small_package(tmp_path)
    assert "helper.py" not in closure_now("demo_data", pkg)
    # an edit that adds an import of a module that does not exist yet: the closure cannot hold it...
    (pkg / "data" / "demo.py").write_text("from rectrain import helper\nX = 1\n")
    assert "helper.py" not in closure_now("demo_data", pkg)
    # ...until the file is created, which changes the package's listing
    (pkg / "helper.py").write_text("from rectrain import extra\n")
    (pkg / "extra.py").write_text("")
    assert {"helper.py", "extra.py"} <= closure_now("demo_data", pkg)


def test_an_unreadable_saved_closure_is_derived_again(tmp_path):
    pkg = small_package(tmp_path)
    closure_now("demo_data", pkg)
    (pkg / sources.CACHE).write_text("{not json")
    assert closure_now("demo_data", pkg) == {"__init__.py", "data/__init__.py", "data/demo.py"}


def test_unknown_stage_is_named():
    with pytest.raises(KeyError, match="unknown pipeline stage 'trian'"):
        stage_sources("trian")


def test_an_edit_that_keeps_size_and_time_reruns_its_stage_in_snakemake(tmp_path):
    pkg = small_package(tmp_path)
    snakefile = tmp_path / "Snakefile"
    snakefile.write_text(
        textwrap.dedent(f"""\
            import sys
            sys.path.insert(0, {str(PACKAGE_DIR.parent)!r})
            from rectrain.sources import stage_sources

            rule demo:
                input: stage_sources("demo_data", {str(pkg)!r})
                output: "out.txt"
                shell: "echo done > {{output}}"
            """)
    )
    snakemake("--cores", "1", "out.txt", cwd=tmp_path, snakefile=snakefile, check=True)
    assert scheduled_rules(snakemake("-n", "out.txt", cwd=tmp_path, snakefile=snakefile, check=True).stdout) == {}
    demo = pkg / "data" / "demo.py"
    st = demo.stat()
    demo.write_text("X = 2\n")  # same size
    os.utime(demo, ns=(st.st_atime_ns, st.st_mtime_ns))  # same time (cp -p, rsync -t, a restored checkout)
    assert demo.stat().st_size == st.st_size
    dry = snakemake("-n", "out.txt", cwd=tmp_path, snakefile=snakefile, check=True)
    assert scheduled_rules(dry.stdout) == {"demo": 1}, dry.stdout
