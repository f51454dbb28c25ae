"""train.init_weights: a new run that starts from given weights instead of a random init (not a resume:
the optimizer, schedule and epochs start over) - a fine-tune at another resolution (FixRes), or a
transfer to your own classes.

The weights are a published weights.safetensors (rectrain.weights), a rectrain checkpoint or model.pt
(its `model`), a plain state dict saved by torch, or `torchvision:<Enum>.<NAME>` (torchvision's weight
enums, e.g. torchvision:ResNet50_Weights.IMAGENET1K_V1: their own download and cache).  Tensors whose
shape differs from the network's - the classifier head of another class count - are left at their
fresh init, and the log names them; any other key that does not match is an error naming the key.
"""

from __future__ import annotations

import logging

import torch

from rectrain.modelspec import TORCHVISION_WEIGHTS as TORCHVISION

log = logging.getLogger(__name__)


def state_dict(source: str) -> dict[str, torch.Tensor]:
    """The tensors train.init_weights names (see the module doc)."""
    if source.startswith(TORCHVISION):
        return torchvision_enum(source, "train.init_weights").get_state_dict(progress=False)
    if source.endswith(".safetensors"):
        from rectrain import weights

        return weights.tensors(source)
    state = torch.load(source, map_location="cpu", weights_only=True)
    return state["model"] if isinstance(state.get("model"), dict) else state


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
