"""rectrain's DALI augmentation graph (rectrain.loaders.dali_augment.apply_policy) run on the CPU over copies
of one image, with the trace of what each copy drew; and the libraries' own op on the same image for a
drawn (op, magnitude, sign): timm's PIL op (timm.data.auto_augment), torchvision's TrivialAugmentWide op."""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import numpy as np
from nvidia.dali import fn, pipeline_def
from PIL import Image

from rectrain.loaders.augment import AugmentPolicy, timm_hparams
from rectrain.loaders.dali_augment import LEVEL_STEPS, TRIVIAL_BINS, apply_policy


def real_image(size: int) -> np.ndarray:
    """A real photograph, size x size, uint8 HWC: the centre of scikit-learn's bundled china.jpg."""
    from sklearn.datasets import load_sample_image

    photo = load_sample_image("china.jpg")
    top, left = (photo.shape[0] - size) // 2, (photo.shape[1] - size) // 2
    return np.ascontiguousarray(photo[top : top + size, left : left + size])


@dataclass
class Draws:
    images: list  # one uint8 HWC array per copy
    trace: np.ndarray  # (copies, slots, 3): op index (len(names) = skipped), magnitude bin, sign
    names: list  # the policy's ops, by index


def draw(policy: AugmentPolicy, image: np.ndarray, copies: int, runs: int = 1, seed: int = 1) -> Draws:
    """`runs` batches of `copies` copies of `image` through apply_policy (CPU DALI, 2 threads)."""
    names: list = []

    @pipeline_def(batch_size=copies, num_threads=2, device_id=None, seed=seed, enable_conditionals=True)
    def pipe():
        source = fn.external_source(source=lambda: [image] * copies, batch=True, layout="HWC")
        out, trace, ops = apply_policy(source, policy, image.shape[0], trace=True)
        names[:] = ops
        return out, trace

    p = pipe()
    p.build()
    images, traces = [], []
    for _ in range(runs):
        out, trace = p.run()
        images += [np.array(out.at(i)) for i in range(copies)]
        traces.append(trace.as_array())
    del p
    return Draws(images, np.concatenate(traces), names)


def timm_reference(image: np.ndarray, name: str, level: float, negative: bool) -> np.ndarray:
    """timm's op `name` at magnitude `level` on `image`, its random sign forced (timm negates when
    random.random() > 0.5), with the hparams rectrain gives timm (timm_hparams)."""
    from timm.data.auto_augment import LEVEL_TO_ARG, NAME_TO_OP

    hparams = timm_hparams(image.shape[0])
    level_to_arg = LEVEL_TO_ARG[name]
    with mock.patch("random.random", return_value=1.0 if negative else 0.0):
        args = level_to_arg(level, hparams) if level_to_arg else ()
    pil = Image.fromarray(image)
    out = NAME_TO_OP[name](pil, *args, fillcolor=hparams["img_mean"], resample=hparams["interpolation"])
    return np.asarray(out)


def trivial_reference(image: np.ndarray, name: str, bin_: int, negative: bool) -> np.ndarray:
    """torchvision's TrivialAugmentWide op `name` at magnitude bin `bin_` (negated: `negative`, where the
    op is signed) on the PIL image, with TrivialAugmentWide's defaults (nearest, black fill)."""
    from torchvision.transforms import v2

    ta = v2.TrivialAugmentWide()
    magnitudes_of, signed = ta._AUGMENTATION_SPACE[name]
    magnitudes = magnitudes_of(TRIVIAL_BINS, *image.shape[:2])
    magnitude = 0.0 if magnitudes is None else float(magnitudes[bin_])
    magnitude = -magnitude if signed and negative else magnitude
    out = ta._apply_image_or_video_transform(
        Image.fromarray(image), name, magnitude, interpolation=ta.interpolation, fill=ta._fill
    )
    return np.asarray(out)


def reference(policy: AugmentPolicy, image: np.ndarray, name: str, bin_: int, sign: int) -> np.ndarray:
    """The library's own op for one drawn (op, magnitude bin, sign) of `policy`."""
    if policy.family == "trivial":
        return trivial_reference(image, name, bin_, bool(sign))
    return timm_reference(image, name, bin_ / LEVEL_STEPS, bool(sign))


def difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(mean |a - b| over pixels and channels, the share of values more than 2 apart)."""
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return float(d.mean()), float((d > 2).mean())
