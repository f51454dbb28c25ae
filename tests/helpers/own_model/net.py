"""A network of the test's own (tests/test_own_model_pipeline.py), not a torchvision class: its blocks
come from blocks.py beside it, a local import the train job must count as its source."""

import time

import torch
from blocks import ConvBlock


class Tiny(torch.nn.Module):
    def __init__(self, num_classes: int, width: int, step_delay_s: float):
        super().__init__()
        self.body = torch.nn.Sequential(ConvBlock(3, width), ConvBlock(width, 2 * width))
        self.head = torch.nn.Linear(2 * width, num_classes)
        self.step_delay_s = step_delay_s

    def forward(self, x):
        if self.training and self.step_delay_s:
            time.sleep(self.step_delay_s)  # steps long enough to stop the job mid-epoch
        return self.head(self.body(x).mean((2, 3)))


def tiny(num_classes, width=8, step_delay_s=0.0):
    return Tiny(num_classes, width, step_delay_s)
