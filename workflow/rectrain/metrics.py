"""What evaluation counts, shared by the evaluate stage and training's per-epoch validation.

Both import this module (neither imports the other), so editing how the evaluate stage writes its
outputs does not rerun training, and epochs.csv and metrics.json count the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rectrain import model as models
from rectrain.progress import Marks, Progress
from rectrain.stepclock import StepClock


@dataclass
class Tally:
    """Sums over evaluated images; additive across ranks and batches."""

    confusion: torch.Tensor  # [C, C] int64, row = true label, column = predicted
    top5_hits: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def images(self) -> int:
        return int(self.confusion.sum())

    def scores(self) -> dict:
        """top1, top5 and the mean loss over the images counted (a tally of none has no scores)."""
        n = self.images
        if n == 0:
            raise ValueError("the val .rec produced no images: check the pack stage's val manifest")
        return {
            "top1": float(self.confusion.diagonal().sum()) / n,
            "top5": self.top5_hits / n,
            "loss": self.loss_sum / n,
        }


def predict(model: torch.nn.Module, images: torch.Tensor, flip_tta: bool = False) -> torch.Tensor:
    """float32 logits of a batch; with flip_tta the mean of the images' and their mirror images' logits
    (horizontal-flip test-time augmentation, as FFCV's ImageNet evaluation does)."""
    logits = model(images).float()
    if flip_tta:
        logits = (logits + model(images.flip(3)).float()) / 2
    return logits


@torch.inference_mode()
def tally(
    model: torch.nn.Module,
    batches,
    num_classes: int,
    device: torch.device,
    precision: str = "fp32",
    *,
    channels_last: bool = False,
    progress: Progress | None = None,
    flip_tta: bool = False,
) -> Tally:
    """Confusion matrix, top-5 hits and summed cross-entropy over (images, labels) batches.  The evaluate
    stage and training's per-epoch validation both count with this.  With `progress` (rank 0, begun
    for this pass) it logs progress lines from clock marks read once per line; flip_tta: see predict."""
    t = Tally(confusion=torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device))
    k = min(5, num_classes)
    hits = torch.zeros((), dtype=torch.int64, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    start = time.perf_counter()
    marks = Marks(progress, StepClock(device)) if progress is not None else None
    for i, (images, labels) in enumerate(batches):
        images, labels = images.to(device), labels.to(device)
        if marks is not None:
            marks.data()
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with models.autocast(device, precision):
            logits = predict(model, images, flip_tta)
        loss += F.cross_entropy(logits, labels, reduction="sum").double()
        topk = logits.topk(k, dim=1).indices
        hits += (topk == labels[:, None]).any(dim=1).sum()
        t.confusion += torch.bincount(labels * num_classes + topk[:, 0], minlength=num_classes * num_classes).view(
            num_classes, num_classes
        )
        if marks is not None:
            marks.end(i, len(labels))
    t.top5_hits, t.loss_sum = int(hits), float(loss)
    t.seconds = time.perf_counter() - start
    return t


def all_reduce(t: Tally, device: torch.device) -> Tally:
    """Sum the tallies of every rank (no-op without a process group). Time = the slowest rank's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return t
    # clone(): the tally was counted under inference_mode, and an inference tensor cannot be updated
    # in place outside it (gloo's all_reduce of a CUDA tensor copies the sum back into it).
    conf = t.confusion.to(device).clone()
    sums = torch.tensor([t.top5_hits, t.loss_sum], dtype=torch.float64, device=device)
    secs = torch.tensor([t.seconds], dtype=torch.float64, device=device)
    dist.all_reduce(conf)
    dist.all_reduce(sums)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    return Tally(confusion=conf, top5_hits=int(round(sums[0].item())), loss_sum=float(sums[1]), seconds=float(secs))
