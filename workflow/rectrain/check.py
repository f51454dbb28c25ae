"""Check the data against known weights: results/<ds>/check/report.json, before a multi-day run.

python -m rectrain.check --config-json '<check block>' --rec <fast>/<ds>/val.rec --idx <fast>/<ds>/val.idx \
    --classes results/<ds>/index/classes.tsv [--val-index results/<ds>/index/val.tsv] \
    --out results/<ds>/check/report.json

Weights whose accuracy is published (check.weights: torchvision:<Enum>.<member>, a rectrain
weights.safetensors with weights.json beside it, or a plain state dict) are evaluated through this
dataset's own val .rec with the evaluate stage's passes (rectrain.evaluate: the same loader, resize and
centre crop, precision and tally), and the top-1 is set beside the published one.  A labelling or
preprocessing fault shows in minutes, not after the run: torchvision checks its recipes the same way
(`train.py --test-only --weights ...`).

Classes are matched by wnid: the network's logits are reordered so that this dataset's classes come
first in its label order (classes.tsv), the weights' other classes after them.  The top-1 is taken over
every class the weights know, as the published one is, so an image of a subset predicted as a class the
subset lacks counts as wrong.  A dataset class the weights do not know is refused, naming it.

What the gap means (verdict): within 0.3 points (widened by sampling alone on a subset of the weights'
classes) the labels and preprocessing are sound; near chance the labels are misaligned, the likely
cause named for the val layout; in between the preprocessing differs, the settings it used named.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rectrain import atomic, cli, distributed, evaluate, settings
from rectrain.data.subset import IMAGENET_1K, read_names
from rectrain.loaders import EVAL_CROP_FRACTION, IMAGENET_PREPROCESS, Preprocess, eval_resize_for
from rectrain.modelspec import TORCHVISION_WEIGHTS
from rectrain.safefs import not_a_file, open_regular
from rectrain.tables import read_classes

log = logging.getLogger(__name__)

# Agreement within this many points of top-1 is sound (the issue's ~0.3: a decoder's or a resize's
# rounding moves ImageNet's top-1 by about 0.1-0.3 points).
SOUND_POINTS = 0.3
# At most this many times chance reads as labels that do not belong to their images.
NEAR_CHANCE = 2.0


class CheckError(ValueError):
    """The check cannot run as configured (the message names the key and the fix)."""


@dataclass(frozen=True)
class Known:
    """Weights with a published accuracy: the network, its classes (wnids, in logit order), the test
    resolution and numerics its accuracy was measured at, and that accuracy (None where unknown)."""

    model: torch.nn.Module
    wnids: list[str]
    source: str
    published_top1: float | None
    published_where: str
    crop: int
    resize: int
    precision: str = "fp32"
    loader: str = "dali"
    decode: str = "auto"
    preprocess: Preprocess = IMAGENET_PREPROCESS  # mean, std, the resize's interpolation
    preprocess_from: str = "ImageNet's mean and std, bilinear (torchvision's and rectrain's)"


# ---------------------------------------------------------------------------------------------
# The weights


def known_weights(check) -> Known:
    """check.weights (see the module doc) as Known."""
    source = check.weights
    if source is None:
        raise CheckError(
            "check.weights is null: nothing to check; set it to torchvision:ResNet50_Weights.IMAGENET1K_V1, "
            "a weights.safetensors or a state dict (docs/check.md)"
        )
    if source.startswith(TORCHVISION_WEIGHTS):
        return torchvision_known(source)
    why = not_a_file(source)
    if why:
        raise CheckError(f"check.weights {source!r}: {why}; fix the path (relative to the working directory)")
    if source.endswith(".safetensors"):
        from rectrain import weights

        try:
            return rectrain_known(source, weights.description(source), check.model)
        except weights.NotRectrain:
            if check.model is None:
                raise CheckError(
                    f"check.weights {source!r} is a safetensors file rectrain did not publish: set check.model to "
                    "its architecture (its head ImageNet-1k's 1000 classes in the standard order)"
                ) from None
    return state_dict_known(source, check.model)


def torchvision_known(source: str) -> Known:
    """torchvision's weights enum: its own download and cache (TORCH_HOME), its architecture, the ImageNet-1k
    classes in their standard order, and its metadata's top-1 and test transforms."""
    import torchvision

    from rectrain.train.init_weights import torchvision_enum, torchvision_state_dict

    enum = torchvision_enum(source, "check.weights")
    names = [n for n in torchvision.models.list_models() if torchvision.models.get_model_weights(n) is type(enum)]
    if not names:
        raise CheckError(
            f"check.weights {source!r}: no torchvision model takes {type(enum).__name__}; name a classifier's weights"
        )
    categories = enum.meta["categories"]
    model = torchvision.models.get_model(names[0], num_classes=len(categories))
    model.load_state_dict(torchvision_state_dict(enum, source, "check.weights"), strict=True)
    transforms = enum.transforms()
    metrics = enum.meta.get("_metrics", {}).get("ImageNet-1K", {})
    return Known(
        model=model.eval(),
        wnids=imagenet_1k_wnids(len(categories), source),
        source=source,
        published_top1=metrics["acc@1"] / 100 if "acc@1" in metrics else None,
        published_where="torchvision's metadata, on ImageNet-1k val",
        crop=int(transforms.crop_size[0]),
        resize=int(transforms.resize_size[0]),
    )


def imagenet_1k_wnids(count: int, source: str) -> list[str]:
    """ImageNet-1k's wnids in label order (torchvision's meta has the class names, not the wnids)."""
    wnids = read_names(IMAGENET_1K)
    if count != len(wnids):
        raise CheckError(
            f"check.weights {source!r} has {count} classes, not ImageNet-1k's {len(wnids)}: rectrain cannot name "
            "its classes by wnid; check with ImageNet-1k weights, or a rectrain weights.safetensors"
        )
    return wnids


def rectrain_known(source: str, about: dict, model_name: str | None) -> Known:
    """A weights.safetensors published by rectrain (`about`: its header's description): the network and
    classes it describes - the architecture a torchvision or timm one, or, for a model of its run's own,
    the factory check.model names (`model_name`; never one the file names) - and the evaluate stage's
    top-1, resolution and numerics from weights.json beside it when it is there."""
    from rectrain import model as models
    from rectrain import weights

    beside = Path(source).with_name(weights.JSON)
    measured = published_evaluation(beside)
    headline = (measured.get("test_resolutions") or [{}])[0]
    crop = int(headline.get("crop") or about["train_resolution"])
    recipe = about.get("recipe") or {}
    return Known(
        model=models.load_weights(source, model=model_name),
        wnids=[c["wnid"] for c in about["classes"]],
        source=source,
        published_top1=measured.get("top1"),
        published_where=f"{beside}, on its run's val set" if measured else f"nowhere ({beside} is absent)",
        crop=crop,
        resize=int(headline.get("resize") or eval_resize_for(crop)),
        precision=recipe.get("precision", "fp32"),
        loader=recipe.get("loader") or "dali",
        decode=recipe.get("decode", "auto"),
    )


# weights.json is a few kB; more is not one.
MAX_JSON_BYTES = 16 << 20


def published_evaluation(beside: Path) -> dict:
    """weights.json beside a weights file ({} when there is none): read without blocking (a FIFO is
    refused), at most MAX_JSON_BYTES, a JSON object or a CheckError naming it."""
    if not os.path.lexists(beside):
        return {}
    try:
        with open_regular(beside, "weights.json") as f:
            data = f.read(MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            raise ValueError(f"larger than {MAX_JSON_BYTES} bytes")
        found = json.loads(data)
    except (OSError, ValueError) as err:
        raise CheckError(f"{beside} (the weights' published evaluation) cannot be read: {err}; remove it") from None
    if not isinstance(found, dict):
        raise CheckError(f"{beside} (the weights' published evaluation) is not a JSON object; remove it")
    return found


def state_dict_known(source: str, model_name: str | None) -> Known:
    """A plain state dict (torch.save, a rectrain model.pt, a timm checkpoint, or a safetensors file of
    another library) of check.model's architecture with ImageNet-1k's classes; no published top-1.  A timm
    model is read as its weights were trained: the mean, std, interpolation, test size and crop fraction
    of its pretrained_cfg (check.model timm:<name>.<tag> picks the tag's)."""
    from rectrain import model as models
    from rectrain.train.init_weights import state_dict

    if model_name is None:
        raise CheckError(
            f"check.weights {source!r} is a plain state dict, which does not say its architecture: set check.model "
            "(e.g. resnet50), or give a torchvision:... enum or a rectrain weights.safetensors"
        )
    wnids = imagenet_1k_wnids(1000, source)
    model = models.build(model_name, len(wnids))
    try:
        model.load_state_dict(state_dict(source, "check.weights"), strict=True)
    except RuntimeError as err:
        first = str(err).splitlines()[1].strip() if "\n" in str(err) else str(err)
        raise CheckError(
            f"check.weights {source!r} does not fit check.model {model_name!r} with 1000 classes ({first}); "
            "set check.model to the architecture the state dict is of"
        ) from None
    cfg = getattr(model, "pretrained_cfg", None)
    if not (model_name.startswith("timm:") and cfg and "mean" in cfg):
        return Known(model.eval(), wnids, source, None, "nowhere (a plain state dict)", 224, eval_resize_for(224))
    crop = int(cfg["input_size"][-1])
    return Known(
        model.eval(),
        wnids,
        source,
        None,
        "nowhere (a plain state dict)",
        crop,
        math.floor(crop / float(cfg.get("crop_pct") or EVAL_CROP_FRACTION)),  # as timm's eval transform resizes
        preprocess=Preprocess.of_timm_cfg(cfg),
        preprocess_from=f"timm's pretrained_cfg of {cfg.get('architecture')}.{cfg.get('tag')}",
    )


# ---------------------------------------------------------------------------------------------
# Classes matched by wnid


class Reordered(torch.nn.Module):
    """The network with its logits' columns reordered: `order[j]` is the logit that becomes column j."""

    def __init__(self, model: torch.nn.Module, order: list[int]):
        super().__init__()
        self.model = model
        self.register_buffer("order", torch.tensor(order, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).index_select(1, self.order)


def column_order(weight_wnids: list[str], dataset_wnids: list[str], source: str) -> list[int]:
    """The weights' logit indices with this dataset's classes first, in its label order, then the rest;
    a dataset class the weights do not know is refused."""
    where = {w: i for i, w in enumerate(weight_wnids)}
    unknown = [w for w in dataset_wnids if w not in where]
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise CheckError(
            f"check.weights {source!r} does not know {len(unknown)} of this dataset's {len(dataset_wnids)} classes "
            f"({shown}, by wnid in classes.tsv): they cannot be checked with these weights; give weights trained on "
            "classes including them (ImageNet-1k's for an ImageNet subset)"
        )
    first = [where[w] for w in dataset_wnids]
    taken = set(first)
    return first + [i for i in range(len(weight_wnids)) if i not in taken]


# ---------------------------------------------------------------------------------------------
# What the gap means


@dataclass(frozen=True)
class Reading:
    """The check's numbers, and what they say."""

    top1: float
    images: int
    classes: int  # this dataset's
    weight_classes: int
    published_top1: float | None
    settings: dict = field(default_factory=dict)  # the preprocessing used, named in the verdict

    @property
    def chance(self) -> float:
        return 1 / self.classes

    def tolerance(self) -> float:
        """SOUND_POINTS as a fraction; on a subset of the weights' classes, also twice the sampling error
        of a top-1 over this many images (a subset's top-1 differs from the whole set's by chance alone)."""
        sound = SOUND_POINTS / 100
        if self.classes == self.weight_classes or self.published_top1 is None:
            return sound
        p = self.published_top1
        return max(sound, 2 * math.sqrt(p * (1 - p) / self.images))


def verdict(r: Reading, layout: str) -> tuple[str, str]:
    """(sound | misaligned | preprocessing | unknown, the plain words) for a reading; `layout`: the likely
    cause of misaligned labels for this dataset's val layout (likely_cause)."""
    top1 = f"top-1 {100 * r.top1:.2f} %"
    if r.weight_classes > r.classes:
        top1 += f" (over the weights' {r.weight_classes} classes)"
    misaligned = (
        "misaligned",
        (
            f"{top1} is near chance ({100 * r.chance:.2f} % for {r.classes} classes): the labels are misaligned - "
            f"the images are not labelled with the classes the weights know them as. Likely cause: {layout}"
        ),
    )
    near_chance = r.top1 <= NEAR_CHANCE * r.chance
    if r.published_top1 is None:
        if near_chance:
            return misaligned
        return "unknown", (
            f"{top1}, above chance ({100 * r.chance:.2f} %), so the labels are not wholly misaligned; these weights "
            "publish no top-1, so a smaller fault cannot be told apart"
        )
    gap = 100 * (r.published_top1 - r.top1)
    beside = f"{top1} against the published {100 * r.published_top1:.2f} % ({gap:+.2f} points)"
    if abs(gap) <= 100 * r.tolerance():
        return "sound", f"{beside}: within {100 * r.tolerance():.2f} points - the labels and preprocessing are sound"
    if near_chance:
        return misaligned
    used = ", ".join(f"{k} {v}" for k, v in r.settings.items())
    return "preprocessing", (
        f"{beside}: above chance but off by more than {100 * r.tolerance():.2f} points - the labels are right, "
        f"the preprocessing differs from what the weights were measured with. Used: {used}; compare the weights' "
        "own resize, crop, normalisation and interpolation, and the images' size in the .rec (pack.resize)"
    )


def likely_cause(val_index: str | None) -> str:
    """Where misaligned labels most likely come from, for the val split's layout (index/val.tsv's sources)."""
    if val_index is None:
        return (
            "your own .rec (recordio.val) numbers its classes in another order than classes.tsv - im2rec numbers "
            "them in its list's order; check recordio.classes against the labels the .rec was written with"
        )
    import pandas as pd

    first = pd.read_csv(val_index, sep="\t", nrows=1, dtype=str, keep_default_na=False)
    source, wnid = (first["source"].iloc[0], first["wnid"].iloc[0]) if len(first) else ("", "")
    if f"/{wnid}/" in f"/{source}" or f"{wnid}.tar" in source:
        return (
            "the val images are in class folders (val/<wnid>/), so a folder holds another class's images (a "
            "script that sorted them with another ground-truth file), or the weights number their classes in "
            "another order than sorted wnids"
        )
    return (
        "the val images are in one flat folder labelled by a ground-truth file (LOC_val_solution.csv or the "
        "devkit's): that file does not belong to these images or is read in another order (the devkit's labels "
        "are ILSVRC2012_ID numbers, not sorted-wnid labels)"
    )


# ---------------------------------------------------------------------------------------------
# The pass


def preprocessing(check, known: Known) -> tuple[evaluate.Resolution, str, str]:
    """(resolution, precision, loader): the check block's where set, else the weights' own."""
    crop = int(check.crop or known.crop)
    resize = int(check.resize or (known.resize if check.crop is None else eval_resize_for(crop)))
    if resize < crop:
        raise CheckError(
            f"check.resize = {resize} is smaller than the centre crop {crop} (check.crop, or the weights' own): "
            f"set check.resize >= {crop}, or null"
        )
    return evaluate.Resolution(crop, resize), check.precision or known.precision, check.loader or known.loader


def val_pass(check, known: Known, dataset_wnids: list[str], rec: str, idx: str):
    """(the tally, the settings used, the device): one pass of the evaluate stage over the val .rec, the
    network's logits reordered to this dataset's classes first."""
    res, precision, loader = preprocessing(check, known)
    as_trained = evaluate.Trained(
        len(known.wnids), res.crop, precision, loader, decode=known.decode, preprocess=known.preprocess
    )
    # the evaluate block's view, as the evaluate stage's passes read it: one resolution, no flip TTA
    as_evaluate = settings.EvaluateSettings(
        loader=loader,
        batch_size=check.batch_size,
        resize=res.resize,
        crop=res.crop,
        resolutions=[None],
        flip_tta=False,
        progress_s=check.progress_s,
        workers=check.workers,
    )
    d = distributed.setup(True, timeout_s=600)  # one process: no collective waits on a peer
    model = Reordered(known.model, column_order(known.wnids, dataset_wnids, known.source))
    t = evaluate.tally_at(evaluate.passes_of(as_evaluate, as_trained, rec, idx, d, model), res, "check")
    used = {
        "resize": res.resize,
        "centre crop": res.crop,
        "precision": precision,
        "loader": loader,
        "interpolation": known.preprocess.interpolation,
        "mean": [round(m / 255, 4) for m in known.preprocess.mean],
        "std": [round(s / 255, 4) for s in known.preprocess.std],
        "preprocessing from": known.preprocess_from,
    }
    return t, used, d.device


def run(check, rec: str, idx: str, classes_path: str, out: str, val_index: str | None = None) -> dict:
    """Evaluate check.weights through the val .rec (one process, a GPU when there is one), write the
    report and log its verdict; returns the report."""
    known = known_weights(check)
    dataset_wnids = [str(row["wnid"]) for row in read_classes(classes_path)]
    t, used, device = val_pass(check, known, dataset_wnids, rec, idx)
    scores, k = t.scores(), len(dataset_wnids)
    reading = Reading(scores["top1"], t.images, k, len(known.wnids), known.published_top1, used)
    kind, words = verdict(reading, likely_cause(val_index))
    report = {
        "weights": known.source,
        "top1": scores["top1"],
        "top5": scores["top5"],
        "loss": scores["loss"],
        "images": t.images,
        "classes": k,
        "weight_classes": len(known.wnids),
        # images of this dataset predicted as a class it lacks (a subset of the weights' classes)
        "predicted_outside_dataset": int(t.confusion[:k, k:].sum()),
        "published_top1": known.published_top1,
        "published_where": known.published_where,
        "tolerance": reading.tolerance(),
        "chance": reading.chance,
        "verdict": kind,
        "message": words,
        "settings": used,
        "device": str(device),
        "seconds": t.seconds,
    }
    atomic.write_json(out, report)
    log.info("%s on %d images of %d classes (%s): %s", known.source, t.images, k, device, words)
    return report


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rec", required=True)
    ap.add_argument("--idx", required=True)
    ap.add_argument("--classes", required=True, help="classes.tsv of the index (label, wnid, name)")
    ap.add_argument(
        "--val-index", help="index/val.tsv (absent for your own .rec): names the likely cause of misaligned labels"
    )
    ap.add_argument("--out", required=True, help="the report's JSON file")


def _run(args: argparse.Namespace, check: settings.CheckSettings) -> None:
    run(check, args.rec, args.idx, args.classes, args.out, args.val_index)


def main(argv=None) -> int:
    # ValueError: CheckError, and the weights' own refusals (not rectrain's file, not a torchvision enum),
    # each one line naming the key and the fix
    return cli.main("check", "check", _arguments, _run, argv, errors={ValueError: 1})


if __name__ == "__main__":
    cli.end(main())
