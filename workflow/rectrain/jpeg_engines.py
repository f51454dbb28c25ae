"""Which GPUs have hardware JPEG decoders (nvJPEG's hardware back end, which DALI's mixed decoder
uses for dali_hw_decoder_load of the images and for which dali_preallocate reserves its buffers):
data-centre Ampere, Hopper and Blackwell parts.  Others (e.g. the RTX 2080 Ti) decode on the SMs
the model needs.  Torch-free: the report reads it too."""

from __future__ import annotations

import re

HW_JPEG_GPU = r"\b(A100|A800|A30|H100|H800|H200|H20|GH200|B100|B200|GB200)\b"


def has_hw_jpeg(gpu_name: str) -> bool:
    return re.search(HW_JPEG_GPU, gpu_name) is not None
