"""Checkpoints that survive a kill, load without pickle, and resume only the run that wrote them.

Everything is stored as tensors, numbers, strings, lists and dicts so `torch.load(weights_only=True)`
accepts it (no code runs when a checkpoint is loaded).  Writes go to a temporary file in the same
directory and are moved into place with os.replace, so a kill never leaves a half-written last.pt.

A checkpoint carries its run's identity (RunIdentity): the train config (less the operational keys,
x-rerun: false in the schema), the batch and accumulation the preflight CHOSE (`batch_size: auto` may choose
differently on another card), the record content, the world size and the sha256 of every training
source file.  `differences` compares them and names each that differs (`resumable`: the first);
which of them train.resume: always may resume across is rectrain.train.lifecycle.resume's decision.

Starting over deletes nothing of the run it replaces: a run that does not continue the checkpoints here moves them
(`move_aside`: a rename within the folder's filesystem, never a copy) into
replaced/<UTC time>-<what differed>/ beside them; `bound_replaced` then keeps the newest
train.keep_replaced runs there, deleting older ones by name.  Within a run, `prune` keeps the last
train.keep_checkpoints epoch_<k>.pt files (last.pt is always kept, model.pt is not in this folder).

Finished runs: after model.pt is published, its outputs are linked into finished/ (rectrain.train.lifecycle.finished)
and FINISHED is written beside the checkpoints.  Snakemake deletes a rule's outputs before it runs the
job, so a train job that starts with FINISHED present was started again: forced by the user
(`--forcerun train`) it retrains; otherwise (a failed rerun removed the outputs, or they were deleted by
hand) it republishes finished/ when the run still matches (rectrain.train.lifecycle.resume).  A job killed at any
point before FINISHED (even after its last epoch's checkpoint) resumes instead.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rectrain import atomic
from rectrain.config import output_part
from rectrain.recordio import read_idx
from rectrain.storage import human_bytes
from rectrain.train.lifecycle import finished

log = logging.getLogger(__name__)

# Written beside the checkpoints once model.pt is published: this run is complete (finished.py: torch-free,
# so the launcher reads it without importing torch).
FINISHED, finished_marker = finished.MARKER, finished.marker
# Written beside the checkpoints when the ranks stopped on divergence (rectrain.train.lifecycle.divergence).
DIVERGED = "diverged.json"
# The run's TensorBoard curves, beside the checkpoints folder (rectrain.train.curves.FOLDER); a run
# moved aside takes them along, so a new run's curves start apart.
CURVES = "tensorboard"
# Record headers hashed for the content fingerprint: evenly spaced over the .idx.  Reading every
# header of ImageNet's .rec would read nearly the whole 140 GB file; 4096 reads take well under a
# second and catch any relabel that moves more than ~0.1 % of the records (a class-to-label change).
SAMPLED_RECORDS = 4096
# Bytes read at each sampled record: the frame and IRHeader (label, id) and the first image bytes.
SAMPLE_BYTES = 64
# The manifest keys that decide the records (pack settings, counts, what was skipped or repaired, the
# published bytes); never its timings (wall_s, images_per_s, decode ms, usage), storage or paths: a
# repack that writes the same .rec, or a second check of the same pair, is the same data and resumes.
MANIFEST_RECORD_KEYS = (
    "discovered",
    "packed",
    "skipped",
    "repaired",
    "skipped_files",
    "bytes_written",
    "num_classes",
    "resize",
    "max_side",
    "quality",
    "shuffle_seed",
    "check_scan_data",
    "max_image_bytes",
)
# check_recordio's `existing` block: the same, for a brought pair.
EXISTING_RECORD_KEYS = (
    "bytes",
    "checked_records",
    "kept_unusual",
    "formats",
    "published",
    "shuffle_seed",
    "bytes_written",
)
# Where the checkpoints of a replaced run go (under the checkpoints folder: same filesystem, a rename).
REPLACED = "replaced"
# The reason's words in a moved-aside folder's name: enough to tell folders apart, short enough to list.
SLUG_CHARS = 48
EPOCH_FILE = re.compile(r"epoch_(\d+)\.pt")


def rng_state() -> dict:
    """This process's RNG states (torch, cuda, numpy, python) in weights_only-loadable form."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
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


def seed_host_rngs(seed: int, rank: int) -> None:
    """A new run's NumPy and Python RNGs seeded from (train.seed, rank): the draws of timm's Mixup (NumPy)
    and random erasing (Python) are then the same in every run of the config, and differ between ranks.
    torch's RNG keeps train.seed's stream (the model's initial weights, the same on every rank)."""
    value = int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])
    np.random.seed(value)
    random.seed(value)


def reseed(seed: int, epoch: int, rank: int) -> None:
    """Seed this process's RNGs (torch, numpy, python) from (train.seed, epoch, rank): a rank on another
    world size has no saved stream of its own to continue (rectrain.train.lifecycle.resume)."""
    value = int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)


def host_copy(obj):
    """A copy of a (nested) state dict with every tensor cloned to host memory: a snapshot that costs
    no device memory (the preflight's and the calibration's)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


def save_atomic(obj: dict, path: str | os.PathLike) -> None:
    """torch.save through rectrain.atomic (into the temporary's own descriptor): a kill mid-write leaves
    the previous checkpoint intact.  A full disk raises NoSpace, saying how much the checkpoint needs."""
    try:
        atomic.write_with(path, lambda f: torch.save(obj, f))
        return
    except (OSError, RuntimeError) as exc:
        full = no_space(exc, Path(path), obj)
        if full is None:
            raise
    raise full  # outside the except: the failed write's frames (its open temporary) are not kept


def save_linked(obj: dict, source: str | os.PathLike, path: str | os.PathLike) -> bool:
    """`path` holding `obj`, which the finished checkpoint `source` already holds: a hard link to it
    where the file system has them (True), else saved (rectrain.atomic.link_or_write)."""
    return atomic.link_or_write(source, path, lambda f: torch.save(obj, f))


class NoSpace(OSError):
    """A checkpoint did not fit on its disk; the message says how much it needs and how much is free."""


def tensor_bytes(obj) -> int:
    """The bytes of every tensor in a (nested) state: about what torch.save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def no_space(exc: BaseException, path: Path, obj: dict) -> NoSpace | None:
    """NoSpace when `exc` (torch.save's zip writer reports a full disk as "unexpected pos ...", a file
    as ENOSPC) came from a disk without room for the checkpoint `obj`, else None."""
    needed = tensor_bytes(obj)
    free = shutil.disk_usage(path.parent).free
    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not full and free >= needed:
        return None
    return NoSpace(
        errno.ENOSPC,
        f"no space left for the checkpoint {path}: it needs about {human_bytes(needed)}, and its disk has "
        f"{human_bytes(free)} free; free at least {human_bytes(max(needed - free, 0) + (1 << 20))} there (or lower "
        "train.keep_checkpoints)",
    )


def load(path: str | os.PathLike) -> dict:
    """Load a checkpoint without executing pickled code."""
    return torch.load(path, map_location="cpu", weights_only=True)


def maths_config(recorded: dict) -> dict:
    """The train block, recorded flat (TrainSettings.as_dict(), or a checkpoint's `config`), without its
    operational keys (x-rerun: false in the schema, the same split the rule's params use): a checkpoint
    written under other intervals, timeouts or worker counts is resumed."""
    return output_part("train", recorded)


def _sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_records(manifest: str) -> dict:
    """The part of a pack (or check_recordio) manifest that decides the records: MANIFEST_RECORD_KEYS
    and EXISTING_RECORD_KEYS of its `existing` block, nothing measured."""
    with open(manifest, encoding="utf-8") as fh:
        found = json.load(fh)
    kept = {k: found[k] for k in MANIFEST_RECORD_KEYS if k in found}
    if isinstance(found.get("existing"), dict):
        kept["existing"] = {k: found["existing"][k] for k in EXISTING_RECORD_KEYS if k in found["existing"]}
    return kept


def data_fingerprint(rec: str, idx: str, classes: str | None = None, manifest: str | None = None) -> dict:
    """What the records are: sha256 of the .idx (keys and offsets), of SAMPLED_RECORDS evenly spaced
    records' headers (labels, ids) and first image bytes, of classes.tsv (label -> class), and of what
    in the pack manifest decides the records (manifest_records: settings and counts, no timings);
    plus the .rec's size."""
    pairs = read_idx(idx)
    step = max(1, len(pairs) // SAMPLED_RECORDS)
    h = hashlib.sha256()
    fd = os.open(rec, os.O_RDONLY)
    try:
        for _, offset in pairs[::step]:
            h.update(os.pread(fd, SAMPLE_BYTES, offset))
    finally:
        os.close(fd)
    fp = {"rec_bytes": os.path.getsize(rec), "idx_sha256": _sha256(idx), "headers_sha256": h.hexdigest()}
    if classes:
        fp["classes_sha256"] = _sha256(classes)
    if manifest:
        kept = json.dumps(manifest_records(manifest), sort_keys=True).encode()
        fp["manifest_records_sha256"] = hashlib.sha256(kept).hexdigest()
    return fp


@dataclass(frozen=True)
class RunIdentity:
    """Everything that makes two trainings the same run (see the module doc)."""

    config: dict  # the train block without its operational keys (see maths_config)
    batch_size: int
    grad_accum: int
    world_size: int
    data: dict
    code: dict

    def stamp(self) -> dict:
        """The checkpoint fields that record this identity, beside its full "config"."""
        return {
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "world_size": self.world_size,
            "data": self.data,
            "code": self.code,
        }


def _comparable_data(old: dict, new: dict) -> tuple[dict, dict]:
    """A checkpoint written before the fingerprint left the manifest's timings out holds
    manifest_sha256 (the whole manifest): it is compared on its other items, so an upgrade does not
    start every run over."""
    if "manifest_sha256" not in old:
        return old, new
    return {k: v for k, v in old.items() if k != "manifest_sha256"}, {
        k: v for k, v in new.items() if k != "manifest_records_sha256"
    }


def _changed(a: dict, b: dict) -> str:
    return ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)))


@dataclass(frozen=True)
class Difference:
    """One item of the run identity that differs between a checkpoint and this run."""

    item: str  # config, batch, world_size, data or code
    text: str  # in words, for the log line and run.json


# Train keys whose only effect is the number of processes or their batch plan: the `world_size` and
# `batch` items compare what they became (a run moved from 2 GPUs to 1 is the same run when its
# global batch is kept, rectrain.train.lifecycle.resume), so the `config` item leaves them out.
PLAN_KEYS = ("devices", "cpu_processes", "nodes", "batch_size", "grad_accum")


def _without_plan_keys(maths: dict) -> dict:
    return {k: v for k, v in maths.items() if k not in PLAN_KEYS}


def differences(state: dict, ident: RunIdentity) -> list[Difference]:
    """Every item in which the checkpoint `state` differs from the run `ident` (empty: the same run)."""
    found = []
    old_cfg, new_cfg = _without_plan_keys(maths_config(state.get("config") or {})), _without_plan_keys(ident.config)
    if old_cfg != new_cfg:
        found.append(Difference("config", f"the train config changed ({_changed(old_cfg, new_cfg)})"))
    old, new = (state.get("batch_size"), state.get("grad_accum")), (ident.batch_size, ident.grad_accum)
    if old != new:
        text = f"the chosen batch changed ({old[0]} x accum {old[1]} then, {new[0]} x accum {new[1]} now)"
        found.append(Difference("batch", text))
    if state.get("world_size") != ident.world_size:
        text = f"it was written by {state.get('world_size')} processes, this run has {ident.world_size}"
        found.append(Difference("world_size", text))
    old_data, new_data = _comparable_data(state.get("data") or {}, ident.data)
    if old_data != new_data:
        text = f"the training records changed ({_changed(old_data, new_data)})"
        found.append(Difference("data", text))
    if state.get("code") != ident.code:
        found.append(Difference("code", f"the training code changed ({_changed(state.get('code') or {}, ident.code)})"))
    return found


def resumable(state: dict, ident: RunIdentity) -> str | None:
    """None if the checkpoint `state` continues the run `ident`, else the first item that differs, in words."""
    found = differences(state, ident)
    return found[0].text if found else None


def stamp_of(path: str | os.PathLike) -> dict:
    """The identity fields of a checkpoint (RunIdentity.stamp, its config), read through mmap: the batch
    plan reads them before the run is built without loading every tensor of a large checkpoint."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {k: state.get(k) for k in ("batch_size", "grad_accum", "world_size", "config", "data", "code")}


def mark_finished(ck_dir: Path, model: Path, launch_id: str | None = None) -> None:
    """After model.pt is published: a later start of this job is a new run (see the module doc).  The
    launch's id lets its launcher tell a finished run from a failed one whatever torchrun's status."""
    atomic.write_json(finished_marker(ck_dir), {"model": str(model), "launch_id": launch_id})


def _slug(reason: str) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", reason.lower()).strip("-")
    if len(words) > SLUG_CHARS:  # cut at a word boundary
        words = words[: SLUG_CHARS + 1].rsplit("-", 1)[0]
    return words or "replaced"


def run_files(ck_dir: Path) -> list[str]:
    """The names of a run's checkpoint files in ck_dir: epoch_<k>.pt by k, last.pt, FINISHED, DIVERGED
    and the folder of its kept outputs (rectrain.train.lifecycle.finished)."""
    ck_dir = Path(ck_dir)
    epochs = sorted((p.name for p in ck_dir.glob("epoch_*.pt") if EPOCH_FILE.fullmatch(p.name)), key=_epoch_of)
    return epochs + [n for n in ("last.pt", FINISHED, DIVERGED, finished.FOLDER) if (ck_dir / n).exists()]


def _epoch_of(name: str) -> int:
    return int(EPOCH_FILE.fullmatch(name).group(1))


def move_aside(ck_dir: Path, reason: str) -> tuple[Path | None, list[str]]:
    """Move the checkpoints (and FINISHED, and the curves beside the folder: CURVES) of a run being
    replaced into replaced/<UTC time>-<reason slug>/; returns (that folder, the names moved), (None, []) when there
    were none.  os.rename within one folder tree: no copy, no byte rewritten, nothing deleted."""
    ck_dir = Path(ck_dir)
    names = run_files(ck_dir)
    if not names:
        return None, []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest = ck_dir / REPLACED / f"{stamp}-{_slug(reason)}"
    for n in range(1, 1000):  # two replacements within a second keep both
        try:
            dest.mkdir(parents=True)
            break
        except FileExistsError:
            dest = dest.with_name(f"{stamp}-{_slug(reason)}-{n}")
    for name in names:
        os.rename(ck_dir / name, dest / name)
    curves = ck_dir.parent / CURVES
    if curves.is_dir():
        os.rename(curves, dest / CURVES)
    if (dest / FINISHED).is_file():  # a finished run keeps all it published, not its training's outputs alone
        names += finished.keep_evaluation(ck_dir.parent, dest)
    return dest, names


def move_back(folder: Path, ck_dir: Path) -> list[str]:
    """Undo move_aside: rename a replaced run's files from folder back into ck_dir (emptied by a
    move_aside first) and remove the then empty folder.  Returns the names moved."""
    names = run_files(folder)
    for name in names:
        os.rename(Path(folder) / name, Path(ck_dir) / name)
    curves, home = Path(folder) / CURVES, Path(ck_dir).parent / CURVES
    if curves.is_dir() and not home.exists():
        os.rename(curves, home)
    with contextlib.suppress(OSError):  # something else left there stays, with its folder
        Path(folder).rmdir()
    return names


def prune(ck_dir: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` epoch_<k>.pt (by k; last.pt and the moved-aside runs are not
    touched).  Called after the new checkpoint is in place (save_atomic), so a kill during the prune
    leaves at least `keep` whole checkpoints.  Returns the names deleted."""
    epochs = [n for n in run_files(ck_dir) if EPOCH_FILE.fullmatch(n)]
    gone = epochs[: max(0, len(epochs) - max(1, keep))]
    for name in gone:
        (Path(ck_dir) / name).unlink(missing_ok=True)
    return gone


def takes_slot(folder: Path) -> bool:
    """A replaced run that train.keep_replaced counts: an unfinished one holding a checkpoint.  A finished
    run is never deleted by the bound, and a run with no checkpoint (diverged before its first, or
    stopped at once: a few KB) takes no slot."""
    if (folder / FINISHED).is_file():
        return False
    return (folder / "last.pt").is_file() or any(EPOCH_FILE.fullmatch(p.name) for p in folder.glob("epoch_*.pt"))


def bound_replaced(ck_dir: Path, keep: int) -> tuple[list[str], int, int]:
    """Delete all but the newest `keep` unfinished runs holding a checkpoint in replaced/
    (train.keep_replaced; folders named by UTC time, so by name): finished runs and runs without a
    checkpoint are kept and take no slot (takes_slot).  Returns (the folders deleted, the runs left,
    their bytes on disk)."""
    root = Path(ck_dir) / REPLACED
    if not root.is_dir():
        return [], 0, 0
    runs = sorted(p for p in root.iterdir() if p.is_dir())
    counted = [p for p in runs if takes_slot(p)]
    gone = counted[: max(0, len(counted) - keep)]
    for folder in gone:
        shutil.rmtree(folder)
    return [p.name for p in gone], len(runs) - len(gone), disk_bytes(root)


def finished_replaced(ck_dir: Path) -> list[Path]:
    """The finished runs kept in replaced/ (never deleted by bound_replaced), oldest first."""
    root = Path(ck_dir) / REPLACED
    return sorted(p for p in root.iterdir() if (p / FINISHED).is_file()) if root.is_dir() else []


def disk_bytes(folder: Path) -> int:
    """Bytes the files under `folder` take, a hard-linked file once (last.pt and its epoch_<k>.pt)."""
    seen, total = set(), 0
    for path in Path(folder).rglob("*"):
        st = path.lstat()
        if path.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total
