"""Early warnings on the console: after a validated epoch (from the second on), rank 0 logs a warning
when validation is still at chance or the training loss has not left its untrained value, naming the
likely causes - the report's learning findings (rectrain.report.learning), epochs before the report.

Thresholds: the report block's defaults (report.chance_factor, report.min_steps_per_epoch).  Training
does not receive the report block - editing a report key must not retrain - so a user's own values
there apply to the report alone."""

from __future__ import annotations

import functools
import logging
import math

from rectrain.advice import MORE_STEPS_FIX
from rectrain.config import stage_block
from rectrain.log import PROGRESS_LOGGER

# The first epoch is often near chance on any dataset (warm-up): warnings start after the second.
FIRST_EPOCH = 1
# A training loss within this share of ln(classes) - the loss of an untrained network's near-uniform
# output - has not moved.
UNMOVED_SHARE = 0.03


@functools.lru_cache(maxsize=1)
def report_defaults():
    return stage_block("report", "{}")


def warnings(epoch: int, train_loss: float, val_top1: float | None, classes: int, opt_steps: int) -> list[str]:
    """The warning lines for `epoch` (none when it looks like learning); `opt_steps`: optimizer steps per epoch."""
    if epoch < FIRST_EPOCH or classes < 2:
        return []
    found = []
    done = f"after {epoch + 1} epochs"
    chance = 1.0 / classes
    factor = float(report_defaults()["chance_factor"])
    if val_top1 is not None and val_top1 <= factor * chance:
        found.append(
            f"val top-1 {100 * val_top1:.1f} % {done} is still at chance ({100 * chance:.1f} % for {classes} "
            f"classes; warned at {factor:g} x chance)"
        )
    untrained = math.log(classes)
    if abs(train_loss - untrained) <= UNMOVED_SHARE * untrained:
        found.append(
            f"the training loss {train_loss:.3f} {done} has not moved from an untrained network's "
            f"ln({classes}) = {untrained:.3f}"
        )
    if not found:
        return []
    causes = [MORE_STEPS_FIX]
    least = int(report_defaults()["min_steps_per_epoch"])
    if opt_steps < least:
        causes.insert(0, f"Only {opt_steps} optimizer step(s) per epoch (fewer than {least}): too few to learn.")
    return [f"early warning: {text}. Likely causes: {' '.join(causes)}" for text in found]


def warn(epoch: int, train_loss: float, val_top1: float | None, classes: int, opt_steps: int) -> None:
    """Rank 0: the warnings, in its log and on the terminal the run was started from (rectrain.log)."""
    for line in warnings(epoch, train_loss, val_top1, classes, opt_steps):
        logging.getLogger(PROGRESS_LOGGER).warning("%s", line)
