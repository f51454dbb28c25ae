"""train.init_weights: a new run that starts from given weights instead of a random init (not a resume:
the optimizer, schedule and epochs start over) - a fine-tune at another resolution (FixRes), or a
transfer to your own classes.

The weights are a published weights.safetensors (rectrain.weights), a rectrain checkpoint or model.pt
(its `model`), a plain state dict saved by torch, or `torchvision:<Enum>.<NAME>` (torchvision's weight
enums, e.g. torchvision:ResNet50_Weights.IMAGENET1K_V1: torch.hub's download and cache, each read
checked against the hash torchvision publishes in the file's name).  Every file is read as data:
loaded with weights_only=True (no pickled code runs), opened without blocking (a FIFO is refused, not
waited on), and refused unless it holds a mapping of names to tensors.  Tensors whose shape differs
from the network's - the classifier head of another class count - are left at their fresh init, and
the log names them; any other key that does not match is an error naming the key.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
from pathlib import Path
from urllib.error import URLError
from urllib.parse import urlparse

import torch

from rectrain import safefs
from rectrain.modelspec import TORCHVISION_WEIGHTS as TORCHVISION

log = logging.getLogger(__name__)

# A weights file's read errors that mean "not a state dict saved by torch" (weights_only=True refuses
# any pickled object that is not a tensor or a plain container as UnpicklingError).
UNREADABLE = (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError)


def state_dict(source: str, key: str = "train.init_weights") -> dict[str, torch.Tensor]:
    """The tensors `source` names (see the module doc); `key`: the config key that gave it, for errors."""
    if source.startswith(TORCHVISION):
        return torchvision_state_dict(torchvision_enum(source, key), source, key)
    if source.endswith(".safetensors"):
        from rectrain import weights

        return weights.tensors(source)
    try:
        with safefs.open_regular(source, key) as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except UNREADABLE as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{key} {source!r} cannot be read as weights saved by torch ({first}); give a weights.safetensors, a "
            "model.pt or a file of torch.save(model.state_dict())"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a rectrain checkpoint or model.pt
    return tensors_only(state, source, key)


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


def apply(model: torch.nn.Module, source: str, master: bool = True) -> None:
    """Load train.init_weights into `model` in place; a head of another shape keeps its fresh init,
    and rank 0 says so."""
    given = state_dict(source)
    own = model.state_dict()
    unknown = sorted(set(given) - set(own))
    missing = sorted(set(own) - set(given))
    if unknown or missing:
        raise ValueError(
            f"train.init_weights {source!r} does not fit train.model: "
            f"{'keys it lacks: ' + ', '.join(missing[:5]) if missing else ''}"
            f"{'; keys the network has not: ' + ', '.join(unknown[:5]) if unknown else ''}; "
            "give weights of the same architecture (and train.blurpool as they were trained)"
        )
    reshaped = [k for k in own if tuple(given[k].shape) != tuple(own[k].shape)]
    model.load_state_dict({k: v for k, v in given.items() if k not in reshaped}, strict=False)
    if master:
        log.info("train.init_weights: started from %s (%d tensors)", source, len(own) - len(reshaped))
        if reshaped:
            shapes = ", ".join(f"{k} {tuple(given[k].shape)} -> {tuple(own[k].shape)}" for k in reshaped)
            log.info(
                "train.init_weights: the head is replaced for this dataset's classes, freshly initialised: %s", shapes
            )
