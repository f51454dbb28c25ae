"""Whether a finished run is at chance: its final val top-1 within noise of what guessing reaches, after
training long enough to learn.  The evaluate stage judges it (metrics.json's and weights.json's
`at_chance`), the report shows it as its first card, and the Snakemake run that targets it ends with
its line and a non-zero exit status unless `train.allow_chance: true` says a run at chance is expected
(rectrain.snakefile.hooks).  Shared by those three, kept outside them (a stage never imports a later one).

The rule:
- chance is the top-1 of always answering the largest val class: the larger of 1 / classes and that
  class's share of the val images;
- within noise: the top-1 is at most chance + Z standard errors of a top-1 measured on that many val
  images by a model at chance (binomial: sqrt(chance (1 - chance) / images)) - a guesser scores that
  much or more one time in a hundred;
- long enough to learn: at least MIN_EPOCHS epochs, each of at least report.min_steps_per_epoch
  optimizer steps (the report's own floor below which a run is too short: the schema's default, as
  training's early warnings read it - the evaluate stage does not get the report block).
A run shorter than that gets no verdict: the report's few-steps finding says what it lacked.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from rectrain.advice import MORE_STEPS_FIX
from rectrain.config import stage_block

Z = 2.33  # one-sided 1 %
# The exit status of a Snakemake run whose evaluation is at chance (unless train.allow_chance): a failure.
EXIT_AT_CHANCE = 1
MIN_EPOCHS = 2  # training's early warnings also start after the second epoch


@functools.lru_cache(maxsize=1)
def min_steps_per_epoch() -> int:
    """report.min_steps_per_epoch's default (config/schema.yaml), as training's early warnings read it."""
    return int(stage_block("report", "{}")["min_steps_per_epoch"])


def level(class_images: list[int]) -> float:
    """The top-1 of always answering the largest class of these val image counts (one per class)."""
    total = sum(class_images)
    uniform = 1.0 / max(len(class_images), 1)
    return max(uniform, max(class_images) / total) if total > 0 else uniform


def noise_limit(chance: float, images: int) -> float:
    """The most a model at `chance` scores on `images` val images, but one time in a hundred."""
    return chance + Z * math.sqrt(chance * (1 - chance) / max(images, 1))


@dataclass(frozen=True)
class Verdict:
    """A run at chance, with the numbers its line quotes."""

    top1: float
    images: int
    chance: float
    limit: float
    epochs: int
    steps_per_epoch: int

    @property
    def fix(self) -> str:
        return f"{MORE_STEPS_FIX} Set train.allow_chance: true where a run at chance is expected."

    def line(self) -> str:
        return (
            f"at chance: val top-1 {100 * self.top1:.1f} % on {self.images} val images is within noise of chance "
            f"({100 * self.chance:.1f} %; at most {100 * self.limit:.1f} % is chance + {Z:g} standard errors) "
            f"after {self.epochs} epochs of {self.steps_per_epoch} optimizer steps: the model learned nothing usable. "
            f"{self.fix}"
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "line": self.line(), "fix": self.fix}


def judge(top1: float, class_images: list[int], epochs: int, optimizer_steps: int) -> Verdict | None:
    """The verdict on a finished run (None: it learned, or it trained too briefly to say): its top-1,
    the val images of each class, the epochs and optimizer steps it trained."""
    images = sum(class_images)
    if epochs < MIN_EPOCHS or images <= 0 or not class_images:
        return None
    per_epoch = optimizer_steps // epochs
    if per_epoch < min_steps_per_epoch():
        return None
    chance = level(class_images)
    limit = noise_limit(chance, images)
    return Verdict(top1, images, chance, limit, epochs, per_epoch) if top1 <= limit else None
