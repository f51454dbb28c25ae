"""The batch's device-side augmentation (rectrain.train.step's `Step.augment_batch`): timm's random
erasing (train.augment.reprob, remode, recount) and then timm's Mixup/CutMix (train.mixup), on the
normalised batch where it already is (the GPU after DALI's mixed decode), in the order DeiT's and
ConvNeXt's training applies them (timm's transform erases each image, Mixup mixes the batch in the
training loop).  Both are timm's own classes (timm.data.random_erasing.RandomErasing with the batch's
device, timm.data.Mixup); what is here is the glue: which of them a config turns on, the epoch from which
Mixup stops mixing (train.mixup.off_epoch, as timm's train.py sets `mixup_enabled`), the checks, and
what run.json says of them.

Their random draws are timm's own: Python's `random` (erasing's rectangles), NumPy's global generator
(Mixup's lambdas and switches) and torch's on the batch's device (erasing's noise) - the rank's RNG
states, which every checkpoint saves and a resume restores (rectrain.train.lifecycle.checkpoint.rng_state),
so a resumed step draws what the uninterrupted one drew; a new run seeds them per rank
(checkpoint.seed_host_rngs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the Snakefile's config check reads config_problems
    import torch

MIXUP_KEY = "train.mixup"


def mixup_on(mixup: dict) -> bool:
    """train.mixup mixes anything: one of its alphas is set (timm's `mixup_active`)."""
    return mixup["mixup_alpha"] > 0 or mixup["cutmix_alpha"] > 0


def erasing_on(augment: dict) -> bool:
    """train.augment erases anything: reprob above 0."""
    return augment["reprob"] > 0


class BatchAugment:
    """(images, labels) -> (images, targets) on the device: timm's RandomErasing, then timm's Mixup (soft,
    smoothed targets; hard labels pass through unchanged without it)."""

    def __init__(self, loaders, label_smoothing: float, num_classes: int, device: torch.device):
        # here, not at import: the Snakefile's check imports this module without torch (timm is loaded by
        # then: rectrain.train.optim imports it with the rank's modules)
        from timm.data import Mixup
        from timm.data.random_erasing import RandomErasing

        erase, mix = loaders.augment, loaders.mixup
        self.erasing = None
        if erasing_on(erase):
            self.erasing = RandomErasing(
                probability=erase["reprob"], mode=erase["remode"], max_count=erase["recount"], device=str(device)
            )
        self.mixup = None
        if mixup_on(mix):
            self.mixup = Mixup(
                mixup_alpha=mix["mixup_alpha"],
                cutmix_alpha=mix["cutmix_alpha"],
                prob=mix["prob"],
                switch_prob=mix["switch_prob"],
                mode=mix["mode"],
                label_smoothing=label_smoothing,
                num_classes=num_classes,
            )
        self.off_epoch = mix["off_epoch"]

    def begin_epoch(self, epoch: int) -> None:
        """From train.mixup.off_epoch on nothing is mixed; the targets stay timm's soft, smoothed ones."""
        if self.mixup is not None:
            self.mixup.mixup_enabled = self.off_epoch is None or epoch < self.off_epoch

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.erasing is not None:
            images = self.erasing(images)
        if self.mixup is not None:
            images, labels = self.mixup(images, labels)
        return images, labels


def build(loaders, label_smoothing: float, num_classes: int, device: torch.device) -> BatchAugment | None:
    """The run's batch augmentation from the train block's `loaders` part and train.label_smoothing, or None
    when neither random erasing nor Mixup/CutMix is on."""
    if not (erasing_on(loaders.augment) or mixup_on(loaders.mixup)):
        return None
    if mixup_on(loaders.mixup) and num_classes < 2:
        raise ValueError(
            f"config key '{MIXUP_KEY}' mixes the labels of {num_classes} class: Mixup/CutMix needs at least 2; "
            "set its mixup_alpha and cutmix_alpha to 0"
        )
    return BatchAugment(loaders, label_smoothing, num_classes, device)


def hard_labels(targets: torch.Tensor) -> torch.Tensor:
    """The hard label each training image is counted against (train accuracy): its own without mixing, and
    under Mixup/CutMix the one that holds the larger share of its mixed target."""
    return targets.argmax(1) if targets.ndim == 2 else targets


def config_problems(loaders, batch_size) -> list[str]:
    """The Snakefile's check (`loaders`: the train block's loaders part; `batch_size`: train.batch_size):
    Mixup/CutMix pairs each image with another of its micro-batch (timm.data.Mixup asserts an even batch)."""
    if mixup_on(loaders.mixup) and isinstance(batch_size, int) and batch_size % 2:
        return [
            f"config key '{MIXUP_KEY}' mixes each image with another of its per-device batch, which must be even "
            f"(train.batch_size = {batch_size}); set train.batch_size to {batch_size + 1} or {batch_size - 1}"
        ]
    return []


def words(loaders) -> dict:
    """run.json's and the report's line on what the batch augmentation did (recipe_as_run)."""
    erase, mix = loaders.augment, loaders.mixup
    erasing = (
        f"timm's RandomErasing on the device: p {erase['reprob']:g}, mode {erase['remode']}, up to "
        f"{erase['recount']} rectangle(s)"
        if erasing_on(erase)
        else None
    )
    mixing = None
    if mixup_on(mix):
        kinds = [f"Mixup alpha {mix['mixup_alpha']:g}"] if mix["mixup_alpha"] else []
        kinds += [f"CutMix alpha {mix['cutmix_alpha']:g}"] if mix["cutmix_alpha"] else []
        switch = f", CutMix with p {mix['switch_prob']:g}" if len(kinds) == 2 else ""
        until = f", off from epoch {mix['off_epoch']}" if mix["off_epoch"] is not None else ""
        mixing = (
            f"timm's Mixup on the device: {' and '.join(kinds)}{switch}, p {mix['prob']:g} per {mix['mode']}{until}; "
            "soft targets with train.label_smoothing folded in"
        )
    return {"random_erasing": erasing, "mixup": mixing}
