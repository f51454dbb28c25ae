"""train.augment.policy as DALI operators, where the DALI loader decodes (the GPU with mixed decode, else
the CPU), on the cropped uint8 HWC images before normalisation; the pipeline is built with
enable_conditionals (the batch is split per op with `if`, DALI's auto_aug `select`).

DALI's ready-made policies (nvidia.dali.auto_aug: rand_augment, auto_augment, trivial_augment_wide) are
not timm's: another op list (an identity, no invert or solarize-add), magnitudes in 31 bins, every
chosen op applied, no magnitude noise, one fill grey.  So the policy is built here from DALI's parts -
its `select` (the per-sample conditional split) and its op bodies where they compute what PIL computes
(nvidia.dali.auto_aug.augmentations: brightness, contrast, color, sharpness, posterize, solarize,
solarize_add, invert, equalize, auto_contrast) - with timm's op list, its level -> argument maps, its
per-op probability, its Gaussian magnitude noise (mstd) and its clip (mmax), and PIL's geometry (the
affine matrices of PIL's Image.transform and Image.rotate through warp_affine with inverse_map,
filled with timm's ImageNet-mean grey per channel).  timm draws the noisy magnitude from a continuous
Gaussian; here it is rounded to 0.01 of a level (LEVEL_STEPS bins per level).  TrivialAugment wide
follows torchvision's TrivialAugmentWide (its magnitude tables, nearest-neighbour warps, black fill).
docs/augmentation.md maps every op and says how far each is from PIL's (tests/test_augment_dali.py).

Each op's parameter for every magnitude bin (a 2x3 matrix for a warp) is a table computed once in
NumPy (op_tables) and indexed per image, as DALI's @augmentation does; not through @augmentation,
which computes the table inside the pipeline function that autograph converts - one converted Python
call per bin: 27 s to build rand-m9-n1 with 1,001 bins, measured - while autograph leaves an
lru_cache'd function alone.

`apply_policy(..., trace=True)` also returns, per image and slot (an op applied in turn), the op's index
(len(ops) when the slot was skipped), its magnitude bin and its sign: what the tests count.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali import math as dmath
from nvidia.dali.auto_aug import augmentations as stock
from nvidia.dali.auto_aug.core import select

from rectrain.loaders.augment import LEVEL_DENOM, AugmentPolicy, dali_problem, timm_hparams

LEVEL_STEPS = 100  # magnitude bins per timm level: timm's continuous magnitude, to 0.01
TRIVIAL_BINS = 31  # torchvision's TrivialAugmentWide(num_magnitude_bins=31), its default


def warp(data, matrix, fill_rgb=(128, 128, 128), interp=types.INTERP_LINEAR):
    """PIL's Image.transform(AFFINE): `matrix` (2x3) maps each output pixel's centre to its source in the
    input (warp_affine's inverse_map: the same convention, nearest-neighbour warps agree pixel for
    pixel), and what falls outside the image is `fill_rgb`.  DALI's fill_value is one number for all
    channels; a per-channel grey is the same warp of (image - grey) filled with 0, plus the grey."""
    if len(set(fill_rgb)) == 1:
        return fn.warp_affine(data, matrix=matrix, fill_value=float(fill_rgb[0]), interp_type=interp, inverse_map=True)
    grey = types.Constant(np.array(fill_rgb, np.float32))
    shifted = fn.cast(data, dtype=types.FLOAT) - grey
    warped = fn.warp_affine(shifted, matrix=matrix, fill_value=0.0, interp_type=interp, inverse_map=True)
    return fn.cast(warped + grey, dtype=types.UINT8)


def rotate_matrix(degrees: float, width: int, height: int) -> list[float]:
    """The inverse affine matrix PIL's Image.rotate(degrees) samples with (Pillow's Image.rotate: counter-
    clockwise about the centre (w/2, h/2), cosines rounded to 15 digits)."""
    angle = -math.radians(degrees % 360.0)
    m = [round(math.cos(angle), 15), round(math.sin(angle), 15), 0.0, round(-math.sin(angle), 15)]
    m += [round(math.cos(angle), 15), 0.0]
    cx, cy = width / 2.0, height / 2.0
    m[2] = m[0] * -cx + m[1] * -cy + cx
    m[5] = m[3] * -cx + m[4] * -cy + cy
    return m


def posterize_mask(bits: int) -> np.ndarray:
    """PIL's ImageOps.posterize(bits) as an AND mask: keep the `bits` high bits (0 or fewer: black, as
    timm's PosterizeIncreasing at m=10 gives; 8 or more: unchanged, as timm's posterize skips it)."""
    return np.array(255 if bits >= 8 else ~(2 ** (8 - bits) - 1) & 255, np.uint8)


def _param(kind: str, arg: float, size: int) -> np.ndarray:
    """An op's argument -> the parameter its DALI body takes (a 2x3 inverse matrix for the warps)."""
    if kind == "rotate":
        return np.array(rotate_matrix(arg, size, size), np.float32).reshape(2, 3)
    matrix = {
        "shear_x": [1, arg, 0, 0, 1, 0],
        "shear_y": [1, 0, 0, arg, 1, 0],
        "translate_x": [1, 0, arg, 0, 1, 0],
        "translate_y": [1, 0, 0, 0, 1, arg],
    }.get(kind)
    if matrix is not None:
        return np.array(matrix, np.float32).reshape(2, 3)
    if kind == "kernel":  # PIL's Sharpness: blend of the image and its SMOOTH filter, as one 3x3 kernel
        return stock.sharpness_kernel_shifted(np.float32(arg)).astype(np.float32)
    if kind == "bits":
        return posterize_mask(int(arg))
    if kind == "add":
        return np.array(arg, np.uint8)
    if kind == "threshold":  # PIL inverts i >= t: for whole i, i >= ceil(t) (float32 would round t)
        return np.array(math.ceil(arg), np.float32)
    return np.array(arg, np.float32)  # an enhance factor


# Each op's DALI body (the undecorated function of DALI's augmentation, or warp) and the kind of its
# parameter, by timm's names (timm.data.auto_augment.NAME_TO_OP) and torchvision's TrivialAugmentWide
# names (the same PIL operations).
_WARP_KINDS = {"Rotate": "rotate", "ShearX": "shear_x", "ShearY": "shear_y"}
_WARP_KINDS.update({f"Translate{a}{rel}": f"translate_{a.lower()}" for a in "XY" for rel in ("", "Rel")})
BODIES = {name: (warp, kind) for name, kind in _WARP_KINDS.items()}
BODIES.update(
    {
        "Brightness": (stock.brightness.op, "factor"),
        "Color": (stock.color.op, "factor"),
        "Contrast": (stock.contrast.op, "factor"),
        "Sharpness": (stock.sharpness.op, "kernel"),
        "Posterize": (stock.posterize.op, "bits"),
        "PosterizeOriginal": (stock.posterize.op, "bits"),
        "Solarize": (stock.solarize.op, "threshold"),
        "SolarizeAdd": (stock.solarize_add.op, "add"),
        "Invert": (stock.invert.op, None),
        "Equalize": (stock.equalize.op, None),
        "AutoContrast": (stock.auto_contrast.op, None),
        "Identity": (stock.identity.op, None),
    }
)
BODIES.update({n + "Increasing": BODIES[n] for n in ("Posterize", "Solarize", "Color", "Contrast", "Brightness")})
BODIES["SharpnessIncreasing"] = BODIES["Sharpness"]
# Parameters used in arithmetic with the pixels live where the pixels are (DALI's param_device "auto");
# the others are operator arguments, which DALI takes from the CPU.
ON_DATA_DEVICE = {"kernel", "bits", "threshold", "add"}


def _scaled(factor_of_hparams):
    return lambda level, hparams: level / LEVEL_DENOM * factor_of_hparams(hparams)


# timm's level -> argument maps that negate at random (timm.data.auto_augment: _rotate_level_to_arg,
# _shear_level_to_arg, _translate_*_level_to_arg, _enhance_increasing_level_to_arg): the same arithmetic
# with the sign carried by the level (a negated level is timm's negated draw).  tests/test_augment_dali.py
# holds them to timm's functions.  The maps that never negate are timm's own (LEVEL_TO_ARG).
SIGNED_LEVEL_TO_ARG = {
    "Rotate": _scaled(lambda h: 30.0),
    "ShearX": _scaled(lambda h: 0.3),
    "ShearY": _scaled(lambda h: 0.3),
    "TranslateX": _scaled(lambda h: float(h["translate_const"])),
    "TranslateY": _scaled(lambda h: float(h["translate_const"])),
    "TranslateXRel": _scaled(lambda h: h.get("translate_pct", 0.45)),
    "TranslateYRel": _scaled(lambda h: h.get("translate_pct", 0.45)),
}
for _name in ("Color", "Contrast", "Brightness", "Sharpness"):
    SIGNED_LEVEL_TO_ARG[_name + "Increasing"] = lambda level, h: max(0.1, 1.0 + level / LEVEL_DENOM * 0.9)


def timm_arg(name: str, level: float, hparams: dict) -> float | None:
    """timm's argument of op `name` at magnitude `level` (negative: timm's negated draw); None for an
    op without one."""
    from timm.data.auto_augment import LEVEL_TO_ARG

    if name in SIGNED_LEVEL_TO_ARG:
        return SIGNED_LEVEL_TO_ARG[name](level, hparams)
    level_to_arg = LEVEL_TO_ARG[name]
    return None if level_to_arg is None else level_to_arg(level, hparams)[0]


def timm_pixel_arg(name: str, level: float, hparams: dict, size: int) -> float | None:
    """timm_arg, a relative translation in pixels of a `size` px image as timm's translate_*_rel
    computes them (pct x the image's width or height)."""
    arg = timm_arg(name, level, hparams)
    return arg * size if name in ("TranslateXRel", "TranslateYRel") else arg


def trivial_arg(name: str, magnitude: float) -> float:
    """torchvision's argument of TrivialAugmentWide's op at a (signed) magnitude, on a PIL image
    (v2's _AutoAugmentBase._apply_image_or_video_transform)."""
    if name in ("TranslateX", "TranslateY"):
        return -int(magnitude)  # translate=[int(m), 0]: each pixel's source is int(m) px before it
    if name in ("Brightness", "Color", "Contrast", "Sharpness"):
        return 1.0 + magnitude
    if name == "Solarize":
        return 255.0 * magnitude
    return magnitude  # Rotate's degrees, a shear's factor (tan(atan(m))), Posterize's bits


@dataclass(frozen=True)
class Op:
    """One op of a policy: its name, its DALI body, the kind of its parameter, and its parameter per
    magnitude bin (rows 2b and 2b + 1: bin b and its negation, when `signed`); table None: none."""

    name: str
    body: object
    kind: str | None
    table: np.ndarray | None
    signed: bool


def _op(name: str, magnitudes, signed: bool, arg_of, size: int) -> Op:
    body, kind = BODIES[name]
    if kind is None or magnitudes is None:
        return Op(name, body, None, None, False)
    signs = (1.0, -1.0) if signed else (1.0,)
    rows = [_param(kind, arg_of(float(m) * s), size) for m in magnitudes for s in signs]
    return Op(name, body, kind, np.stack(rows), signed)


def trivial_ops(size: int) -> tuple[Op, ...]:
    """torchvision's TrivialAugmentWide ops with its magnitude tables, read from torchvision."""
    from torchvision.transforms import v2

    ops = []
    for name, (magnitudes_of, signed) in v2.TrivialAugmentWide._AUGMENTATION_SPACE.items():
        magnitudes = magnitudes_of(TRIVIAL_BINS, size, size)
        table = None if magnitudes is None else magnitudes.double().numpy()
        ops.append(_op(name, table, signed, lambda m, n=name: trivial_arg(n, m), size))
    return tuple(ops)


@functools.lru_cache(maxsize=16)
def op_tables(policy: AugmentPolicy, size: int) -> tuple[tuple[Op, ...], tuple]:
    """The policy's ops, read from the library that defines it, with their parameter tables, and what
    its slots draw from (rand: nothing more; auto: timm's sub-policies as (op index, prob, level) rows)."""
    from timm.data import auto_augment

    if policy.family == "trivial":
        return trivial_ops(size), ()
    hparams = timm_hparams(size)
    if policy.family == "rand":
        names, sub_policies = auto_augment.rand_augment_choices("", policy.increasing), []
    else:
        sub_policies = auto_augment.auto_augment_policy(policy.name, hparams)
        names = [a.name for sp in sub_policies for a in sp]
    levels = np.arange(policy.upper * LEVEL_STEPS + 1) / LEVEL_STEPS
    ops = tuple(
        _op(n, levels, n in SIGNED_LEVEL_TO_ARG, lambda m, n=n: timm_pixel_arg(n, m, hparams, size), size)
        for n in dict.fromkeys(names)
    )
    index = {op.name: k for k, op in enumerate(ops)}
    rows = tuple(tuple((index[a.name], a.prob, a.magnitude) for a in sp) for sp in sub_policies)
    return ops, rows


def _bins(level, policy: AugmentPolicy, shape: tuple):
    """Magnitude bins of `level` (a number or a batch) after timm's noise and clip: a Gaussian of std
    mstd (for mstd inf a uniform draw in [0, level]), clipped to [0, upper], rounded to the bin grid."""
    scaled = level * LEVEL_STEPS
    if policy.magnitude_std == math.inf:
        scaled = fn.random.uniform(range=[0.0, 1.0], shape=shape) * scaled
    elif policy.magnitude_std > 0:
        scaled = scaled + fn.random.normal(stddev=policy.magnitude_std * LEVEL_STEPS, shape=shape)
    elif isinstance(scaled, (int, float)):  # a plain number: the same bin for every image
        return types.Constant(np.full(shape, round(min(scaled, policy.upper * LEVEL_STEPS)), np.int32))
    clipped = dmath.clamp(scaled, 0.0, float(policy.upper * LEVEL_STEPS))
    return fn.cast(clipped, dtype=types.INT32)  # DALI's cast rounds to the nearest whole number


def _applied(op, prob, skip: int, shape: tuple):
    """`op` where a draw of probability `prob` (a number or a batch) applies it, else `skip`."""
    if isinstance(prob, (int, float)) and prob >= 1:
        return op
    # timm applies an op when random.random() <= p; a uniform draw per slot, as DALI's auto_augment does
    on = fn.cast(fn.random.uniform(range=[0.0, 1.0], shape=shape) < prob, dtype=types.INT32)
    return op * on + skip * (1 - on)


@dataclass(frozen=True)
class Slots:
    """What each image draws: per slot (an op applied in turn) the op's index (len(ops): skipped) and
    its magnitude bin, as batches of shape (width,)."""

    op: object
    bins: object
    width: int


def rand_slots(policy: AugmentPolicy, ops: tuple[Op, ...]) -> Slots:
    """timm's RandAugment: n ops per image drawn with replacement, each applied with probability p, at
    magnitude m (+ noise)."""
    shape = (policy.layers,)
    chosen = fn.random.uniform(values=list(range(len(ops))), shape=shape, dtype=types.INT32)
    op = _applied(chosen, policy.prob, len(ops), shape)
    return Slots(op, _bins(policy.magnitude, policy, shape), policy.layers)


def auto_slots(rows: tuple, ops: tuple[Op, ...], policy: AugmentPolicy) -> Slots:
    """timm's AutoAugment: one sub-policy (rows: its (op index, prob, level) per op) per image,
    uniformly; each of its ops applied with its own probability at its own magnitude (+ noise)."""
    width = max(len(r) for r in rows)
    padded = [list(r) + [(len(ops), 0.0, 0)] * (width - len(r)) for r in rows]
    which = fn.random.uniform(values=list(range(len(rows))), dtype=types.INT32)

    def column(k: int, dtype):
        return types.Constant(np.array([[entry[k] for entry in r] for r in padded], dtype))[which]

    op = _applied(column(0, np.int32), column(1, np.float32), len(ops), (width,))
    return Slots(op, _bins(column(2, np.float32), policy, (width,)), width)


def trivial_slots(ops: tuple[Op, ...]) -> Slots:
    """torchvision's TrivialAugmentWide: one op per image, uniformly, at a uniform magnitude bin."""
    op = fn.random.uniform(values=list(range(len(ops))), shape=(1,), dtype=types.INT32)
    return Slots(op, fn.random.uniform(values=list(range(TRIVIAL_BINS)), shape=(1,), dtype=types.INT32), 1)


def run_op(op: Op, style: dict, data, *, bins, signs):
    """`op` on the images of its branch: its parameter looked up by each image's bin (and sign)."""
    param = None
    if op.table is not None:
        device = (data.device or "cpu") if op.kind in ON_DATA_DEVICE else "cpu"
        param = types.Constant(op.table, device=device)[bins * 2 + signs if op.signed else bins]
    if op.body is warp:
        return warp(data, param, **style)
    return op.body(data, param)


def apply_policy(images, policy: AugmentPolicy, size: int, *, trace: bool = False):
    """The policy on a batch of `size` x `size` uint8 HWC images.  With trace: (images, per image a
    (slots, 3) array of op index - len(ops) when skipped -, magnitude bin and sign, the ops' names).
    A policy DALI cannot run raises augment.dali_problem's one line."""
    problem = dali_problem(policy)
    if problem:
        raise ValueError(problem)
    ops, rows = op_tables(policy, size)
    if policy.family == "trivial":  # torchvision's defaults: nearest-neighbour, black outside
        slots, style = trivial_slots(ops), {"fill_rgb": (0, 0, 0), "interp": types.INTERP_NN}
    else:
        slots = rand_slots(policy, ops) if policy.family == "rand" else auto_slots(rows, ops, policy)
        style = {"fill_rgb": timm_hparams(size)["img_mean"], "interp": types.INTERP_LINEAR}
    signs = fn.random.uniform(values=[0, 1], shape=(slots.width,), dtype=types.INT32)
    branches = [functools.partial(run_op, op, style) for op in ops] + [lambda data, **_: data]
    for k in range(slots.width):
        images = select(branches, slots.op[k], data=images, bins=slots.bins[k], signs=signs[k])
    if not trace:
        return images
    return images, fn.stack(slots.op, slots.bins, signs, axis=1), [op.name for op in ops]
