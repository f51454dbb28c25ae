"""train.augment.policy: the augmentation policy of the training images, in timm's grammar, parsed once
(parse_policy) into an AugmentPolicy that both loaders build from.

The grammar is timm 1.0.31's (timm/data/auto_augment.py, what its train.py's --aa takes):
- `rand-<sections>`: RandAugment (rand_augment_transform); sections m<int> (magnitude on timm's 0-10
  scale, default 10), n<int> (ops per image, 2), p<float> (each op's probability, 0.5), mstd<float>
  (std of the Gaussian noise on the magnitude, per op; above 100 = uniform in [0, m]), mmax<int> (the
  magnitude's clip, default 10), inc<0|1> (timm's increasing-severity op set), t<name> (a weighted or
  3-Augment op set);
- `original`, `originalr`, `v0`, `v0r`, `3a` (AutoAugment's ImageNet policies, auto_augment_transform),
  each with an optional -mstd<float>;
- `augmix-<sections>` (AugMix, augment_and_mix_transform);
- `trivial` / `ta_wide`: TrivialAugment wide, which timm lacks: torchvision's (v2.TrivialAugmentWide,
  as torchvision's reference scripts' --auto-augment ta_wide);
- `none`: random-resized-crop and flip only.

timm's own parser skips a section without a digit (rand-m9-foo runs as rand-m9) and fails with a bare
assertion on an unknown key; here every section must be one timm reads, so a typo is refused at config
time, in one line naming the key.  The DALI loader builds the policy
from DALI's auto_aug operators (rectrain.loaders.dali_augment); what DALI cannot run is refused by
dali_problem in one line.  The torch loader (the fallback) runs the library's own transform on the
same image (torch_transform), after the crop and flip, as timm's create_transform orders them.
docs/augmentation.md maps every op.
"""

from __future__ import annotations

import functools
import math
import random
import re
from dataclasses import dataclass

from rectrain.config import ConfigError

KEY = "train.augment.policy"
# timm's AutoAugment policy names (timm.data.auto_augment.auto_augment_policy)
AUTO_POLICIES = ("original", "originalr", "v0", "v0r", "3a")
TRIVIAL = ("trivial", "ta_wide")
# rand-t<name>: timm's other op sets (rand_augment_choices); DALI runs none of them (dali_problem)
RAND_OP_SETS = ("weights", "3a", "3aw")
GRAMMAR = (
    "timm's grammar: rand-m<int>-n<int>-p<float>-mstd<float>-mmax<int>-inc<0|1>[-t<set>] (e.g. "
    "rand-m9-mstd0.5-inc1), original / originalr / v0 / v0r / 3a [-mstd<float>] (AutoAugment), "
    "augmix-m<int>-w<int>-d<int>-a<float>-b<0|1>-mstd<float>, trivial / ta_wide, or none"
)
LEVEL_DENOM = 10  # timm's _LEVEL_DENOM: magnitudes are on a 0-10 scale


class PolicyError(ConfigError):
    """A train.augment.policy string that is not timm's grammar; the message is one line naming the key."""


@dataclass(frozen=True)
class AugmentPolicy:
    """One parsed train.augment.policy.  family: none, rand, auto, trivial or augmix; the rest is timm's
    parameters of that family (defaults as rand_augment_transform's)."""

    text: str = "none"
    family: str = "none"
    name: str = ""  # auto: the policy's name (original, v0, ...)
    magnitude: int = LEVEL_DENOM  # rand: m
    layers: int = 2  # rand: n
    prob: float = 0.5  # rand: p
    magnitude_std: float = 0.0  # rand / auto: mstd (math.inf: uniform in [0, m])
    magnitude_max: int | None = None  # rand: mmax
    increasing: bool = False  # rand: inc
    op_set: str = ""  # rand: t<name>

    @property
    def on(self) -> bool:
        return self.family != "none"

    def words(self) -> str:
        """What the policy does, in a line (run.json, the report)."""
        if self.family == "rand":
            noise = f" ± {self.magnitude_std:g}" if self.magnitude_std else ""
            noise = " (a uniform draw up to it)" if math.isinf(self.magnitude_std) else noise
            ops = "timm's increasing-severity ops" if self.increasing else "timm's ops"
            return (
                f"RandAugment: {self.layers} op(s) per image of {ops}, each applied with p {self.prob:g}, "
                f"magnitude {self.magnitude}{noise} of 10"
            )
        if self.family == "auto":
            return f"AutoAugment's {self.name} ImageNet policy: one sub-policy per image"
        if self.family == "trivial":
            return "TrivialAugment wide (torchvision's): one op per image at a uniform magnitude"
        return "AugMix" if self.family == "augmix" else "none: random-resized-crop and flip only"

    @property
    def upper(self) -> int:
        """The largest magnitude an op is given: timm clips the (noisy) magnitude to [0, mmax or 10]."""
        return self.magnitude_max or LEVEL_DENOM


NONE = AugmentPolicy()


def _refuse(text: str, why: str) -> PolicyError:
    return PolicyError(f"config key '{KEY}' = {text!r} is invalid: {why}; {GRAMMAR}")


def _sections(text: str, parts: list[str], allowed: dict) -> dict:
    """{key: value} of a policy's dash-separated sections, read as timm reads them (the key is the
    letters before the first digit); a section timm would skip or reject is refused.  allowed: key ->
    (reader, what the value must be)."""
    values = {}
    for part in parts:
        key, rest = re.fullmatch(r"(\D*)(.*)", part).groups()
        if key not in allowed or not rest:
            raise _refuse(text, f"unknown section {part!r} (this family takes {', '.join(sorted(allowed))})")
        read, what = allowed[key]
        try:
            values[key] = read(rest)
        except ValueError:
            raise _refuse(text, f"section {part!r}: {rest!r} is not {what}") from None
    return values


def _mstd(value: str) -> float:
    """timm: a magnitude std above 100 means a uniform draw in [0, m]."""
    mstd = float(value)
    return math.inf if mstd > 100 else mstd


WHOLE, NUMBER, FLAG = (int, "a whole number"), (float, "a number"), (lambda v: bool(int(v)), "0 or 1")
MSTD = (_mstd, "a number")
_RAND_SECTIONS = {"m": WHOLE, "n": WHOLE, "p": NUMBER, "mstd": MSTD, "mmax": WHOLE, "inc": FLAG}
_AUGMIX_SECTIONS = {"m": WHOLE, "w": WHOLE, "d": WHOLE, "a": NUMBER, "b": FLAG, "mstd": MSTD}


@functools.lru_cache(maxsize=64)
def parse_policy(text: str) -> AugmentPolicy:
    """train.augment.policy as an AugmentPolicy; PolicyError (one line naming the key) when it is not
    timm's grammar or out of range."""
    parts = text.split("-")
    head, rest = parts[0], parts[1:]
    if head == "none" and not rest:
        return NONE
    if head in TRIVIAL and not rest:
        return AugmentPolicy(text, "trivial", layers=1)
    if head in AUTO_POLICIES:
        values = _sections(text, rest, {"mstd": MSTD})
        return AugmentPolicy(text, "auto", name=head, magnitude_std=values.get("mstd", 0.0))
    if head == "augmix":
        _sections(text, rest, _AUGMIX_SECTIONS)
        return AugmentPolicy(text, "augmix")
    if head != "rand":
        raise _refuse(text, f"unknown policy {head!r}")
    op_set = [p[1:] for p in rest if p.startswith("t")]
    values = _sections(text, [p for p in rest if not p.startswith("t")], _RAND_SECTIONS)
    if op_set and op_set[0] not in RAND_OP_SETS:  # timm reads the first t section
        raise _refuse(text, f"unknown op set 't{op_set[0]}' (timm's: {', '.join('t' + s for s in RAND_OP_SETS)})")
    policy = AugmentPolicy(
        text,
        "rand",
        magnitude=values.get("m", LEVEL_DENOM),
        layers=values.get("n", 2),
        prob=values.get("p", 0.5),
        magnitude_std=values.get("mstd", 0.0),
        magnitude_max=values.get("mmax"),
        increasing=values.get("inc", False),
        op_set=op_set[0] if op_set else "",
    )
    if policy.magnitude < 0 or policy.layers < 1 or not 0 <= policy.prob <= 1 or policy.magnitude_std < 0:
        raise _refuse(text, "m and mstd must be >= 0, n >= 1 and p within [0, 1]")
    if policy.magnitude_max is not None and policy.magnitude_max < 1:
        raise _refuse(text, "mmax must be >= 1")
    return policy


def dali_problem(policy: AugmentPolicy) -> str | None:
    """Why the DALI loader cannot run `policy` as timm does (one line naming what DALI lacks), or None."""
    if policy.family == "augmix":
        why = "AugMix blends several augmented chains per image with Dirichlet and Beta weights"
    elif policy.op_set == "weights":
        why = "rand-tweights draws its ops by weight without replacement, which DALI's random ops cannot draw"
    elif policy.op_set in ("3a", "3aw") or policy.name == "3a":
        why = "3-Augment blurs with PIL's box-filter approximation of a Gaussian (GaussianBlur), which no DALI op computes"
    else:
        return None
    return (
        f"config key '{KEY}' = {policy.text!r} cannot run on the DALI loader: {why}; set train.loader: torch "
        "(timm's own transform on the CPU workers) or another policy"
    )


def config_problems(loaders) -> list[str]:
    """train.augment's problems for the Snakefile's config check (`loaders`: the train block's loaders
    part): a policy that is not timm's grammar, or one train.loader dali cannot run."""
    try:
        policy = parse_policy(loaders.augment["policy"])
    except PolicyError as err:
        return [str(err)]
    problem = dali_problem(policy) if loaders.loader == "dali" else None
    return [problem] if problem else []


def ran_as(policy: AugmentPolicy, loader_kind: str, decode: str) -> dict:
    """run.json's `augment`: the policy as configured, what it does and what ran it (`decode`: the
    loader's decode in words, "gpu: ..." or "cpu: ...")."""
    if not policy.on:
        runner = None
    elif loader_kind == "dali":
        where = "the GPU" if decode.startswith("gpu") else "the CPU"
        runner = f"DALI's operators on {where}, where the images are decoded, with timm's ops and maps (docs/augmentation.md)"
    else:
        library = "torchvision's TrivialAugmentWide" if policy.family == "trivial" else "timm's own transform"
        runner = f"{library} on the PIL image in the torch loader's workers"
    return {"policy": policy.text, "what": policy.words(), "ran_as": runner}


def timm_hparams(image_size: int) -> dict:
    """The hparams timm's create_transform gives its AutoAugment / RandAugment ops at this crop size:
    translate_const 0.45 x the size, the ImageNet mean (rounded, timm's IMAGENET_DEFAULT_MEAN: rectrain
    normalises with the same) as the fill outside a warped image - and bilinear resampling, rectrain's:
    timm's train.py default ('random') also draws bicubic, which DALI's warp_affine does not have
    (docs/augmentation.md)."""
    from PIL import Image
    from timm.data.constants import IMAGENET_DEFAULT_MEAN

    return {
        "translate_const": int(image_size * 0.45),
        "img_mean": tuple(min(255, round(255 * v)) for v in IMAGENET_DEFAULT_MEAN),
        "interpolation": Image.Resampling.BILINEAR,
    }


def torch_transform(policy: AugmentPolicy, image_size: int):
    """The torch loader's augmentation for `policy` on a uint8 CHW image tensor (None when off): timm's
    own transform (torchvision's TrivialAugmentWide for trivial) on the PIL image, under the sample's
    seed (SeededPIL)."""
    if not policy.on:
        return None
    if policy.family == "trivial":
        from torchvision.transforms import v2

        return SeededPIL(v2.TrivialAugmentWide())  # torch's RNG: the sample's seed already
    from timm.data import auto_augment

    hparams = timm_hparams(image_size)
    if policy.family == "rand":
        return SeededPIL(auto_augment.rand_augment_transform(policy.text, hparams))
    if policy.family == "augmix":
        return SeededPIL(auto_augment.augment_and_mix_transform(policy.text, dict(hparams, translate_pct=0.3)))
    return SeededPIL(auto_augment.auto_augment_transform(policy.text, hparams))


class SeededPIL:
    """A PIL transform applied to a uint8 CHW tensor, its Python and NumPy random draws seeded from
    torch's generator (timm draws from `random` and `np.random`, which the torch loader's per-sample
    seed, torch.manual_seed, does not reach), their global states left as they were."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image):
        import numpy as np
        import torch
        from torchvision.transforms.v2 import functional as F

        seed = int(torch.randint(2**31 - 1, ()))
        saved = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed)
        try:
            out = self.transform(F.to_pil_image(image.cpu()))
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
        return F.pil_to_tensor(out).to(image.device)

    def __repr__(self) -> str:
        return f"SeededPIL({self.transform!r})"
