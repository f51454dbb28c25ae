"""The size the pack stores an image at: pack.resize (shorter side) or pack.max_side (longest side).

Kept free of image libraries so the Snakefile's config checks (rectrain.snakefile.checks) read the
same rule as the pack without importing Pillow or OpenCV.

The two keys are exclusive. Both as upper bounds would be a well-defined rule, but then neither key
says what the stored images look like (a 4:3 photo obeys one, a panorama the other), the crop checks
could no longer name the side that is too small, and a recipe that sets one on top of a config that
sets the other would silently get a third setting: an error naming both keys is clearer.
"""

from __future__ import annotations

from dataclasses import dataclass

from rectrain.config import ConfigError

# ImageNet's usual aspect (500x375 is its most common size): what a longest-side limit makes of the
# shorter side, for the config checks and the space estimate, which know no image.
TYPICAL_ASPECT = 4 / 3


@dataclass(frozen=True)
class Fit:
    """Shorter side <= ``shorter`` (pack.resize) or longest side <= ``longer`` (pack.max_side); 0 = no
    limit. The aspect is kept and an image within the limit is never enlarged (it passes through)."""

    shorter: int = 0
    longer: int = 0

    def __post_init__(self):
        if self.shorter and self.longer:
            raise ValueError(both_set_message(self.shorter, self.longer))

    @property
    def limit(self) -> int:
        return self.shorter or self.longer

    def limited_axis(self, width: int, height: int) -> int:
        """0 when the limit applies to the width, 1 to the height."""
        if self.shorter:
            return 0 if width <= height else 1
        return 0 if width >= height else 1

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The stored (width, height): the limited side = the limit, the other scaled and rounded."""
        axis = self.limited_axis(width, height)
        side, other = (width, height) if axis == 0 else (height, width)
        if not self.limit or side <= self.limit:
            return width, height
        scaled = max(1, round(other * self.limit / side))
        return (self.limit, scaled) if axis == 0 else (scaled, self.limit)

    def typical_shorter_side(self) -> int:
        """The shorter side a 4:3 photo larger than the limit is stored at (0 = no limit)."""
        return self.shorter or int(self.longer / TYPICAL_ASPECT)

    def describe(self) -> str:
        if self.shorter:
            return f"shorter side {self.shorter} px"
        return f"longest side {self.longer} px" if self.longer else "original size"


ORIGINAL = Fit()  # no limit: every image at its own size


def both_set_message(resize: int, max_side: int) -> str:
    return (
        f"config keys 'pack.resize' = {resize} and 'pack.max_side' = {max_side} are both set, but the pack stores "
        "one size rule: shorter side (resize) or longest side (max_side). Keep one: set pack.resize: 0 to keep "
        "max_side, or pack.max_side: null to keep resize"
    )


def pack_fit(resize: int | None, max_side: int | None) -> Fit:
    """The pack block's size rule (pack.resize, pack.max_side; 0 or None: unset); ConfigError naming
    both keys when both are set."""
    resize, max_side = int(resize or 0), int(max_side or 0)
    if resize and max_side:
        raise ConfigError(both_set_message(resize, max_side))
    return Fit(resize, max_side)
