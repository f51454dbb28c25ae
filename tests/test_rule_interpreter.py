"""The rules run the interpreter that runs Snakemake, not whatever `python` the PATH holds: many machines
have only `python3` (this one among them), and a `python` elsewhere on the PATH lacks the packages."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import REPO

from rectrain.snakefile.jobenv import python_dir

pytestmark = pytest.mark.slow


def python3_only_venv(root: Path) -> Path:
    """A scratch venv whose bin/ has python3 but no python, seeing this test environment's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    (root / "bin" / "python").unlink()
    site = next((root / "lib").glob("python3*/site-packages"))
    (site / "test_env.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return root / "bin" / "python3"


def test_rules_run_snakemakes_interpreter_when_path_has_a_wrong_python(tmp_path):
    python3 = python3_only_venv(tmp_path / "venv")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "python").write_text("#!/bin/sh\necho 'a bare python ran' >&2\nexit 97\n")
    (wrong / "python").chmod(0o755)
    env = dict(os.environ, PATH=os.pathsep.join([str(wrong), "/usr/bin", "/bin"]))
    work = tmp_path / "work"
    proc = subprocess.run(
        [str(python3), "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(work)]
        + ["--cores", "1", "results/demo/index/classes.tsv"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = "".join(p.read_text() for p in (work / "logs").rglob("*.log"))
    assert "a bare python ran" not in logs
    assert (work / "results" / "demo" / "index" / "classes.tsv").read_text().startswith("label\twnid")
    assert (work / "results" / "demo" / "raw" / ".done").exists()


def test_an_interpreter_with_its_own_python_is_used_as_is_and_no_wrapper_is_written(tmp_path):
    assert python_dir(sys.executable, tmp_path) == Path(sys.executable).parent
    assert not (tmp_path / ".snakemake").exists()


def test_an_interpreter_without_python_beside_it_gets_a_wrapper_that_runs_it(tmp_path):
    python3 = python3_only_venv(tmp_path / "venv")
    folder = python_dir(str(python3), tmp_path / "work")
    assert folder == tmp_path / "work" / ".snakemake" / "rectrain-bin"
    out = subprocess.run(
        [str(folder / "python"), "-c", "import sys, snakemake; print(sys.executable)"],
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert out.stdout.strip() == str(python3), out.stderr
