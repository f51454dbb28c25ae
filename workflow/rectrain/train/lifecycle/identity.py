"""What makes two trainings the same run (`RunIdentity`), recorded in every checkpoint: the train config
less its operational keys, the batch and accumulation the preflight chose, the records' fingerprint, the
world size and the sha256 of every training source file.  `differences` names each item that differs;
which of them train.resume: always may cross is rectrain.train.lifecycle.resume's decision."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from rectrain.config import output_part
from rectrain.recordio import read_idx

# Record headers hashed for the content fingerprint: evenly spaced over the .idx.  Reading every
# header of ImageNet's .rec would read nearly the whole 140 GB file; 4096 reads take well under a
# second and catch any relabel that moves more than ~0.1 % of the records (a class-to-label change).
SAMPLED_RECORDS = 4096
# Bytes read at each sampled record: the frame and IRHeader (label, id) and the first image bytes.
SAMPLE_BYTES = 64
# The manifest keys that decide the records (pack settings, counts, what was skipped or repaired, the
# published bytes); never its timings, storage or paths: a repack that writes the same .rec, or a
# second check of the same pair, is the same data and resumes.
MANIFEST_RECORD_KEYS = tuple(
    "discovered packed skipped repaired skipped_files bytes_written num_classes resize max_side quality shuffle_seed "
    "check_scan_data max_image_bytes".split()
)
# check_recordio's `existing` block: the same, for a brought pair.
EXISTING_RECORD_KEYS = tuple("bytes checked_records kept_unusual formats published shuffle_seed bytes_written".split())
# Train keys whose only effect is the number of processes or their batch plan: the `world_size` and
# `batch` items compare what they became (a run moved from 2 GPUs to 1 is the same run when its
# global batch is kept, rectrain.train.lifecycle.resume), so the `config` item leaves them out.
PLAN_KEYS = ("devices", "cpu_processes", "nodes", "batch_size", "grad_accum")
STAMP_KEYS = ("batch_size", "grad_accum", "world_size", "data", "code")


def maths_config(recorded: dict) -> dict:
    """The train block, recorded flat (TrainSettings.as_dict(), or a checkpoint's `config`), without its
    operational keys (x-rerun: false in the schema): a checkpoint written under other intervals,
    timeouts or worker counts is resumed."""
    return output_part("train", recorded)


def sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_records(manifest: str) -> dict:
    """The part of a pack (or check_recordio) manifest that decides the records, nothing measured."""
    with open(manifest, encoding="utf-8") as fh:
        found = json.load(fh)
    kept = {k: found[k] for k in MANIFEST_RECORD_KEYS if k in found}
    if isinstance(found.get("existing"), dict):
        kept["existing"] = {k: found["existing"][k] for k in EXISTING_RECORD_KEYS if k in found["existing"]}
    return kept


def data_fingerprint(rec: str, idx: str, classes: str | None = None, manifest: str | None = None) -> dict:
    """What the records are: sha256 of the .idx, of SAMPLED_RECORDS evenly spaced records' first bytes
    (labels, ids, image), of classes.tsv and of manifest_records; plus the .rec's size."""
    pairs = read_idx(idx)
    step = max(1, len(pairs) // SAMPLED_RECORDS)
    h = hashlib.sha256()
    fd = os.open(rec, os.O_RDONLY)
    try:
        for _, offset in pairs[::step]:
            h.update(os.pread(fd, SAMPLE_BYTES, offset))
    finally:
        os.close(fd)
    fp = {"rec_bytes": os.path.getsize(rec), "idx_sha256": sha256(idx), "headers_sha256": h.hexdigest()}
    if classes:
        fp["classes_sha256"] = sha256(classes)
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
        return {k: getattr(self, k) for k in STAMP_KEYS}


@dataclass(frozen=True)
class Difference:
    """One item of the run identity that differs between a checkpoint and this run."""

    item: str  # config, batch, world_size, data or code
    text: str  # in words, for the log line and run.json


def _changed(a: dict, b: dict) -> str:
    return ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)))


def _comparable_data(old: dict, new: dict) -> tuple[dict, dict]:
    """A checkpoint written before the fingerprint left the manifest's timings out holds manifest_sha256
    (the whole manifest): compared on its other items, so an upgrade does not start every run over."""
    if "manifest_sha256" not in old:
        return old, new
    drop = ("manifest_sha256", "manifest_records_sha256")
    return {k: v for k, v in old.items() if k not in drop}, {k: v for k, v in new.items() if k not in drop}


def differences(state: dict, ident: RunIdentity) -> list[Difference]:
    """Every item in which the checkpoint `state` differs from the run `ident` (empty: the same run)."""
    found = []
    old_cfg = {k: v for k, v in maths_config(state.get("config") or {}).items() if k not in PLAN_KEYS}
    new_cfg = {k: v for k, v in ident.config.items() if k not in PLAN_KEYS}
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
        found.append(Difference("data", f"the training records changed ({_changed(old_data, new_data)})"))
    if state.get("code") != ident.code:
        found.append(Difference("code", f"the training code changed ({_changed(state.get('code') or {}, ident.code)})"))
    return found


def stamp_of(path: str | os.PathLike) -> dict:
    """The identity fields of a checkpoint and its config, read through mmap (no tensor loaded): the batch
    plan reads them before the run is built."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {k: state.get(k) for k in (*STAMP_KEYS, "config")}
