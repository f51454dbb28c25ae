"""rectrain.chance: a finished run's top-1 within noise of chance, after training long enough to learn -
the rule the evaluate stage marks, the report cards and the Snakemake run fails on."""

import math

import pytest

from rectrain import chance


def test_chance_is_the_larger_of_one_over_the_classes_and_the_largest_val_class():
    assert chance.level([10, 10, 10, 10]) == 0.25
    assert chance.level([70, 10, 10, 10]) == 0.7, "always answering the largest class"


def test_within_noise_is_chance_plus_2_33_standard_errors_of_that_many_images():
    # 10 classes, 120 val images (the demo): 0.1 + 2.33 x sqrt(0.1 x 0.9 / 120) = 0.164
    assert chance.noise_limit(0.1, 120) == pytest.approx(0.1 + 2.33 * math.sqrt(0.09 / 120))
    at = chance.judge(0.108, [12] * 10, epochs=8, optimizer_steps=80)
    assert at is not None and at.limit == pytest.approx(0.1638, abs=1e-4) and at.steps_per_epoch == 10
    assert at.line().startswith("at chance: val top-1 10.8 % on 120 val images is within noise of chance (10.0 %;")
    assert "Set train.allow_chance: true where a run at chance is expected." in at.line()
    assert chance.judge(0.17, [12] * 10, epochs=8, optimizer_steps=80) is None, "above the noise: it learned"


@pytest.mark.parametrize(
    ("epochs", "steps", "why"),
    [
        (1, 40, "one epoch: too short to judge"),
        (2, 6, "3 optimizer steps an epoch, under report.min_steps_per_epoch (4)"),
    ],
)
def test_a_run_too_short_to_learn_gets_no_verdict(epochs, steps, why):
    assert chance.judge(0.1, [12] * 10, epochs=epochs, optimizer_steps=steps) is None, why
    assert chance.judge(0.1, [12] * 10, epochs=2, optimizer_steps=8) is not None, "2 epochs of 4 steps: judged"
