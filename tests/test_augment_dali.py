"""train.augment.policy on DALI's operators (rectrain.loaders.dali_augment) against the libraries that define
each policy, and against docs/augmentation.md's tables: each op alone on a real photograph equals timm's
PIL op (torchvision's for TrivialAugment) within the bound the table states, at the argument the table
states; over 2,000 images the ops applied per image, their shares, magnitudes and signs are the policy's
(chi-square tests at the 0.001 level, each shown able to reject the distribution of DALI's own
RandAugment).  CPU DALI, as in the demo."""

import dataclasses
import re

import numpy as np
import pytest
from helpers import REPO
from helpers.augment_draws import difference, draw, real_image, reference
from scipy import stats

from rectrain.loaders.augment import parse_policy, timm_hparams
from rectrain.loaders.dali_augment import LEVEL_STEPS, timm_pixel_arg
from rectrain.loaders.dali_augment import SIGNED_LEVEL_TO_ARG as SIGNED

DOC = REPO / "docs" / "augmentation.md"
SIZE = 224
ALPHA = 0.001  # each chi-square test's level


def doc_table(heading: str) -> dict[str, list[str]]:
    """The table under `heading` in docs/augmentation.md: {op name: its row's cells}, a row naming
    several ops (`TranslateX`, `TranslateY`) under each."""
    section = DOC.read_text(encoding="utf-8").split(f"## {heading}")[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[0]) if line.startswith("| `") else []:
            rows[name] = cells
    return rows


def bounds(*headings: str) -> dict[str, tuple[float, float]]:
    """{op: (mean |difference| bound, bound on the share of values more than 2 apart)} from the tables'
    last column ("mean ≤ 1.0, > 2: ≤ 1.2 %")."""
    out = {}
    for heading in headings:
        for name, cells in doc_table(heading).items():
            match = re.fullmatch(r"mean ≤ ([\d.]+), > 2: ≤ ([\d.]+) %", cells[-1])
            if match:
                out[name] = (float(match[1]), float(match[2]) / 100)
    return out


def worst_per_op(policy, image, draws) -> dict[str, tuple[float, float, int]]:
    """{op: (largest mean difference, largest share > 2, images)} over the images that got exactly one
    op, each against the library's op at the magnitude and sign the image drew."""
    worst: dict = {}
    for out, slots in zip(draws.images, draws.trace, strict=True):
        applied = [s for s in slots if s[0] != len(draws.names)]
        if len(applied) != 1:
            continue
        op, bin_, sign = applied[0]
        name = draws.names[op]
        mean, share = difference(reference(policy, image, name, bin_, sign), out)
        was = worst.get(name, (0.0, 0.0, 0))
        worst[name] = (max(was[0], mean), max(was[1], share), was[2] + 1)
    return worst


def assert_within(worst: dict, held: dict, expected_ops) -> None:
    assert set(worst) == set(expected_ops), f"ops never drawn alone: {set(expected_ops) - set(worst)}"
    over = {n: w for n, w in worst.items() if w[0] > held[n][0] or w[1] > held[n][1]}
    assert not over, f"(mean, share > 2, images) beyond docs/augmentation.md's bounds {held}: {over}"


@pytest.fixture(scope="module")
def photo():
    return real_image(SIZE)


def test_each_op_of_rand_m9_mstd05_inc1_at_magnitude_9_equals_timms_pil_op_within_the_docs_bound(photo):
    """Every op of the policy, alone (n=1, p=1) at magnitude 9 without noise, through rectrain's DALI
    graph on a 224 px photograph, against timm's own op at the same magnitude and sign; and the docs'
    argument column is timm's argument."""
    policy = dataclasses.replace(parse_policy("rand-m9-mstd0.5-inc1"), layers=1, prob=1.0, magnitude_std=0.0)
    draws = draw(policy, photo, copies=150)
    assert set(draws.trace[:, 0, 1]) == {9 * LEVEL_STEPS}, "every op at magnitude 9"
    seen = {(draws.names[op], sign) for op, _, sign in draws.trace[:, 0]}
    assert len(seen) == 2 * len(draws.names) == 30, "each of the 15 ops with either sign"
    assert_within(worst_per_op(policy, photo, draws), bounds("RandAugment's ops"), draws.names)
    assert_docs_arguments_are_timms("RandAugment's ops")


def assert_docs_arguments_are_timms(heading: str) -> None:
    """The table's second column, timm's argument at m=9 (both signs where timm negates), is timm's."""
    hparams = timm_hparams(SIZE)
    for name, cells in doc_table(heading).items():
        written = {float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", cells[1].split("(")[0])}
        args = {timm_pixel_arg(name, level, hparams, SIZE) for level in ((9, -9) if name in SIGNED else (9,))}
        timm = set() if args == {None} else {round(float(a), 2) for a in args}
        assert written == timm, f"{name}: docs/augmentation.md says {cells[1]!r}, timm gives {timm}"


@pytest.mark.parametrize("text", ["original", "v0"])
def test_each_op_of_autoaugments_imagenet_policies_alone_equals_timms_pil_op_within_the_docs_bound(photo, text):
    """AutoAugment's sub-policies draw other ops (Posterize, Solarize, Color ... that do not grow with the
    magnitude) at their own magnitudes: the images that got one op, against timm's op.  Every op that can
    come alone is seen alone; one whose sub-policies all apply a partner with probability 1 cannot
    (ShearX in original, TranslateYRel in v0: their maps and bodies are RandAugment's, tested above)."""
    from timm.data.auto_augment import auto_augment_policy

    policy = parse_policy(text)
    draws = draw(policy, photo, copies=200, runs=3)
    alone = {
        a.name
        for sub in auto_augment_policy(text, timm_hparams(SIZE))
        for a in sub
        if a.prob > 0 and all(b.prob < 1 for b in sub if b is not a)
    }
    held = bounds("RandAugment's ops", "AutoAugment's and RandAugment's other ops")
    assert_within(worst_per_op(policy, photo, draws), held, alone)


def test_the_docs_arguments_of_the_ops_that_do_not_grow_with_the_magnitude_are_timms():
    assert_docs_arguments_are_timms("AutoAugment's and RandAugment's other ops")


def test_each_op_of_trivial_augment_wide_equals_torchvisions_within_the_docs_bound(photo):
    policy = parse_policy("trivial")
    draws = draw(policy, photo, copies=200, runs=2)
    assert_within(worst_per_op(policy, photo, draws), bounds("TrivialAugment wide"), draws.names)


@pytest.fixture(scope="module")
def rand_2000():
    """What 2,000 small images drew under rand-m9-mstd0.5-inc1."""
    return draw(parse_policy("rand-m9-mstd0.5-inc1"), real_image(32), copies=250, runs=8, seed=7)


def chi_square(observed, probabilities) -> float:
    """The chi-square test's p-value of `observed` counts against `probabilities` (zeros made tiny)."""
    observed, p = np.asarray(observed, float), np.asarray(probabilities, float) + 1e-12
    return stats.chisquare(observed, observed.sum() * p / p.sum()).pvalue


def test_over_2000_images_the_number_of_ops_applied_per_image_is_the_policys(rand_2000):
    """n = 2 slots, each applied with p = 0.5: 0, 1, 2 ops with probability 1/4, 1/2, 1/4 - not DALI's
    rand_augment, which applies both."""
    applied = (rand_2000.trace[:, :, 0] != len(rand_2000.names)).sum(axis=1)
    counts = np.bincount(applied, minlength=3)
    assert len(applied) == 2000
    assert chi_square(counts, [0.25, 0.5, 0.25]) > ALPHA, counts
    assert chi_square(counts, [0, 0, 1]) < 1e-9, "the test tells DALI's own RandAugment apart"


def test_over_2000_images_each_op_is_an_equal_share_of_the_applied_ones(rand_2000):
    ops = rand_2000.trace[:, :, 0].ravel()
    counts = np.bincount(ops[ops != len(rand_2000.names)], minlength=15)
    assert len(counts) == 15 and chi_square(counts, np.full(15, 1 / 15)) > ALPHA, counts
    # DALI's own suite: 14 ops, an identity among them, neither invert nor solarize_add (timm's 3rd, 7th)
    assert chi_square(counts, [0 if k in (2, 6) else 1 / 13 for k in range(15)]) < 1e-9


def test_over_2000_images_the_magnitudes_are_timms_gaussian_noise_clipped_and_the_signs_even(rand_2000):
    """Each applied op's level ~ N(9, 0.5) clipped to [0, 10] (timm's AugmentOp), rounded to 0.01: six
    bins whose edges sit half a step below the level they name, the last one the levels clipped to 10;
    DALI's own fixed magnitude fails the same test."""
    slots = rand_2000.trace.reshape(-1, 3)
    applied = slots[slots[:, 0] != len(rand_2000.names)]
    edges = np.array([8.0, 8.5, 9.0, 9.5, 10.0])
    counts = np.bincount(np.searchsorted(edges, applied[:, 1] / LEVEL_STEPS, side="right"), minlength=6)
    probabilities = np.diff(np.r_[0.0, stats.norm(9, 0.5).cdf(edges - 0.5 / LEVEL_STEPS), 1.0])
    assert chi_square(counts, probabilities) > ALPHA, (counts, probabilities)
    assert chi_square(counts, [0, 0, 0, 1, 0, 0]) < 1e-9, "a fixed magnitude 9 is told apart"
    signs = np.bincount(applied[:, 2], minlength=2)
    assert chi_square(signs, [0.5, 0.5]) > ALPHA, signs
