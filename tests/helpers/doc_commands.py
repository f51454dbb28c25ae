"""The shell commands the docs tell a user to type, found the way tests/test_readme_commands.py runs them.

The rule the docs follow (docs/rerun-semantics.md, "Commands in these docs"): a command to type is a line
of a ```bash block in README.md or any page under docs/ (docs/**/*.md; a trailing backslash continues it
onto the next line), or a header comment line of config/*.yaml or the Snakefile whose text starts with
`snakemake`, `make` or `python -m`, optionally after a label such as `Use with:`. Inline `code` in prose
is a fragment (an option, a key), never a whole command.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

# The command words a header comment line may start with, after '#' and an optional 'Label:'.
HEADER_COMMAND = re.compile(r"^#\s+(?:[A-Z][\w ]*:\s+)?((?:snakemake|make|python -m) .*)$")
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line, relative to the repository
    text: str


def markdown_commands(path: Path, repo: Path) -> list[DocCommand]:
    """Every command line of the file's ```bash blocks, continuations joined."""
    commands, pending, start, in_bash = [], "", 0, False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_bash = not in_bash and stripped == "```bash"
            continue
        if not in_bash or (not pending and (not stripped or stripped.startswith("#"))):
            continue
        start = start if pending else number
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        commands.append(DocCommand(f"{path.relative_to(repo)}:{start}", pending + stripped))
        pending = ""
    return commands


def header_commands(path: Path, repo: Path) -> list[DocCommand]:
    """The commands named in the file's leading comment block."""
    commands = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("#"):
            break
        m = HEADER_COMMAND.match(line)
        if m:
            commands.append(DocCommand(f"{path.relative_to(repo)}:{number}", m.group(1).strip()))
    return commands


def documented_commands(repo: Path) -> list[DocCommand]:
    """README.md, every page under docs/ (sub-folders too), then the headers of config/*.yaml and the
    Snakefile, in that order."""
    found = []
    for md in [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]:
        found += markdown_commands(md, repo)
    for header in [*sorted((repo / "config").glob("*.yaml")), repo / "Snakefile"]:
        found += header_commands(header, repo)
    return found


def swallowed_by_configfile(command: str) -> list[str]:
    """The words Snakemake would read as config files although they are not: --configfile takes every
    word after it up to the next option, so `--configfile my.yaml results/report.html` makes the target
    a config file (a FileNotFoundError on a fresh clone, 'Config file is not valid' after a run)."""
    swallowed, after = [], False
    for word in shlex.split(command, comments=True):
        if word in ("--configfile", "--configfiles"):
            after = True
        elif word.startswith("-") or word in ("|", ">", "&&", ";"):
            after = False
        elif after and not word.endswith(CONFIG_SUFFIXES):
            swallowed.append(word)
    return swallowed
