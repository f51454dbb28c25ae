"""train.init_weights: a new run that starts from given weights instead of a random init (not a resume:
the optimizer, schedule and epochs start over) - a fine-tune at another resolution (FixRes), or a
transfer to your own classes.

The weights are a published weights.safetensors (rectrain.weights), a rectrain checkpoint or model.pt
(its `model`), a checkpoint of timm's train.py (its `state_dict_ema`, else `state_dict`, as timm loads
it: read with weights_only=True, its argparse.Namespace of settings the one class allowed), a plain state
dict saved by torch or as safetensors (timm's hub files), or `torchvision:<Enum>.<NAME>` (torchvision's
weight enums, e.g. torchvision:ResNet50_Weights.IMAGENET1K_V1: torch.hub's download and cache, each read
checked against the hash torchvision publishes in the file's name).  Every file is read as data: loaded
with weights_only=True (no pickled code runs), opened without blocking (a FIFO is refused, not waited
on), and refused unless it holds a mapping of names to tensors.  Keys saved through DDP or torch.compile
(`module.`, `_orig_mod.`) are cleaned as timm cleans them.

Every tensor of the network is reported as loaded, resampled or left at its fresh init:
- a ViT-style absolute position embedding (`pos_embed`, torchvision's `pos_embedding`) of another grid -
  the network trained at another resolution - is resampled as timm does (timm.layers.
  resample_abs_pos_embed: bicubic, the class and register tokens kept);
- the classifier head of another shape (another class count) keeps its fresh init;
- any other tensor the weights lack or hold in another shape is refused, naming it, unless
  train.init_weights_strict: false, which keeps its fresh init and says so.  A key the network has not
  is refused the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import math
import os
import pickle
from pathlib import Path
from urllib.error import URLError
from urllib.parse import urlparse

import torch

from rectrain import safefs
from rectrain.modelspec import TORCHVISION_WEIGHTS as TORCHVISION

log = logging.getLogger(__name__)

# Where a checkpoint keeps the network, in the order timm's own loader looks (timm.models.load_state_dict:
# the EMA first), then a rectrain checkpoint's.
STATE_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")


# A weights file's read errors that mean "not a state dict saved by torch" (weights_only=True refuses
# any pickled object that is not a tensor or a plain container as UnpicklingError).
UNREADABLE = (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError)


def state_dict(source: str, key: str = "train.init_weights") -> dict[str, torch.Tensor]:
    """The tensors `source` names (see the module doc); `key`: the config key that gave it, for errors."""
    return read(source, key)[0]


def read(source: str, key: str = "train.init_weights") -> tuple[dict[str, torch.Tensor], str]:
    """(the tensors `source` names, cleaned of DDP and torch.compile prefixes; where in the file they were)."""
    from timm.models import clean_state_dict

    if source.startswith(TORCHVISION):
        return torchvision_state_dict(torchvision_enum(source, key), source, key), "torchvision"
    if source.endswith(".safetensors"):
        from rectrain import weights

        return clean_state_dict(weights.tensors(source)), "safetensors"
    try:
        # timm's train.py saves its args, an argparse.Namespace: the one class allowed beside torch's own
        with safefs.open_regular(source, key) as f, torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(f, map_location="cpu", weights_only=True)
    except UNREADABLE as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{key} {source!r} cannot be read as weights saved by torch ({first}); give a weights.safetensors, a "
            "model.pt, a timm checkpoint or a file of torch.save(model.state_dict())"
        ) from None
    where = next((k for k in STATE_KEYS if isinstance(state, dict) and isinstance(state.get(k), dict)), None)
    found = state[where] if where else state
    return clean_state_dict(tensors_only(found, source, key)), where or "the file's top level"


def tensors_only(state, source: str, key: str) -> dict[str, torch.Tensor]:
    """`state` when it maps names to tensors, else a ValueError naming what it holds."""
    if isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        return state
    what = type(state).__name__
    if isinstance(state, dict):
        odd = next(k for k, v in state.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor)))
        what = f"a dict whose {odd!r} is {type(state[odd]).__name__}"
    raise ValueError(
        f"{key} {source!r} holds {what}, not a state dict (names mapped to tensors); give a weights.safetensors, "
        "a model.pt or a file of torch.save(model.state_dict())"
    )


def weights_url(enum) -> str:
    """Where torchvision publishes the weights of `enum` (its file name carries their sha256 prefix)."""
    return enum.url


def torchvision_state_dict(enum, source: str, key: str) -> dict[str, torch.Tensor]:
    """torchvision's published weights `enum`, read from torch.hub's cache ($TORCH_HOME/hub/checkpoints,
    downloaded there first when missing) and checked against the sha256 prefix in the published file's
    name - on every read, not only at the download (torch.hub checks only then, and loads a cached file
    with weights_only=False: a pickle planted in a shared cache ran) - then loaded with
    weights_only=True from the very bytes checked."""
    url = weights_url(enum)
    name = os.path.basename(urlparse(url).path)
    found = torch.hub.HASH_REGEX.search(name)
    if found is None:
        raise ValueError(f"{key} {source!r}: torchvision publishes no hash in {url}'s name; use another enum member")
    cached = Path(torch.hub.get_dir()) / "checkpoints" / name
    if not cached.exists():
        download(url, cached, found[1], source, key)
    with safefs.open_regular(cached, key) as f:
        data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    if not digest.startswith(found[1]):
        raise ValueError(
            f"{key} {source!r}: {cached} is not the file torchvision published (sha256 {digest[:12]}..., published "
            f"{found[1]}...); delete it, and it is downloaded again from {url}"
        )
    return tensors_only(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), source, key)


def download(url: str, cached: Path, hash_prefix: str, source: str, key: str) -> None:
    """torch.hub's download of `url` to `cached` (through a temporary of its own, checked against the
    published hash); offline, one line saying what to download and where."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s: downloading %s to %s", key, url, cached)
    try:
        torch.hub.download_url_to_file(url, str(cached), hash_prefix, progress=False)
    except (URLError, OSError, RuntimeError) as err:
        raise ValueError(
            f"{key} {source!r}: the weights need a download from {url} into {cached}, which failed ({err}); "
            f"download that file there on a machine with network access, or set TORCH_HOME to a folder holding "
            f"hub/checkpoints/{cached.name}"
        ) from None


def torchvision_enum(source: str, key: str):
    """The torchvision weights enum member `source` (torchvision:<Enum>.<member>) names; `key` is the
    config key that gave it, for the error."""
    import torchvision

    try:
        return torchvision.models.get_weight(source[len(TORCHVISION) :])
    except (ValueError, KeyError, AttributeError) as err:
        raise ValueError(
            f"{key} {source!r}: not a torchvision weights enum ({err}); write it as torchvision:ResNet50_Weights.IMAGENET1K_V1"
        ) from None


def head_prefix(model: torch.nn.Module) -> str:
    """The classifier head's module name and a dot: timm's pretrained_cfg names it, else the network's last
    Linear layer (torchvision's `fc`, `heads.head`, `classifier.2`)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    named = cfg.get("classifier")
    if isinstance(named, str):
        return named + "."
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return linears[-1] + "." if linears else "\0"  # no head: nothing is one


def is_pos_embed(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in ("pos_embed", "pos_embedding")


def resampled_pos_embed(model: torch.nn.Module, key: str, given: torch.Tensor, own: torch.Tensor):
    """`given`, a 1 x (prefix + h x w) x C position embedding, resampled to the network's grid as timm does;
    None where the two are not square-or-declared grids of the same width C."""
    from timm.layers import resample_abs_pos_embed

    if given.ndim != 3 or own.ndim != 3 or given.shape[-1] != own.shape[-1]:
        return None
    prefix = getattr(model, "num_prefix_tokens", None)
    if prefix is None:  # torchvision's ViT: one class token ahead of the grid
        prefix = 1 if any(n.endswith(("class_token", "cls_token")) for n, _ in model.named_parameters()) else 0
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    old, new = given.shape[1] - prefix, own.shape[1] - prefix
    old_side, new_side = math.isqrt(old), math.isqrt(new)
    if old_side**2 != old or (grid is None and new_side**2 != new):
        return None
    new_size = list(grid) if grid is not None else [new_side, new_side]
    return resample_abs_pos_embed(given, new_size, [old_side, old_side], num_prefix_tokens=prefix)


def sorted_keys(model: torch.nn.Module, given: dict) -> dict[str, list[str]]:
    """Every tensor of the network and of the weights by what becomes of it (the module doc)."""
    own, head = model.state_dict(), head_prefix(model)
    out: dict[str, list[str]] = {"loaded": [], "resampled": [], "head_at_init": [], "at_init": [], "unknown": []}
    for k, v in own.items():
        if k in given and tuple(given[k].shape) == tuple(v.shape):
            out["loaded"].append(k)
        elif k in given and is_pos_embed(k) and resampled_pos_embed(model, k, given[k], v) is not None:
            out["resampled"].append(k)
        else:
            out["head_at_init" if k.startswith(head) else "at_init"].append(k)
    out["unknown"] = sorted(set(given) - set(own))
    return out


def apply(model: torch.nn.Module, source: str, master: bool = True, *, strict: bool = True) -> dict:
    """Load train.init_weights into `model` in place (the module doc says what becomes of each tensor);
    rank 0 logs it.  Returns the report run.json keeps: counts, and the names of what was not loaded."""
    given, where = read(source)
    own = model.state_dict()
    given = {plain_to_own(model).get(k, k): v for k, v in given.items()}  # a BlurPool run's plain weights
    keys = sorted_keys(model, given)
    refused = keys["at_init"] + keys["unknown"]
    if refused and strict:
        raise ValueError(
            f"train.init_weights {source!r} does not fit train.model beyond its head: "
            f"{mismatch_text(keys, given, own)}; give weights of the same architecture (at its own resolution "
            "position embeddings are resampled), or set train.init_weights_strict: false to keep those tensors "
            "at their fresh init"
        )
    loaded = {k: given[k] for k in keys["loaded"]}
    loaded.update({k: resampled_pos_embed(model, k, given[k], own[k]) for k in keys["resampled"]})
    model.load_state_dict(loaded, strict=False)
    report = {
        "source": source,
        "read_from": where,
        "loaded": len(keys["loaded"]),
        "resampled": keys["resampled"],
        "head_at_init": keys["head_at_init"],
        "at_init": keys["at_init"],
        "ignored": keys["unknown"],
    }
    if master:
        log_report(report, given, own)
    return report


def plain_to_own(model: torch.nn.Module) -> dict[str, str]:
    """A BlurPool network's plain key -> its own key (`layer.weight` -> `layer.conv.weight`)."""
    from rectrain.model import blurpool_layers, plain_state_dict

    layers = blurpool_layers(model)
    if not layers:
        return {}
    own = list(model.state_dict())
    return dict(zip(plain_state_dict(dict.fromkeys(own), layers), own, strict=True))


def mismatch_text(keys: dict, given: dict, own: dict) -> str:
    parts = [
        f"{k} {tuple(given[k].shape)} -> {tuple(own[k].shape)}" if k in given else f"{k} missing from the weights"
        for k in keys["at_init"][:5]
    ]
    parts += [f"{k} not in the network" for k in keys["unknown"][:5]]
    more = len(keys["at_init"]) + len(keys["unknown"]) - len(parts)
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def log_report(report: dict, given: dict, own: dict) -> None:
    log.info(
        "train.init_weights: started from %s (%s): %d tensors loaded",
        report["source"],
        report["read_from"],
        report["loaded"],
    )
    for k in report["resampled"]:
        log.info(
            "train.init_weights: %s resampled %s -> %s (timm's resample_abs_pos_embed)",
            k,
            tuple(given[k].shape),
            tuple(own[k].shape),
        )
    if report["head_at_init"]:
        shapes = ", ".join(
            f"{k} {tuple(given[k].shape)} -> {tuple(own[k].shape)}" if k in given else f"{k} (not in the weights)"
            for k in report["head_at_init"]
        )
        log.info("train.init_weights: the head is replaced for this dataset's classes, freshly initialised: %s", shapes)
    if report["at_init"] or report["ignored"]:
        log.warning(
            "train.init_weights_strict: false: %d tensor(s) beyond the head kept their fresh init (%s), %d of the "
            "weights' tensors ignored (%s)",
            len(report["at_init"]),
            ", ".join(report["at_init"][:5]),
            len(report["ignored"]),
            ", ".join(report["ignored"][:5]),
        )
