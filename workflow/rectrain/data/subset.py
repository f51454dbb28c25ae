"""Class subsets and at most N images per class, taken at the index stage (index.classes, index.per_class).

A researcher tries an idea on ImageNet-100 (the 100 classes of Tian et al.'s "Contrastive Multiview
Coding", shipped as `imagenet100`) or on N images per class before spending days on the full set; the
index stage then writes only those rows, so the pack, the training and the report see a dataset of
that size, with contiguous labels in sorted wnid order (index.write_index numbers what is left).

`index.classes`: a list of class folder names (wnids for ImageNet), the path of a file of them (one a
line, `#` starts a comment), or the name of a list shipped in subsets/ (`imagenet100`).  A name the raw
set lacks is refused, naming the missing ones.  `index.per_class`: at most that many train images per
class, the same ones on every machine for the same raw set: each image's key is sha256 of (index.seed,
its file name - so a folder and a tar of the same images choose alike), and a class keeps its
`per_class` smallest keys (its source breaking a tie); no file system order, no process state.  Validation stays whole for the
chosen classes.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rectrain import safefs
from rectrain.config import expand_path
from rectrain.data.archives import SEP

SUBSETS = Path(__file__).parent / "subsets"
# ImageNet-1k's 1000 wnids in label order (subsets/imagenet1k.txt cites where they come from).
IMAGENET_1K = SUBSETS / "imagenet1k.txt"


class SubsetError(ValueError):
    """index.classes names what cannot be read, or classes the raw set lacks (the message says which)."""


def shipped() -> list[str]:
    """The names index.classes accepts for the lists shipped with rectrain (subsets/<name>.txt)."""
    return sorted(p.stem for p in SUBSETS.glob("*.txt"))


# A class list is a few kB (ImageNet-21k's 21,841 wnids: 218 kB); more is not one.
LIST_MAX_BYTES = 64 << 20


def read_names(path: Path, key: str = "index.classes") -> list[str]:
    """The class names of a list file: one a line, blank lines and `#` comments skipped.  Read when
    used, without blocking (a FIFO swapped in after the Snakefile's check is refused, not waited on),
    at most LIST_MAX_BYTES, UTF-8: anything else is a SubsetError naming `key`, the file and the fix."""
    try:
        with safefs.open_regular(path, key) as fh:
            data = fh.read(LIST_MAX_BYTES + 1)
        if len(data) > LIST_MAX_BYTES:
            raise SubsetError(
                f"{key} = {str(path)!r} holds over {LIST_MAX_BYTES >> 20} MiB: not a class list; fix {key}"
            )
        text = data.decode("utf-8")
    except OSError as err:
        raise SubsetError(f"{key} = {str(path)!r}: {err}; give a list of class names, one a line") from None
    except UnicodeDecodeError as err:
        raise SubsetError(
            f"{key} = {str(path)!r} is not UTF-8 text (byte {err.start}: {data[err.start : err.start + 1]!r}); "
            "save the class list as UTF-8, one name a line"
        ) from None
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def imagenet_1k() -> set[str]:
    return set(read_names(IMAGENET_1K))


def resolve(classes) -> list[str] | None:
    """index.classes as a list of names (None: every class): the list itself, a shipped list's, or a file's."""
    if classes is None or isinstance(classes, list):
        return classes
    if classes in shipped():
        return read_names(SUBSETS / f"{classes}.txt")
    path = Path(expand_path(classes, "index.classes"))
    if not path.exists():
        raise SubsetError(
            f"index.classes = {classes!r} is neither a file nor a list shipped with rectrain "
            f"({', '.join(shipped())}): give a list of class names, the path of a file of them, or one of those names"
        )
    return read_names(path)


@dataclass(frozen=True)
class Kept:
    """What a subset kept, for the index log and index.json: classes and train images before and after."""

    classes: int
    of_classes: int
    train: int
    of_train: int
    val: int
    of_val: int
    per_class: int | None

    def text(self) -> str:
        cap = f", at most {self.per_class} train images per class" if self.per_class else ""
        return (
            f"kept {self.classes} of {self.of_classes} classes{cap}: {self.train} of {self.of_train} train images, "
            f"{self.val} of {self.of_val} val images (validation whole for the kept classes)"
        )


def missing(wanted: list[str], present: set[str]) -> list[str]:
    return sorted(set(wanted) - present)


def check_classes(wanted: list[str], present: set[str]) -> None:
    """Refuse names the raw set's train split does not hold, naming them."""
    lacking = missing(wanted, present)
    if lacking:
        shown = ", ".join(lacking[:20]) + (f" and {len(lacking) - 20} more" if len(lacking) > 20 else "")
        raise SubsetError(
            f"index.classes names {len(lacking)} class(es) the raw set's train split does not hold: {shown}. "
            f"Correct index.classes, or point raw: at a dataset that has them"
        )


def sample_key(seed: int, source: str) -> int:
    """The per_class order of an image, from its file name (the last part of its source): the same on
    every machine and in every layout of the same images (a folder, a per-class tar)."""
    name = PurePosixPath(source.split(SEP)[-1]).name
    digest = hashlib.sha256(f"{seed}\0{name}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:16], "big")


def chosen_sources(rows, per_class: int, seed: int) -> set[str]:
    """The sources of at most `per_class` rows of each class of (source, wnid) `rows`: the smallest
    sample keys, kept in a bounded heap per class (ImageNet's 1.28 M rows are not all held)."""
    heaps = defaultdict(list)
    for source, wnid in rows:
        heap, item = heaps[wnid], (-sample_key(seed, source), source)  # negated: heap[0] is the largest key
        if len(heap) < per_class:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
    return {source for heap in heaps.values() for _, source in heap}
