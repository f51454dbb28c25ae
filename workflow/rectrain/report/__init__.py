"""results/report.html: one self-contained page on how fast, how good, and what held the run back."""

from rectrain.report.build import build
from rectrain.report.inputs import RunData, load

__all__ = ["build", "load", "RunData"]
