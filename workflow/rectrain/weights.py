"""The published weights: results/<ds>/train/weights.safetensors and weights.json beside it.

weights.safetensors holds the trained network's state_dict with the architecture library's own key
names (safetensors: tensors and a string header only, nothing is unpickled on load), so the
architecture loads it strictly with its own library (`torchvision.models.get_model(name, num_classes=K)`,
`timm.create_model(name, num_classes=K)`, your factory) and `.load_state_dict(load_file(path),
strict=True)`.  A BlurPool run's file too: the filter has no parameters, so its tensors are the plain
architecture's, and `blurpool_layers` names the convolutions that ran behind the filter
(rectrain.model.add_blurpool(net, layers=...) puts it back).  Its header's metadata (METADATA_KEY, JSON)
describes the network - the architecture as configured, the classes in label order, the normalisation,
the training resolution, the recipe and what it did (`as_run`: what each mechanic changed, each
parameter group's LR and weight decay), the epochs trained - so rectrain.model.load_weights can rebuild
a torchvision or timm network from the file alone.  The header is data, never code: a model of your
own is rebuilt only through the factory the caller names (load_weights(path, model=...)), never one the
file names.

The train stage writes the file when a run finishes (rectrain.train.outputs.finish); the evaluate stage
evaluates that file and writes weights.json: the same description, plus the test resolutions and the
top-1 it measured on it (so the number in weights.json is the file's).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as to_bytes

from rectrain import atomic, safefs
from rectrain.loaders import EVAL_CROP_FRACTION, IMAGENET_MEAN, IMAGENET_STD

FILE = "weights.safetensors"
JSON = "weights.json"
# With train.ema, the raw and the averaged weights beside FILE (which is one of them: train.ema.result).
VARIANT_FILES = {"raw": "weights-raw.safetensors", "ema": "weights-ema.safetensors"}
VARIANT_WORDS = {
    "raw": "the trained weights as the last optimizer step left them",
    "ema": "the exponential moving average of the weights (train.ema: timm's ModelEmaV3)",
}
# The safetensors header's metadata key holding the description (metadata values must be strings).
METADATA_KEY = "rectrain"


def normalisation() -> dict:
    """What the loaders feed the network: RGB scaled to [0, 1], minus mean, over std (torchvision's
    ImageNet constants; the loaders apply them to 0-255 values, the same thing)."""
    return {
        "space": "RGB in [0, 1]",
        "mean": [round(m / 255, 6) for m in IMAGENET_MEAN],
        "std": [round(s / 255, 6) for s in IMAGENET_STD],
    }


def describe(
    train_resolution: int,
    val_resolution: int | None,
    architecture: dict,
    classes: list[dict],
    *,
    epoch: int,
    recipe: dict,
    as_run: dict | None = None,
    variant: dict | None = None,
) -> dict:
    """The file's description: `architecture` {model, model_args, blurpool, blurpool_layers} as configured,
    the classes in label order (label, wnid, name), the normalisation, training's resolution
    (train.image_size, train.val_resolution), the recipe, what it did (`as_run`: rectrain.train.run.Run.
    resolved), the number of epochs trained, and with train.ema which weights the file holds (`variant`:
    {weights: raw | ema, result: the one weights.safetensors is, files: each variant's file})."""
    return {
        **({"variant": variant} if variant else {}),
        "format": "state_dict with the architecture library's key names (rectrain.model.load_weights rebuilds it)",
        **architecture,
        "num_classes": len(classes),
        "classes": [{"label": int(c["label"]), "wnid": str(c["wnid"]), "name": str(c["name"])} for c in classes],
        "normalisation": normalisation(),
        "train_resolution": int(train_resolution),
        "val_resolution": val_resolution,
        "crop_ratio": EVAL_CROP_FRACTION,
        "epochs_trained": int(epoch),
        "recipe": recipe,
        "recipe_as_run": as_run,
    }


def save(state_dict: dict, description: dict, path: str | os.PathLike) -> None:
    """state_dict as safetensors with `description` in its header, atomically.  Tensors are saved
    contiguous (a channels_last network's convolution weights are not) and on the CPU.  Serialised in
    memory and written through rectrain.atomic (its temporary's own descriptor, the umask's mode), not
    with safetensors' save_file, whose temporary of its own is always 0600: the file would be unreadable
    by the colleagues the umask lets read every other output.  The bytes cost one more copy of the
    weights in host memory (100 MB for a ResNet-50) for a moment, once per run."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    atomic.write_bytes(path, to_bytes(tensors, metadata={METADATA_KEY: json.dumps(description)}))


@contextlib.contextmanager
def _opened(path: str | os.PathLike) -> Iterator[str]:
    """A name of the weights file `path` opened here as a regular file (safefs.open_regular: a FIFO
    swapped in is refused, never waited on), for safetensors, which opens files by name: /dev/fd/<n>
    reads the file this process checked, whatever the name leads to meanwhile."""
    with safefs.open_regular(path, "the weights file") as f:
        yield f"/dev/fd/{f.fileno()}"


class NotRectrain(ValueError):
    """A safetensors file without rectrain's description in its header (another library's)."""


def description(path: str | os.PathLike) -> dict:
    """The description in a weights file's header; a file without one was not written by rectrain."""
    try:
        with _opened(path) as name, safe_open(name, framework="pt") as f:
            meta = f.metadata() or {}
    except safetensors.SafetensorError as err:
        raise ValueError(f"{path} is not a safetensors file ({err}); give a weights.safetensors") from None
    if METADATA_KEY not in meta:
        raise NotRectrain(
            f"{path} has no rectrain description in its header: it was not published by rectrain's train "
            "stage; load its tensors with safetensors.torch.load_file and the library that made them"
        )
    try:
        about = json.loads(meta[METADATA_KEY])
    except ValueError:
        about = None
    if not isinstance(about, dict):
        raise ValueError(f"{path}: its header's {METADATA_KEY!r} description is not a JSON object; republish the file")
    return about


def tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    try:
        with _opened(path) as name:
            return load_file(name)
    except safetensors.SafetensorError as err:
        raise ValueError(f"{path} is not a safetensors file ({err}); give a weights.safetensors") from None


def other_variant(weights_path: str | os.PathLike) -> tuple[str, Path] | None:
    """(name, path) of the variant beside a train.ema run's weights file that it is not (its description's
    `variant`: weights.safetensors is the raw or the averaged weights, the other sits beside it under
    VARIANT_FILES' name - never a name the header gives), or None for a run without train.ema."""
    about = description(weights_path).get("variant")
    if not isinstance(about, dict) or about.get("weights") not in VARIANT_FILES:
        return None
    other = "raw" if about["weights"] == "ema" else "ema"
    return other, Path(weights_path).parent / VARIANT_FILES[other]


def write_json(
    weights_path: str | os.PathLike, out: str | os.PathLike, evaluation: dict, variants: dict | None = None
) -> dict:
    """weights.json: the file's description, its name, and `evaluation` (the evaluate stage's top-1,
    top-5 and test resolutions, measured on this file); with train.ema, `variants`: each variant's file,
    what it is and its evaluation ({raw: {...}, ema: {...}})."""
    data = {"weights": Path(weights_path).name, **description(weights_path), **evaluation}
    if variants:
        data["variants"] = variants
    atomic.write_json(out, data)
    return data
