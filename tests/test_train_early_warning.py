"""Early warnings on the console during training (rectrain.train.early_warning): val top-1 at chance
or a training loss still at an untrained network's, with the report's likely causes."""

import logging
import math

from rectrain.advice import MORE_STEPS_FIX
from rectrain.train import early_warning


def test_val_at_chance_after_the_second_epoch_is_warned_with_the_reports_causes():
    lines = early_warning.warnings(1, train_loss=1.2, val_top1=0.11, classes=10, opt_steps=50)
    assert lines == [
        "early warning: val top-1 11.0 % after 2 epochs is still at chance (10.0 % for 10 classes; warned at "
        f"1.5 x chance). Likely causes: {MORE_STEPS_FIX}"
    ]


def test_a_training_loss_still_at_ln_classes_is_warned_and_few_steps_named_first():
    (line,) = early_warning.warnings(2, train_loss=math.log(5) * 1.01, val_top1=0.6, classes=5, opt_steps=2)
    assert line.startswith("early warning: the training loss 1.626 after 3 epochs has not moved from an untrained")
    assert "ln(5) = 1.609" in line
    assert "Likely causes: Only 2 optimizer step(s) per epoch (fewer than 4): too few to learn. Give it" in line


def test_no_warning_for_the_first_epoch_a_learning_run_or_no_val_split(caplog):
    assert early_warning.warnings(0, math.log(10), 0.1, 10, 50) == [], "the first epoch is warm-up"
    assert early_warning.warnings(3, 0.9, 0.62, 10, 50) == []
    assert early_warning.warnings(3, 0.9, None, 10, 50) == [], "no val split, a loss that moved"
    with caplog.at_level(logging.WARNING):
        early_warning.warn(1, 1.2, 0.1, 10, 50)
    assert "early warning: val top-1 10.0 %" in caplog.text
