"""Checkpoints that survive a kill and load without pickle.

Everything is stored as tensors, numbers, strings, lists and dicts so `torch.load(weights_only=True)`
accepts it (no code runs when a checkpoint is loaded).  Writes go to a temporary file in the same
directory and are moved into place with os.replace, so a kill never leaves a half-written last.pt.
"""

from __future__ import annotations

import copy
import os
import random

import numpy as np
import torch

from rectrain import atomic


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
    """torch.save through rectrain.atomic: a kill mid-write leaves the previous checkpoint intact."""
    atomic.write_with(path, lambda tmp: torch.save(obj, tmp))


def load(path: str | os.PathLike) -> dict:
    """Load a checkpoint without executing pickled code."""
    return torch.load(path, map_location="cpu", weights_only=True)
