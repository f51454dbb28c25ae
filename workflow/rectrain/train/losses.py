"""The training loss (train.loss), chosen as timm's train.py chooses it:

- Mixup/CutMix on (train.mixup): the targets arrive soft, train.label_smoothing already folded in by
  timm.data.Mixup, so the loss adds none - timm's SoftTargetCrossEntropy (ce) or timm's
  BinaryCrossEntropy (bce) with train.bce_target_threshold;
- otherwise hard labels: torch's CrossEntropyLoss with train.label_smoothing (timm's
  LabelSmoothingCrossEntropy computes the same), or timm's BinaryCrossEntropy smoothing them itself.

One difference from timm's train.py: there --bce-loss without smoothing and without Mixup silently
trains cross-entropy; here train.loss bce is BCE whatever the other keys say.  Validation and the
evaluate stage count cross-entropy on hard labels either way (rectrain.metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the Snakefile's config check reads config_problems
    import torch

KEY = "train.loss"


def train_loss(network, mixed: bool = False) -> torch.nn.Module:
    """The loss for the train block's `network` part (loss, label_smoothing, bce_target_threshold);
    `mixed`: train.mixup is on, so the targets are soft."""
    if network.loss == "bce":
        from timm.loss import BinaryCrossEntropy

        smoothing = 0.0 if mixed else float(network.label_smoothing)
        return BinaryCrossEntropy(smoothing=smoothing, target_threshold=network.bce_target_threshold)
    if mixed:
        from timm.loss import SoftTargetCrossEntropy

        return SoftTargetCrossEntropy()
    from torch.nn import CrossEntropyLoss

    return CrossEntropyLoss(label_smoothing=network.label_smoothing)


def config_warnings(network) -> list[str]:
    """The Snakefile's warning on the loss keys (`network`: the train block's network part): a threshold
    that runs but changes nothing."""
    if network.bce_target_threshold is not None and network.loss != "bce":
        return [
            f"config key 'train.bce_target_threshold' = {network.bce_target_threshold} changes nothing with "
            f"{KEY} = {network.loss!r}: it thresholds BCE's targets; set {KEY}: bce or the threshold to null"
        ]
    return []


def words(network, mixed: bool) -> str:
    """What the loss is, for run.json and the report (recipe_as_run)."""
    if network.loss == "bce":
        threshold = network.bce_target_threshold
        cut = f", targets above {threshold:g} set to 1, the rest 0" if threshold is not None else ""
        source = "Mixup's soft targets" if mixed else f"one-hot targets smoothed by {network.label_smoothing:g}"
        return f"timm's BinaryCrossEntropy on {source}{cut}"
    if mixed:
        return "timm's SoftTargetCrossEntropy on Mixup's soft targets (label smoothing folded in)"
    return f"cross-entropy, label smoothing {network.label_smoothing:g}"
