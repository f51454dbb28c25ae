"""Training telemetry for the report: per-rank step times, per-epoch metrics, a system sampler.

Files (columns are a contract with the report, see docs/architecture.md), written live under <out>/telemetry/:
  steps_rank<r>.csv  written by rank r while training; rank 0 merges them into <out>/steps.csv at the end
  epochs.csv         rank 0, one row per epoch
  system_node<k>.csv local rank 0 of node k, one row per sample interval (GPU columns only with NVML)
  run.json           rank 0, as each launch starts: the live copy of the published run.json, which
                     Snakemake removes with a failed or stopped job's outputs (the live report reads it)
The finished run copies them next to model.pt (the rule's outputs; node 0's sampler -> system.csv).  The live copies sit outside the
rule's outputs because Snakemake deletes outputs before a rerun, and a resumed run must keep the rows
of the epochs it does not redo; rows from the interrupted epoch onwards are dropped on resume so
every (rank, epoch, step) is unique.  A log is never opened through a link planted at its fixed name
(open_log): a kept one is opened without following links and only when it is this user's regular
file; a new one is created under a fresh name and renamed into place.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

import psutil

from rectrain import atomic

log = logging.getLogger(__name__)

STEP_COLUMNS = ["rank", "epoch", "step", "time", "wall_s", "data_wait_s", "compute_s", "images", "loss", "lr"]
# resolution: the epoch's training crop in px (train.progressive; image_size without a schedule).
# val_single_view_*: each epoch's validation, one centre crop at train.val_resolution without flip TTA -
# not the evaluate stage's protocol (evaluate.resolutions, evaluate.flip_tta: the image and its mirror),
# so it can read a few tenths below metrics.json for the same weights; the name says which it is.
# ema_val_single_view_*: the same validation of the weights' EMA (train.ema), empty without one.
EMA_VAL_COLUMNS = ["ema_val_single_view_loss", "ema_val_single_view_top1", "ema_val_single_view_top5"]
EPOCH_COLUMNS = [
    "epoch",
    "train_loss",
    "train_acc",
    "val_single_view_loss",
    "val_single_view_top1",
    "val_single_view_top5",
    "images_per_s",
    "wall_s",
    "resolution",
    *EMA_VAL_COLUMNS,
]
# cpu_percent: the machine's busy CPU (every process's, iowait left out); job_cpu_percent: this node's
# job's own processes (its ranks, their loader workers), on the same scale (100 = every CPU of the
# machine): the difference is what other processes used (rectrain.report.diagnosis names it).
SYSTEM_BASE_COLUMNS = ["time", "cpu_percent", "iowait_percent", "disk_read_mb_s", "rss_mb", "job_cpu_percent"]
# The live copy of run.json (see the module doc).
LIVE_RUN_JSON = "run.json"


class CsvLog:
    """Append-only CSV with a fixed header; on resume keeps only rows with epoch < keep_before_epoch
    (and, with a step column, the rows of that epoch's steps < keep_before_step: a mid-epoch resume).

    A resume cuts the file after its last kept row instead of rewriting it: rows are appended in epoch
    order, so the kept rows are a prefix, found by reading the epoch field of each line (a full run's
    steps_rank<r>.csv holds 450,450 rows).  A torn last line (the process killed mid-write) ends the
    prefix too.  Every value is a number, so no field is quoted and a line is split on commas."""

    def __init__(
        self,
        path: str | os.PathLike,
        columns: list[str],
        keep_before_epoch: int | None = None,
        keep_before_step: int = 0,
    ):
        self.path, self.columns = Path(path), columns
        keep = None if keep_before_epoch is None else (keep_before_epoch, keep_before_step)
        cut = None if keep is None else (lambda f: _cut_after(f, self.path, columns, keep))
        self._f, fresh = open_log(self.path, cut)
        self._w = csv.DictWriter(self._f, fieldnames=columns)
        if fresh:
            self._w.writeheader()

    def write(self, **row) -> None:
        self._w.writerow({k: _fmt(v) for k, v in row.items()})

    def sync(self) -> None:
        """The rows written so far on disk (a mid-epoch checkpoint's rows outlive a power cut with it)."""
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _position(fields: list[bytes], col: int, step_col: int | None) -> tuple[int, int] | None:
    """A row's (epoch, step) - step 0 without a step column - or None when it is damaged."""
    if not fields[col].isdigit() or (step_col is not None and not fields[step_col].isdigit()):
        return None
    return int(fields[col]), int(fields[step_col]) if step_col is not None else 0


def _open_kept(path: Path) -> BinaryIO | None:
    """`path` open for update when it is a regular file of this user's, not a link (None otherwise:
    missing, a link planted at the name, another user's file, a FIFO - never opened through)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        return None
    return os.fdopen(fd, "rb+")


def open_log(path: Path, keep: Callable[[BinaryIO], bool] | None) -> tuple[TextIO, bool]:
    """(the log at `path` open for appending lines, whether it is new): the existing file when `keep`
    (given it open for update: it may cut it) says its rows stay (_open_kept: this user's regular file,
    no link followed); else a new file, created exclusively under a fresh name and renamed over `path`,
    so whatever had the name (a link to another file) is replaced, never written through."""
    if keep is not None and (f := _open_kept(path)) is not None:
        if keep(f):
            f.seek(0, os.SEEK_END)
            return io.TextIOWrapper(f, encoding="utf-8", newline="", line_buffering=True), False
        f.close()
    tmp, fd = atomic.create_temporary(path)
    os.replace(tmp, path)
    return os.fdopen(fd, "w", encoding="utf-8", newline="", buffering=1), True


def _cut_after(f: BinaryIO, path: Path, columns: list[str], keep_before: tuple[int, int]) -> bool:
    """Truncate the log `f` (at `path`) after its rows before (epoch, step) `keep_before`; False (nothing
    kept) when it was written with other columns."""
    col = columns.index("epoch")
    step_col = columns.index("step") if "step" in columns else None
    header = f.readline()
    if header.decode("utf-8", "replace").rstrip("\r\n").split(",") != columns:
        log.warning("%s has other columns than %s: its rows are not kept", path, ",".join(columns))
        return False
    end = f.tell()
    for line in f:
        fields = line.split(b",")
        at = _position(fields, col, step_col) if line.endswith(b"\n") and len(fields) == len(columns) else None
        if at is None:
            break  # torn or damaged: this row and any after it are not kept
        if at >= keep_before:
            break
        end += len(line)
    f.truncate(end)
    return True


def _fmt(v):
    # 6 significant digits for measurements; timestamps keep milliseconds.
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) >= 1e6 else f"{v:.6g}"
    return v


def step_log(out_dir: Path, rank: int, start_epoch: int, start_step: int = 0) -> CsvLog:
    return CsvLog(out_dir / f"steps_rank{rank}.csv", STEP_COLUMNS, start_epoch, start_step)


def trim_departed(out_dir: Path, world_size: int, start_epoch: int, start_step: int = 0) -> None:
    """Cut the step logs of ranks a resume on fewer processes no longer has (steps_rank<r>.csv, r >=
    world_size) at where it resumes, as their own ranks would: a restarted epoch's rows are written anew."""
    for path in out_dir.glob("steps_rank*.csv"):
        rank = path.stem.removeprefix("steps_rank")
        if rank.isdigit() and int(rank) >= world_size and (f := _open_kept(path)) is not None:
            with f:
                _cut_after(f, path, STEP_COLUMNS, (start_epoch, start_step))


def epoch_log(out_dir: Path, start_epoch: int) -> CsvLog:
    return CsvLog(out_dir / "epochs.csv", EPOCH_COLUMNS, keep_before_epoch=start_epoch)


def merge_steps(src_dir: Path, dest: Path, world_size: int) -> Path:
    """Concatenate src_dir/steps_rank*.csv (rank order, ranks 0 to world_size - 1: the most the run had)
    into dest, atomically: bytes copied after each file's header (every rank writes the same
    STEP_COLUMNS), so 900,900 rows take a moment, not a parse."""
    header = (",".join(STEP_COLUMNS) + "\r\n").encode()  # csv's default line ending, as CsvLog writes it
    with atomic.replacing(dest) as out:
        out.write(header)
        for r in range(world_size):
            with open(src_dir / f"steps_rank{r}.csv", "rb") as f:
                first = f.readline()
                if first.rstrip(b"\r\n") != header.rstrip(b"\r\n"):
                    raise ValueError(f"{f.name} does not start with the step columns {STEP_COLUMNS}: {first[:200]!r}")
                shutil.copyfileobj(f, out, 1 << 20)
    return dest


GPU_FIELDS = ("util", "mem_used_mb", "mem_total_mb")  # system.csv: gpu<i>_<field>, i = the job's CUDA index


def _uuid_key(uuid) -> str:
    """NVML says 'GPU-<uuid>' / 'MIG-<uuid>', torch's device properties the bare uuid: compare without prefix."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


def _nvml_devices(nv) -> list[tuple[str, object, bool]]:
    """(uuid as NVML says it, handle, is_mig) for every GPU in NVML order, each followed by its MIG devices."""
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        uuid = nv.nvmlDeviceGetUUID(h)
        out.append((uuid.decode() if isinstance(uuid, bytes) else uuid, h, False))
        try:
            slots = nv.nvmlDeviceGetMaxMigDeviceCount(h)
        except Exception:  # noqa: BLE001 - no MIG support on this GPU or driver
            slots = 0
        for j in range(slots):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                mig_uuid = nv.nvmlDeviceGetUUID(mig)
            except Exception:  # noqa: BLE001 - an empty MIG slot
                continue
            out.append((mig_uuid.decode() if isinstance(mig_uuid, bytes) else mig_uuid, mig, True))
    return out


def _torch_uuids() -> list[str] | None:
    """UUIDs of the GPUs this process's torch uses, in CUDA order; None unless CUDA is already initialised
    here (the launcher and the Snakefile parse must not create a CUDA context just to count GPUs)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _match_visible(entry: str, devices: list[tuple[str, object, bool]]):
    """The NVML handle a CUDA_VISIBLE_DEVICES entry names, or None (CUDA ignores the rest of the list then)."""
    if entry.lstrip("-").isdigit():
        # An ordinal.  Without torch's UUIDs the only order at hand is NVML's (PCI bus order), which is
        # CUDA's only under CUDA_DEVICE_ORDER=PCI_BUS_ID; the count is right either way.
        n, gpus = int(entry), [h for _, h, mig in devices if not mig]
        return gpus[n] if 0 <= n < len(gpus) else None
    # A UUID, possibly abbreviated to a unique prefix, of a GPU (GPU-...) or a MIG device (MIG-...).
    hits = [h for uuid, h, _ in devices if uuid.lower().startswith(entry.lower())]
    return hits[0] if len(hits) == 1 and entry[:4].lower() in ("gpu-", "mig-") else None


def visible_handles(nv, torch_uuids: list[str] | None, env) -> list:
    """NVML handles of the job's GPUs in CUDA order (None where a GPU has no NVML counterpart).  Matched by
    UUID when torch already uses CUDA here, else read from CUDA_VISIBLE_DEVICES as CUDA reads it."""
    devices = _nvml_devices(nv)
    if torch_uuids is not None:
        by_uuid = {_uuid_key(uuid): h for uuid, h, _ in devices}
        return [by_uuid.get(_uuid_key(u)) for u in torch_uuids]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [h for _, h, mig in devices if not mig]
    handles = []
    for entry in visible.split(","):
        h = _match_visible(entry.strip(), devices)
        if h is None:
            break
        handles.append(h)
    return handles


class _Nvml:
    """GPU utilisation/memory of the job's GPUs via nvidia-ml-py; `handles` is empty without NVML.  Each
    field is read on its own: one the device does not support (a MIG instance's utilisation) stays empty."""

    def __init__(self, env=None):
        self.handles, self.nv, self._failed = [], None, set()
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no driver / no GPU: GPU columns are simply absent
            return
        self.nv = pynvml
        try:
            self.handles = visible_handles(pynvml, _torch_uuids(), os.environ if env is None else env)
        except Exception as err:  # noqa: BLE001 - telemetry must never stop training
            log.warning("NVML cannot list the GPUs (%r): system.csv gets no GPU columns", err)

    def columns(self) -> list[str]:
        return [f"gpu{i}_{k}" for i in range(len(self.handles)) for k in GPU_FIELDS]

    def field(self, i: int, name: str, read):
        """read(handle), or '' when it fails; each failing field is logged once."""
        h = self.handles[i]
        try:
            if h is None:
                raise LookupError("no NVML device with this GPU's UUID")
            return read(h)
        except Exception as err:  # noqa: BLE001 - e.g. NVMLError_NotSupported on a MIG device
            if (i, name) not in self._failed:
                self._failed.add((i, name))
                log.warning("NVML: GPU %s %s cannot be read (%r); its column stays empty", i, name, err)
            return ""

    def sample(self) -> dict:
        nv, row = self.nv, {}
        for i in range(len(self.handles)):
            row[f"gpu{i}_util"] = self.field(i, "util", lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu)
            row[f"gpu{i}_mem_used_mb"] = self.field(
                i, "mem_used_mb", lambda h: round(nv.nvmlDeviceGetMemoryInfo(h).used / 2**20, 1)
            )
            row[f"gpu{i}_mem_total_mb"] = self.field(
                i, "mem_total_mb", lambda h: round(nv.nvmlDeviceGetMemoryInfo(h).total / 2**20, 1)
            )
        return row


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def gpu_inventory() -> list[dict]:
    """[{index, name, memory_total_mb, driver}] of the job's GPUs (index = CUDA index), [] without NVML
    (for run.json).  A field NVML cannot read is None."""
    nv = _Nvml()
    if not nv.handles:
        return []
    try:
        driver = _text(nv.nv.nvmlSystemGetDriverVersion())
    except Exception as err:  # noqa: BLE001 - run.json says so rather than failing the run
        log.warning("NVML: the driver version cannot be read (%r)", err)
        driver = None

    def read(i: int, name: str, fn):
        value = nv.field(i, name, fn)
        return None if value == "" else value

    return [
        {
            "index": i,
            "name": read(i, "name", lambda h: _text(nv.nv.nvmlDeviceGetName(h))),
            "memory_total_mb": read(
                i, "memory_total_mb", lambda h: round(nv.nv.nvmlDeviceGetMemoryInfo(h).total / 2**20, 1)
            ),
            "driver": driver,
        }
        for i in range(len(nv.handles))
    ]


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
        if append and path.is_file() and not path.is_symlink():
            _with_columns(path, self.columns)  # a column added since the run began: its old rows get it empty
        self._f, fresh = open_log(path, (lambda f: True) if append else None)
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

    def _job_usage(self) -> tuple[float, dict[int, float]]:
        """(the job's resident memory in MB, each of its processes' CPU seconds so far by pid: its own
        and its waited-for children's, so a loader worker that ended still counts in its rank)."""
        rss, cpu = 0, {}
        for root in self.processes:
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    t = p.cpu_times()
                    cpu[p.pid] = t.user + t.system + t.children_user + t.children_system
                except psutil.Error:
                    pass
        return rss / 2**20, cpu

    def run(self) -> None:
        psutil.cpu_times_percent(interval=None)  # prime: the first call has no reference interval
        last_t, last_b = time.time(), self._read_bytes()
        last_cpu = self._job_usage()[1]
        cores = psutil.cpu_count() or 1
        while not self._halt.wait(self.interval):
            now, b = time.time(), self._read_bytes()
            cpu = psutil.cpu_times_percent(interval=None)
            iowait = getattr(cpu, "iowait", 0.0)
            disk = "" if b is None or last_b is None else round((b - last_b) / 2**20 / max(now - last_t, 1e-9), 3)
            rss, job_cpu = self._job_usage()
            # a process that started since the last sample: all its CPU time is new
            used = sum(max(0.0, t - last_cpu.get(pid, 0.0)) for pid, t in job_cpu.items())
            row = {
                "time": round(now, 3),
                "cpu_percent": round(100.0 - cpu.idle - iowait, 1),
                "iowait_percent": round(iowait, 1),
                "disk_read_mb_s": disk,
                "rss_mb": round(rss, 1),
                "job_cpu_percent": round(min(100.0, 100.0 * used / (max(now - last_t, 1e-9) * cores)), 1),
            }
            row.update(self.nvml.sample())
            self._w.writerow(row)
            last_t, last_b, last_cpu = now, b, job_cpu

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5 * self.interval + 5)
        self._f.close()


def _with_columns(path: Path, columns: list[str]) -> None:
    """A system CSV to append to, its header made `columns` when an older run wrote another (a column
    added since: its old rows get it empty), so every row lines up with the header."""
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    if header == columns:
        return
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))

    def write(binary) -> None:  # the temporary's own descriptor (rectrain.atomic)
        out = io.TextIOWrapper(binary, encoding="utf-8", newline="")
        w = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        out.flush()
        out.detach()  # the binary file stays atomic's to fsync and close

    atomic.write_with(path, write)


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
