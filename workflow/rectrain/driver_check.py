"""Stop a GPU machine from silently training on CPU processes.

With `train.devices: auto` a driver older than the one the installed torch build needs makes
`torch.cuda.is_available()` false, and the plan falls back to CPU ranks at a hundredth of the speed.
This module compares what the driver shows (NVML, else /dev/nvidia<N> and /proc/driver/nvidia/version)
with what torch can use, and stops before any work with both versions and the fix.

Two callers, one check:
  - the pipeline's first stage (`python -m rectrain.driver_check` in the index rule), before hours of
    indexing and packing.  It must stay cheap and torch-free: the torch build's CUDA version is read
    from torch/version.py without importing torch (the package metadata's version lacks the `+cu130`
    tag), and a mismatch is predicted from the CUDA major versions (a CUDA 13 build cannot run on a
    driver that supports CUDA 12 at most; within one major, CUDA's minor-version compatibility holds);
  - the training launcher (and the trainer started without one), which asks torch itself.
`train.devices: cpu`, GPUs hidden on purpose (CUDA_VISIBLE_DEVICES empty or -1) and machines without
GPUs are never checked: they run CPU processes as before.
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib.util
import json
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The Snakefile exports train.devices to every job here (a rule param would rerun the index, and the
# pack after it, whenever train.devices changed).
DEVICES_ENV = "RECTRAIN_TRAIN_DEVICES"
# Oldest Linux driver for each CUDA major version (NVIDIA's CUDA compatibility table).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
DEV_GLOB = "/dev/nvidia[0-9]*"
PROC_VERSION = "/proc/driver/nvidia/version"


class DriverMismatch(RuntimeError):
    """GPUs are present but the installed torch build cannot use them."""


@dataclass(frozen=True)
class Gpus:
    count: int  # GPUs the driver shows
    driver: str | None  # "535.104.05"
    driver_cuda: str | None  # newest CUDA the driver supports: "12.2", or "12.x" when only the driver is known
    source: str  # where they were seen


@dataclass(frozen=True)
class TorchBuild:
    version: str | None  # None: torch is not installed
    cuda: str | None  # None: a CPU-only build


def _major(cuda: str | None) -> int | None:
    return int(cuda.split(".")[0]) if cuda and cuda.split(".")[0].isdigit() else None


def _cuda_for_driver(driver: str | None) -> str | None:
    """The newest CUDA major a driver version supports, from MIN_DRIVER ('12.x')."""
    key = tuple(int(p) for p in re.findall(r"\d+", driver or ""))
    fits = [m for m, least in MIN_DRIVER.items() if key and key >= tuple(int(p) for p in least.split("."))]
    return f"{max(fits)}.x" if fits else None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _from_nvml(nv) -> Gpus | None:
    try:
        nv.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver library, no GPU: look at the device files instead
        return None
    try:
        count = nv.nvmlDeviceGetCount()
        driver = _text(nv.nvmlSystemGetDriverVersion())
        try:
            code = int(nv.nvmlSystemGetCudaDriverVersion())  # 12020 for CUDA 12.2
            driver_cuda = f"{code // 1000}.{code % 1000 // 10}"
        except Exception:  # noqa: BLE001 - an old NVML: the driver version still says the CUDA major
            driver_cuda = _cuda_for_driver(driver)
        return Gpus(count, driver, driver_cuda, "NVML")
    except Exception as err:  # noqa: BLE001 - a half-working NVML: fall back to the device files
        log.debug("NVML cannot list the GPUs: %r", err)
        return None
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def find_gpus(nvml=None, dev_glob: str = DEV_GLOB, proc_version: str = PROC_VERSION) -> Gpus:
    """The GPUs the NVIDIA driver shows, with its version; count 0 when there are none."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            nvml = None
    found = _from_nvml(nvml) if nvml is not None else None
    if found is not None:
        return found
    nodes = sorted(p for p in glob.glob(dev_glob) if re.fullmatch(r"nvidia\d+", Path(p).name))
    try:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", Path(proc_version).read_text())
    except OSError:
        m = None
    driver = m.group(1) if m else None
    return Gpus(len(nodes), driver, _cuda_for_driver(driver), dev_glob)


def torch_build() -> TorchBuild:
    """The installed torch's version and CUDA version; imports torch only if it is already imported."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return TorchBuild(torch.__version__, torch.version.cuda)
    spec = importlib.util.find_spec("torch")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        return TorchBuild(None, None)
    values = {}
    try:
        tree = ast.parse(Path(spec.submodule_search_locations[0], "version.py").read_text())
    except (OSError, SyntaxError):
        return TorchBuild("unknown", None)
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            values[target.id] = node.value.value
    return TorchBuild(values.get("__version__", "unknown"), values.get("cuda"))


def gpus_hidden(env) -> bool:
    """CUDA_VISIBLE_DEVICES set to hide every GPU ('' or starting with a negative id), as CUDA reads it."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return False
    first = visible.split(",")[0].strip()
    return first == "" or (first.startswith("-") and first[1:].isdigit())


def _fix(gpus: Gpus, build: TorchBuild) -> str:
    """What to install: a torch build the driver can run, or a driver the build can run on."""
    have, want = _major(gpus.driver_cuda), _major(build.cuda)
    torch_fix = f"install torch {build.version.split('+')[0]} built for "
    if have:
        torch_fix += f"CUDA {have}.x or older (a '+cu{have}x' wheel)"
    else:
        torch_fix += "the CUDA version this driver supports (nvidia-smi names it)"
    if want in MIN_DRIVER:
        return f"{torch_fix}, or upgrade the NVIDIA driver to {MIN_DRIVER[want]} or newer"
    return torch_fix


def describe(gpus: Gpus, build: TorchBuild, detail: str = "") -> str:
    """The error: what the driver shows, what torch is built for, why they do not fit and the fix."""
    driver = f"NVIDIA driver {gpus.driver or '(version unknown)'}"
    if gpus.driver_cuda:
        driver += f" (supports CUDA up to {gpus.driver_cuda})"
    built = f"torch {build.version} is built for CUDA {build.cuda}" if build.cuda else None
    built = built or f"torch {build.version} is a CPU-only build"
    why = f" ({detail})" if detail else ""
    return (
        f"{gpus.count} GPU(s) seen through {gpus.source} with {driver}, but {built}, so training would quietly "
        f"run as CPU processes{why}. Fix: {_fix(gpus, build)}; or set train.devices: cpu to train on CPU "
        "on purpose."
    )


def check(devices, cuda_available: bool | None = None, *, env=None, gpus: Gpus | None = None, build=None) -> None:
    """Raise DriverMismatch when the driver shows GPUs torch cannot use.  cuda_available: torch's own
    answer (the launcher); None predicts it from the versions without importing torch (first stage)."""
    env = os.environ if env is None else env
    if devices == "cpu" or gpus_hidden(env):
        return
    gpus = find_gpus() if gpus is None else gpus
    if gpus.count == 0 or cuda_available:
        return
    build = torch_build() if build is None else build
    if build.version is None:
        return  # no torch here: the stage that needs it says so
    if build.cuda is None:
        raise DriverMismatch(describe(gpus, build))
    have, want = _major(gpus.driver_cuda), _major(build.cuda)
    too_old = have is not None and want is not None and have < want
    if cuda_available is None and not too_old:
        return  # the versions fit; the launcher asks torch itself
    if too_old:
        raise DriverMismatch(describe(gpus, build, f"CUDA {build.cuda} needs driver {MIN_DRIVER.get(want, 'newer')}"))
    raise DriverMismatch(describe(gpus, build, _torch_says(env)))


def stop_on_mismatch(devices, cuda_available: bool | None, tag: str) -> None:
    """check(), as the error a stage exits with: '[tag] error: <why and the fix>'."""
    try:
        check(devices, cuda_available)
    except DriverMismatch as err:
        raise SystemExit(f"[{tag}] error: {err}") from None


def _torch_says(env) -> str:
    """torch's own reason, from the warning is_available() gives; plus CUDA_VISIBLE_DEVICES when set."""
    torch = sys.modules.get("torch")
    said = ""
    if torch is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.is_available()
        said = "; ".join(str(w.message).strip() for w in caught)
    said = said or "the versions fit, so the CUDA runtime refused the GPUs for another reason"
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        said += f"; CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
    return said


def devices_from_env(env=None):
    """train.devices as the Snakefile exported it; None when not run under the Snakefile."""
    text = (os.environ if env is None else env).get(DEVICES_ENV)
    return json.loads(text) if text else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Stop early when the NVIDIA driver shows GPUs torch cannot use.")
    ap.add_argument("--devices", type=json.loads, help=f"train.devices as JSON (default: ${DEVICES_ENV}, else auto)")
    args = ap.parse_args(argv)
    from rectrain.log import setup as setup_logging

    setup_logging("driver_check")
    devices = args.devices if args.devices is not None else devices_from_env() or "auto"
    stop_on_mismatch(devices, None, "driver_check")


if __name__ == "__main__":
    main()
