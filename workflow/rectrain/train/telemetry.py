"""Training telemetry for the report: per-rank step times, per-epoch metrics, a system sampler.

Files (columns are a contract with the report, see CONTRACTS), written live under <out>/telemetry/:
  steps_rank<r>.csv  written by rank r while training; rank 0 merges them into <out>/steps.csv at the end
  epochs.csv         rank 0, one row per epoch
  system_node<k>.csv local rank 0 of node k, one row per sample interval (GPU columns only with NVML)
The finished run copies them next to model.pt (the rule's outputs; node 0's sampler -> system.csv).  The live copies sit outside the
rule's outputs because Snakemake deletes outputs before a rerun, and a resumed run must keep the rows
of the epochs it does not redo; rows from the interrupted epoch onwards are dropped on resume so
every (rank, epoch, step) is unique.
"""

from __future__ import annotations

import csv
import os
import threading
import time
from pathlib import Path

import psutil

STEP_COLUMNS = ["rank", "epoch", "step", "time", "wall_s", "data_wait_s", "compute_s", "images", "loss", "lr"]
EPOCH_COLUMNS = ["epoch", "train_loss", "train_acc", "val_loss", "val_top1", "val_top5", "images_per_s", "wall_s"]
SYSTEM_BASE_COLUMNS = ["time", "cpu_percent", "iowait_percent", "disk_read_mb_s", "rss_mb"]


class CsvLog:
    """Append-only CSV with a fixed header; on resume keeps only rows with epoch < keep_before_epoch."""

    def __init__(self, path: str | os.PathLike, columns: list[str], keep_before_epoch: int | None = None):
        self.path, self.columns = Path(path), columns
        kept = []
        if keep_before_epoch is not None and self.path.exists():
            with open(self.path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if "epoch" in r and int(r["epoch"]) < keep_before_epoch]
        self._f = open(self.path, "w", newline="", buffering=1)
        self._w = csv.DictWriter(self._f, fieldnames=columns)
        self._w.writeheader()
        self._w.writerows(kept)

    def write(self, **row) -> None:
        self._w.writerow({k: _fmt(v) for k, v in row.items()})

    def close(self) -> None:
        self._f.close()


def _fmt(v):
    # 6 significant digits for measurements; timestamps keep milliseconds.
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) >= 1e6 else f"{v:.6g}"
    return v


def step_log(out_dir: Path, rank: int, start_epoch: int) -> CsvLog:
    return CsvLog(out_dir / f"steps_rank{rank}.csv", STEP_COLUMNS, keep_before_epoch=start_epoch)


def epoch_log(out_dir: Path, start_epoch: int) -> CsvLog:
    return CsvLog(out_dir / "epochs.csv", EPOCH_COLUMNS, keep_before_epoch=start_epoch)


def merge_steps(src_dir: Path, dest: Path, world_size: int) -> Path:
    """Concatenate src_dir/steps_rank*.csv (rank order) into dest, atomically."""
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "w", newline="") as out:
        w = csv.DictWriter(out, fieldnames=STEP_COLUMNS)
        w.writeheader()
        for r in range(world_size):
            with open(src_dir / f"steps_rank{r}.csv", newline="") as f:
                w.writerows(csv.DictReader(f))
    os.replace(tmp, dest)
    return dest


class _Nvml:
    """GPU utilisation/memory of the job's visible GPUs via nvidia-ml-py; `handles` is empty without NVML."""

    def __init__(self):
        self.handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no driver / no GPU: GPU columns are simply absent
            return
        self.nv = pynvml
        count = pynvml.nvmlDeviceGetCount()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = list(range(count))
        if visible is not None and visible.strip() != "":
            try:
                ids = [int(v) for v in visible.split(",") if v.strip()]
            except ValueError:  # UUIDs: match them
                uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
                ids = [uuids.index(u.strip()) for u in visible.split(",") if u.strip() in uuids]
        elif visible is not None:
            ids = []
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in ids if i < count]

    def columns(self) -> list[str]:
        return [f"gpu{i}_{k}" for i in range(len(self.handles)) for k in ("util", "mem_used_mb", "mem_total_mb")]

    def sample(self) -> dict:
        row = {}
        for i, h in enumerate(self.handles):
            mem = self.nv.nvmlDeviceGetMemoryInfo(h)
            row[f"gpu{i}_util"] = self.nv.nvmlDeviceGetUtilizationRates(h).gpu
            row[f"gpu{i}_mem_used_mb"] = round(mem.used / 2**20, 1)
            row[f"gpu{i}_mem_total_mb"] = round(mem.total / 2**20, 1)
        return row


def gpu_inventory() -> list[dict]:
    """[{index, name, memory_total_mb, driver}] of the visible GPUs, [] without NVML (for run.json)."""
    nv = _Nvml()
    if not nv.handles:
        return []
    driver = nv.nv.nvmlSystemGetDriverVersion()
    out = []
    for i, h in enumerate(nv.handles):
        name = nv.nv.nvmlDeviceGetName(h)
        out.append(
            {
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_total_mb": round(nv.nv.nvmlDeviceGetMemoryInfo(h).total / 2**20, 1),
                "driver": driver.decode() if isinstance(driver, bytes) else driver,
            }
        )
    return out


class SystemSampler(threading.Thread):
    """Background thread: one system.csv row every `interval` seconds until stop()."""

    def __init__(
        self,
        path: str | os.PathLike,
        interval: float,
        rec_device: str | None,
        processes: list[psutil.Process],
        append: bool = False,
    ):
        super().__init__(name="rectrain-system-sampler", daemon=True)
        self.interval, self.rec_device, self.processes = interval, rec_device, processes
        self.nvml = _Nvml()
        self.columns = SYSTEM_BASE_COLUMNS + self.nvml.columns()
        path = Path(path)
        fresh = not (append and path.exists())
        self._f = open(path, "a" if not fresh else "w", newline="", buffering=1)
        self._w = csv.DictWriter(self._f, fieldnames=self.columns)
        if fresh:
            self._w.writeheader()
        self._halt = threading.Event()

    def _read_bytes(self) -> int | None:
        if not self.rec_device:
            return None
        counters = psutil.disk_io_counters(perdisk=True) or {}
        c = counters.get(self.rec_device)
        return None if c is None else c.read_bytes

    def _rss_mb(self) -> float:
        total = 0
        for root in self.processes:
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        return total / 2**20

    def run(self) -> None:
        psutil.cpu_times_percent(interval=None)  # prime: the first call has no reference interval
        last_t, last_b = time.time(), self._read_bytes()
        while not self._halt.wait(self.interval):
            now, b = time.time(), self._read_bytes()
            cpu = psutil.cpu_times_percent(interval=None)
            iowait = getattr(cpu, "iowait", 0.0)
            disk = "" if b is None or last_b is None else round((b - last_b) / 2**20 / max(now - last_t, 1e-9), 3)
            row = {
                "time": round(now, 3),
                "cpu_percent": round(100.0 - cpu.idle - iowait, 1),
                "iowait_percent": round(iowait, 1),
                "disk_read_mb_s": disk,
                "rss_mb": round(self._rss_mb(), 1),
            }
            row.update(self.nvml.sample())
            self._w.writerow(row)
            last_t, last_b = now, b

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5 * self.interval + 5)
        self._f.close()


def job_processes() -> list[psutil.Process]:
    """Processes whose RSS counts for this node's job: all ranks (children of the torchrun agent) with
    their loader workers, or just this process tree when not launched by torchrun."""
    me = psutil.Process()
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        try:
            return psutil.Process(os.getppid()).children()
        except psutil.Error:
            pass
    return [me]
