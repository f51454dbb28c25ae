"""The checkpoint files of one run: `CheckpointSaver` writes, prunes, moves replaced runs aside and keeps
the finished record, as timm's CheckpointSaver is one class; docs/architecture.md, "Rerun semantics"
(Resume, A finished run survives).  Everything is stored as tensors, numbers, strings, lists and dicts,
so `torch.load(weights_only=True)` runs no code; every write is atomic (rectrain.atomic)."""

from __future__ import annotations

import contextlib
import copy
import datetime
import errno
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from rectrain import atomic
from rectrain.log import CONSOLE_LINE
from rectrain.storage import human_bytes
from rectrain.train.lifecycle.status import DIVERGED, FINISHED

log = logging.getLogger(__name__)

# The run's TensorBoard curves, beside the checkpoints folder (rectrain.train.curves): a run moved
# aside takes them along, so a new run's curves start apart.
CURVES = "tensorboard"
# Where the checkpoints of a replaced run go (under the checkpoints folder: same filesystem, a rename).
REPLACED = "replaced"
# checkpoints/finished/: the finished run's published outputs (hard links), moved aside with its checkpoints.
KEPT = "finished"
# The train rule's outputs in --out, model.pt last (the rule's marker of a finished run).
PUBLISHED = ("steps.csv", "epochs.csv", "system.csv", "run.json", "weights.safetensors", "model.pt")
# With train.ema, the raw and the averaged weights: kept and restored when the run wrote them.
VARIANTS = ("weights-raw.safetensors", "weights-ema.safetensors")
# What the later stages published from a finished run (weights.json beside its weights; eval/ and
# report.html in the run's folder): kept with the run when it is moved aside.
EVALUATION, RUN_PUBLISHED = ("weights.json",), ("eval", "report.html")
# The reason's words in a moved-aside folder's name: enough to tell folders apart, short enough to list.
SLUG_CHARS = 48
EPOCH_FILE = re.compile(r"epoch_(\d+)\.pt")


def rng_state() -> dict:
    """This process's RNG states (torch, cuda, numpy, python) in weights_only-loadable form."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    numpy_state = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)}
    return {
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "numpy": {**numpy_state, "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "state": list(internal), "gauss": py_gauss},
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def seed_host_rngs(seed: int, *keys: int) -> int:
    """NumPy's and Python's RNG (timm's Mixup, random erasing) seeded from (train.seed, *keys): a new run's
    from (seed, rank), torch's keeping train.seed's stream (the initial weights, the same on every rank)."""
    value = int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])
    np.random.seed(value)
    random.seed(value)
    return value


def reseed(seed: int, epoch: int, rank: int) -> None:
    """Every RNG seeded from (train.seed, epoch, rank): a rank on another world size has no stream to continue."""
    torch.manual_seed(seed_host_rngs(seed, epoch, rank))


def _walk(obj, leaf):
    """`obj` (nested dicts, lists, tuples) with `leaf` applied to every other value."""
    if isinstance(obj, dict):
        return {k: _walk(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk(v, leaf) for v in obj)
    return leaf(obj)


def host_copy(obj):
    """A (nested) state dict with every tensor cloned to host memory: a snapshot costing no device memory."""
    return _walk(obj, lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v))


def tensor_bytes(obj) -> int:
    """The bytes of every tensor in a (nested) state: about what torch.save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(tensor_bytes(v) for v in items)


class NoSpace(OSError):
    """A checkpoint did not fit on its disk; the message says how much it needs and how much is free."""


def no_space(exc: BaseException, path: Path, obj: dict) -> NoSpace | None:
    """NoSpace when `exc` (torch.save's zip writer says "unexpected pos ...", a file ENOSPC) came from a
    disk without room for `obj`, else None."""
    needed, free = tensor_bytes(obj), shutil.disk_usage(path.parent).free
    if not (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) and free >= needed:
        return None
    return NoSpace(
        errno.ENOSPC,
        f"no space left for the checkpoint {path}: it needs about {human_bytes(needed)}, and its disk has "
        f"{human_bytes(free)} free; free at least {human_bytes(max(needed - free, 0) + (1 << 20))} there (or lower "
        "train.keep_checkpoints)",
    )


def save_atomic(obj: dict, path: str | os.PathLike) -> None:
    """torch.save through rectrain.atomic: a kill mid-write leaves the previous file intact; a full disk
    raises NoSpace."""
    try:
        atomic.write_with(path, lambda f: torch.save(obj, f))
        return
    except (OSError, RuntimeError) as exc:
        full = no_space(exc, Path(path), obj)
        if full is None:
            raise
    raise full  # outside the except: the failed write's frames (its open temporary) are not kept


def save_linked(obj: dict, source: str | os.PathLike, path: str | os.PathLike) -> bool:
    """`path` holding `obj`, which `source` already holds: a hard link where the file system has them
    (True), else saved (rectrain.atomic.link_or_write)."""
    return atomic.link_or_write(source, path, lambda f: torch.save(obj, f))


def load(path: str | os.PathLike) -> dict:
    """Load a checkpoint without executing pickled code."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _link(src: Path, dest: Path) -> None:
    """dest becomes src's bytes, atomically: a hard link, else (no links on this filesystem) a copy."""

    def copy_to(out) -> None:
        with open(src, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)

    atomic.link_or_write(src, dest, copy_to)


def _slug(reason: str) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", reason.lower()).strip("-")
    if len(words) > SLUG_CHARS:  # cut at a word boundary
        words = words[: SLUG_CHARS + 1].rsplit("-", 1)[0]
    return words or "replaced"


def run_files(ck_dir: Path) -> list[str]:
    """A run's files in ck_dir: epoch_<k>.pt by k, last.pt, FINISHED, DIVERGED and its kept outputs."""
    found = (EPOCH_FILE.fullmatch(p.name) for p in Path(ck_dir).glob("epoch_*.pt"))
    epochs = [m.string for m in sorted(filter(None, found), key=lambda m: int(m.group(1)))]
    return epochs + [n for n in ("last.pt", FINISHED, DIVERGED, KEPT) if (Path(ck_dir) / n).exists()]


def disk_bytes(folder: Path) -> int:
    """Bytes the files under `folder` take, a hard-linked file once (last.pt and its epoch_<k>.pt)."""
    seen, total = set(), 0
    for path in Path(folder).rglob("*"):
        st = path.lstat()
        if path.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def takes_slot(folder: Path) -> bool:
    """A replaced run that train.keep_replaced counts: an unfinished one holding a checkpoint (a run that
    diverged or stopped before its first takes a few KB)."""
    names = run_files(folder)
    return FINISHED not in names and any(n == "last.pt" or EPOCH_FILE.fullmatch(n) for n in names)


def clear(out: Path) -> None:
    """Remove the published outputs in out before they are written again: one that is a link into a
    kept run (published by a restore) is then replaced, never written through."""
    for name in (*VARIANTS, *PUBLISHED):
        (Path(out) / name).unlink(missing_ok=True)


def _present(where: Path) -> tuple[str, ...]:
    """The published outputs, with the weight variants found in `where`, model.pt last."""
    return (*(name for name in VARIANTS if (Path(where) / name).is_file()), *PUBLISHED)


class CheckpointSaver:
    """The checkpoints folder `ck_dir` of one run: epoch checkpoints (the last `keep`, and last.pt), the runs it
    replaced (`keep_replaced` unfinished ones with a checkpoint), and the finished record (finished.json, and
    finished/ holding the published outputs as hard links: a rerun that fails never costs a finished run)."""

    def __init__(self, ck_dir: Path, keep: int = 1, keep_replaced: int = 1):
        self.ck_dir, self.keep, self.keep_replaced = Path(ck_dir), keep, keep_replaced
        self.replaced, self.kept, self.marker = self.ck_dir / REPLACED, self.ck_dir / KEPT, self.ck_dir / FINISHED

    @classmethod
    def of(cls, run) -> CheckpointSaver:
        """The saver of a rectrain.train.run.Run: its train.keep_checkpoints and train.keep_replaced."""
        return cls(run.ck_dir, run.settings.stops.keep_checkpoints, run.settings.stops.keep_replaced)

    def save_epoch(self, state: dict, epoch: int) -> list[str]:
        """epoch_<k>.pt, last.pt as a hard link to it (one write; a mid-epoch checkpoint later replaces
        last.pt alone), then `prune`.  Returns the names pruned."""
        epoch_file = self.ck_dir / f"epoch_{epoch}.pt"
        save_atomic(state, epoch_file)
        save_linked(state, epoch_file, self.ck_dir / "last.pt")
        return self.prune()

    def prune(self) -> list[str]:
        """Delete all but the newest `keep` epoch_<k>.pt, after the new one is in place (a kill during the
        prune leaves at least `keep`).  Returns the names deleted."""
        epochs = [n for n in run_files(self.ck_dir) if EPOCH_FILE.fullmatch(n)]
        gone = epochs[: max(0, len(epochs) - max(1, self.keep))]
        for name in gone:
            (self.ck_dir / name).unlink(missing_ok=True)
        return gone

    def move_aside(self, reason: str) -> tuple[Path | None, list[str]]:
        """Rename the run's files (its curves, a finished run's evaluation) into replaced/<UTC time>-<reason>/:
        nothing copied or deleted.  Returns (that folder, the names), (None, []) when there were none."""
        names = run_files(self.ck_dir)
        if not names:
            return None, []
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        dest = self.replaced / f"{stamp}-{_slug(reason)}"
        for n in range(1, 1000):  # two replacements within a second keep both
            try:
                dest.mkdir(parents=True)
                break
            except FileExistsError:
                dest = dest.with_name(f"{stamp}-{_slug(reason)}-{n}")
        for name in names:
            os.rename(self.ck_dir / name, dest / name)
        curves = self.ck_dir.parent / CURVES
        if curves.is_dir():
            os.rename(curves, dest / CURVES)
        if (dest / FINISHED).is_file():  # a finished run keeps all it published, not its training's outputs alone
            names += self.keep_evaluation(self.ck_dir.parent, dest)
        return dest, names

    def move_back(self, folder: Path) -> list[str]:
        """Undo move_aside into the (emptied) ck_dir and remove the then empty folder.  Returns the names."""
        names = run_files(folder)
        for name in names:
            os.rename(Path(folder) / name, self.ck_dir / name)
        curves, home = Path(folder) / CURVES, self.ck_dir.parent / CURVES
        if curves.is_dir() and not home.exists():
            os.rename(curves, home)
        with contextlib.suppress(OSError):  # something else left there stays, with its folder
            Path(folder).rmdir()
        return names

    def start_over(self, why_not: str, bring_back: Path | None = None) -> None:
        """Move the run here aside, saying where and why (nothing here: nothing said); then move the finished
        run in `bring_back` (this run, kept under replaced/) back, and bound_replaced."""
        dest, moved = self.move_aside(why_not)
        if moved:
            then = "" if bring_back else "; starting from epoch 0"
            text = f"not resuming from {self.ck_dir / 'last.pt'}: {why_not}; moved its checkpoints ({', '.join(moved)})"
            log.info("%s aside to %s%s", text, dest, then, extra=CONSOLE_LINE)
        if bring_back is None:
            if moved:
                self.bound_replaced()
            return
        self.move_back(bring_back)
        self.bound_replaced()
        same = "it is this run (the same train config, batch plan, records, processes and code)"
        log.info("brought back the finished run moved aside to %s: %s", bring_back, same, extra=CONSOLE_LINE)

    def replaced_runs(self) -> list[Path]:
        """The runs in replaced/, oldest first (folders named by UTC time)."""
        return sorted(p for p in self.replaced.iterdir() if p.is_dir()) if self.replaced.is_dir() else []

    def bound_replaced(self) -> None:
        """Delete all but the newest `keep_replaced` runs that take a slot (takes_slot) and say what
        replaced/ holds: finished runs are never deleted."""
        runs = self.replaced_runs()
        if not runs:
            return
        counted = [p for p in runs if takes_slot(p)]
        gone = counted[: max(0, len(counted) - self.keep_replaced)]
        for folder in gone:
            shutil.rmtree(folder)
        removed = f"; deleted the oldest unfinished: {', '.join(p.name for p in gone)}" if gone else ""
        whole = [p.name for p in runs if p not in gone and (p / FINISHED).is_file()]
        kept = (
            f"; finished runs are never deleted: {', '.join(whole)} kept whole (their checkpoints, and in finished/ "
            "their weights, weights.json, csvs, run.json, eval/ and report.html)"
            if whole
            else ""
        )
        held = f"{self.replaced} holds {len(runs) - len(gone)} replaced run(s)"
        bound = f"train.keep_replaced: {self.keep_replaced} unfinished runs with a checkpoint"
        size = human_bytes(disk_bytes(self.replaced))
        log.info("%s, %s on disk (%s)%s%s", held, size, bound, removed, kept, extra=CONSOLE_LINE)

    def mark_finished(self, model: Path, launch_id: str | None = None) -> None:
        """After model.pt is published: a later start of this job is a new run.  The launch's id lets its
        launcher tell a finished run from a failed one whatever torchrun's status."""
        atomic.write_json(self.marker, {"model": str(model), "launch_id": launch_id})

    def complete(self) -> bool:
        """Every published output is kept in checkpoints/finished/."""
        return all((self.kept / name).is_file() for name in PUBLISHED)

    def keep_finished(self, out: Path) -> None:
        """Link the published outputs in `out` into checkpoints/finished/ (model.pt last)."""
        for name in _present(out):
            _link(Path(out) / name, self.kept / name)

    def restore_finished(self, out: Path) -> None:
        """Publish the kept outputs again in out (model.pt last) and say so."""
        for name in VARIANTS:  # a variant the kept run has not (train.ema off) is not left from another
            (Path(out) / name).unlink(missing_ok=True)
        for name in _present(self.kept):
            _link(self.kept / name, Path(out) / name)
        match = "its config, records, code, batch plan and processes match this job's"
        again = "to train again: snakemake --forcerun train, or train.resume: never"
        said = f"restored the finished run's outputs ({', '.join(PUBLISHED)}) from {self.kept}"
        log.info("%s: no training needed - %s (%s)", said, match, again, extra=CONSOLE_LINE)

    @staticmethod
    def keep_evaluation(out: Path, dest: Path) -> list[str]:
        """Link what the later stages published from a finished run (EVALUATION in `out`, RUN_PUBLISHED beside
        it: Snakemake removes them after the train job starts) into dest/finished/.  Returns their paths there."""
        kept, home = [], Path(dest) / KEPT
        sources = [Path(out) / n for n in EVALUATION] + [Path(out).parent / n for n in RUN_PUBLISHED]
        for src in sources:
            files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src] if src.is_file() else []
            for f in files:
                rel = f.relative_to(src.parent)
                (home / rel).parent.mkdir(parents=True, exist_ok=True)
                _link(f, home / rel)
                kept.append(str(Path(KEPT) / rel))
        return kept
