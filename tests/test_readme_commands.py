"""Every command the docs tell a user to type works as written, on a fresh copy of the repository.

The commands are found by tests/helpers/doc_commands.py (```bash blocks of README.md and docs/**/*.md,
command lines in the headers of config/*.yaml and the Snakefile). Each runs in one scratch copy of the
working tree (tracked and untracked files, no results/ or .snakemake/), with this checkout's .venv
first on PATH, as written or with the substitution RUN_AS names - a dry-run where a real run is the
whole pipeline, a tiny generated image tree where a config names a real ImageNet path - or is listed
in SKIPPED with the reason. A command that matches neither fails the test: nothing is skipped silently.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import REPO, VENV_BIN
from helpers.doc_commands import documented_commands, markdown_commands, swallowed_by_configfile
from helpers.packdata import jpeg, photo

# Commands not run here, each with the reason; an entry that matches no documented command fails.
SKIPPED = {
    r"^make test\b": "style, the whole suite, a dry-run and --lint: the suite is the lead's to run; its dry-run "
    "is `snakemake -n` below and its lint tests/test_workflow.py::test_lint_is_clean",
    r"^make check\b": "style and the tests that need no pipeline run: a tier of this suite, which is the lead's "
    "to run (as `make test`)",
    r"^git clone ": "this test's fresh copy of the repository is that step",
    r"^apt-get install ": "installs system packages as root (tests/test_slurm.py's own set-up)",
    r"pytest tests/test_slurm\.py": "a test itself: a real single-host SLURM, as root (tests/test_slurm.py)",
    r"^make live\b": "builds the report of a run in progress, which a fresh copy has not started: "
    "tests/test_live_report_run.py runs it against a real training, mid-run and killed",
    r"^python -m rectrain\.report\.compare ": "builds the comparison of runs a fresh copy has not started: "
    "tests/test_runs_side_by_side.py builds it through the compare rule and renders it in Chromium",
    r"^mkdir -p results/demo/main && mv results/demo/train ": "moves in a run of an earlier version, which a fresh "
    "copy has not: tests/test_sweep.py checks the line Snakemake prints with this command",
    r"^tensorboard --logdir ": "starts TensorBoard's web server, which runs until stopped; the event files it "
    "shows are read back with tensorboard's own reader (tests/test_train_curves.py, tests/test_train_preempt.py)",
}
DRY_RUN = "-n added: a real run is the whole pipeline (tests/test_pipeline_e2e.py runs the demo for real)"
# The make targets that start Snakemake take SNAKEMAKE_ARGS; -o: the shared .venv is never reinstalled.
MAKE = "make -o .venv/.installed -o .venv-mxnet/.installed"
# Config files the docs tell you to write yourself: what stands in for each here.
WRITTEN_BY_YOU = {
    "config/my-imagenet.yaml": "config/imagenet-2gpu.yaml",
    "config/cluster.yaml": "config/imagenet-2gpu.yaml",
    "config/my-data.yaml": "docs/your-data.md, 'Your own dataset'",
}
# The form the README had before (issue 27): Snakemake reads the target as a config file.
OLD_FORM = "snakemake --cores 8 --configfile config/my-imagenet.yaml results/report.html"


def run_as(text: str) -> tuple[str, str]:
    """The line to run on the copy and how it differs from the docs."""
    line = re.sub(r"\s+#\s.*$", "", text).replace("<dataset>", "demo")
    if line.startswith("snakemake "):
        if re.search(r"(^|\s)(-n|--dry-run|--unlock)(\s|$)", line):
            return line, "as written"
        return "snakemake -n " + line[len("snakemake ") :], DRY_RUN
    if line.startswith("make "):
        dry = " SNAKEMAKE_ARGS=-n" if re.match(r"make (report|run)\b", line) else ""
        return f"{MAKE} {line[len('make ') :]}{dry}", "the .venv stamp kept" + (", " + DRY_RUN if dry else "")
    return line, "as written"


def skip_reason(text: str) -> str | None:
    return next((why for pattern, why in SKIPPED.items() if re.search(pattern, text)), None)


def tiny_tree(root: Path) -> Path:
    """A custom dataset as docs/your-data.md's 'Your own dataset' describes: class folders of JPEGs."""
    for split, count in (("train", 3), ("val", 1)):
        for label, cls in enumerate(["cat", "dog"]):
            (root / split / cls).mkdir(parents=True)
            for i in range(count):
                (root / split / cls / f"{i}.jpg").write_bytes(jpeg(photo(48, 40, seed=label * 10 + i)))
    return root


# Where the minimal config of your own is written out (moved there from the README).
OWN_DATA_PAGE = "docs/your-data.md"
# The pages the README's text moved to: each gives commands, so each must be scanned.
MOVED_PAGES = {"docs/your-data.md", "docs/recipes.md", "docs/rerun-semantics.md", "docs/training.md"}


def readme_minimal_config() -> dict:
    """The first ```yaml block of the 'Your own dataset' section of docs/your-data.md."""
    section = REPO.joinpath(OWN_DATA_PAGE).read_text().split("## Your own dataset", 1)[1].split("\n## ", 1)[0]
    return yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])


def fresh_copy(dest: Path) -> Path:
    """The working tree as a clone would have it, plus uncommitted edits; .venv links to this one's."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / ".venv").symlink_to(VENV_BIN.parent)
    return dest


def substitute_configs(copy: Path, raw: Path) -> None:
    """Real paths in the shipped reference config point at a tiny tree; the configs you write yourself
    are written from what the docs say to start from."""
    ref = yaml.safe_load((copy / "config" / "imagenet-2gpu.yaml").read_text())
    ref["raw"], ref["pack"]["fast_storage"] = str(raw), str(copy / "ssd")
    (copy / "config" / "imagenet-2gpu.yaml").write_text(yaml.safe_dump(ref))
    own = {**readme_minimal_config(), "raw": str(raw)}
    for name, origin in WRITTEN_BY_YOU.items():
        (copy / name).write_text(yaml.safe_dump(own if origin.startswith(OWN_DATA_PAGE) else ref))


def shell(copy: Path, line: str, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{copy / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(
        ["bash", "-c", line], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_the_docs_give_commands_in_every_place_the_rule_covers():
    where = {c.where.split(":")[0] for c in documented_commands(REPO)}
    assert {"README.md", "docs/cluster.md", "config/imagenet-2gpu.yaml", "config/gpu.yaml", "Snakefile"} <= where
    assert MOVED_PAGES <= where, f"pages whose commands are not scanned: {MOVED_PAGES - where}"
    texts = [c.text for c in documented_commands(REPO)]
    assert "snakemake --cores 8 results/report.html --configfile config/my-imagenet.yaml" in texts
    readme = [c.text for c in documented_commands(REPO) if c.where.startswith("README.md:")]
    assert any(t.startswith("make run CONFIG=") for t in readme), "the README documents make run"
    assert {"make report", "make test"} <= {re.sub(r"\s+#\s.*$", "", t) for t in readme}


def test_every_page_under_docs_with_a_bash_block_is_scanned():
    """A command moved out of the README into any page under docs/ (a sub-folder too) is still run."""
    pages = [p for p in sorted((REPO / "docs").rglob("*.md")) if "```bash" in p.read_text()]
    where = {c.where.split(":")[0] for c in documented_commands(REPO)}
    missed = [str(p.relative_to(REPO)) for p in pages if str(p.relative_to(REPO)) not in where]
    assert pages and not missed, f"pages under docs/ whose ```bash blocks are not scanned: {missed}"


def test_a_backslash_continues_a_command_and_comments_and_other_blocks_are_not_commands(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "```bash\n# a comment\nsnakemake --touch a \\\n    b   # both\n```\n```\nnot bash\n```\n`snakemake x`\n"
    )
    assert [(c.where, c.text) for c in markdown_commands(md, tmp_path)] == [
        ("x.md:3", "snakemake --touch a b   # both")
    ]


def test_configfile_before_the_target_is_reported_as_swallowing_it():
    assert swallowed_by_configfile(OLD_FORM) == ["results/report.html"]
    assert swallowed_by_configfile("snakemake -n results/report.html --configfile a.yaml b.yml") == []
    assert swallowed_by_configfile("snakemake --configfile a.yaml -n results/report.html") == []


def test_no_documented_command_puts_a_target_after_configfile():
    wrong = {c.where: c.text for c in documented_commands(REPO) if swallowed_by_configfile(c.text)}
    assert not wrong, f"--configfile takes every word after it; put the target before it: {wrong}"


def test_every_skip_names_a_documented_command():
    texts = [c.text for c in documented_commands(REPO)]
    stale = [pattern for pattern in SKIPPED if not any(re.search(pattern, t) for t in texts)]
    assert not stale, f"SKIPPED entries that match no documented command (remove them): {stale}"


@pytest.mark.slow
def test_every_documented_command_runs_on_a_fresh_copy(tmp_path):
    copy = fresh_copy(tmp_path / "rectrain")
    substitute_configs(copy, tiny_tree(tmp_path / "mydata"))
    failed, ran, skipped, answered = {}, [], [], {}
    for command in documented_commands(REPO):
        why = skip_reason(command.text)
        if why:
            skipped.append(f"{command.where}: {command.text} -- skipped: {why}")
            continue
        line, how = run_as(command.text)
        # A dry-run changes nothing: the same line on the same copy answers the same (a Snakemake start each)
        proc = answered.get(line) or shell(copy, line)
        if DRY_RUN in how or re.search(r"(^|\s)(-n|--dry-run)(\s|$)", line):
            answered[line] = proc
        ran.append(f"{command.where}: {line} ({how}) -> {proc.returncode}")
        if proc.returncode != 0:
            failed[f"{command.where}: {command.text}"] = (proc.stdout + proc.stderr)[-1500:]
    print("\n".join(ran + skipped))
    assert len(ran) >= 15, ran
    assert not failed, "documented commands that fail:\n" + "\n\n".join(f"{k}\n{v}" for k, v in failed.items())
    old = shell(copy, run_as(OLD_FORM)[0])
    assert old.returncode != 0, "the runner would not have caught the old --configfile form"
