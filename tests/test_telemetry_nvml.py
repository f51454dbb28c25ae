"""NVML telemetry against a fake pynvml: GPUs matched to torch's devices by UUID (NVML order differs from
CUDA's), CUDA_VISIBLE_DEVICES read as CUDA reads it (ordinals, abbreviated GPU-/MIG- UUIDs, -1), and a
field the device does not support left empty while the sampler keeps writing its CPU rows.  Every
expected value is written out here, not read back from the code under test."""

import csv
import logging
import sys
import time
import types

import psutil
import pynvml
import pytest
import torch

from rectrain.train import telemetry

A100 = "GPU-aaaaaaaa-1111-1111-1111-111111111111"
H200 = "GPU-bbbbbbbb-2222-2222-2222-222222222222"
MIG = "MIG-cccccccc-3333-3333-3333-333333333333"
MIB = 2**20


def not_supported():
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # pynvml returns its NotSupported subclass


class FakeNvml(types.ModuleType):
    """NVML order: the A100 (MIG enabled, one MIG instance) first, the H200 second."""

    NVMLError = pynvml.NVMLError

    def __init__(self, broken=()):
        super().__init__("pynvml")
        self.broken = set(broken)  # (handle, what) pairs that raise NVMLError_NotSupported
        self.devices = {
            "a100": {"uuid": A100, "name": "NVIDIA A100-SXM4-40GB", "used": 1024, "total": 40960, "util": 11},
            "h200": {"uuid": H200, "name": "NVIDIA H200", "used": 2048, "total": 143771, "util": 77},
            "mig": {"uuid": MIG, "name": "NVIDIA A100 MIG 1g.10gb", "used": 512, "total": 9984, "util": None},
        }

    def _get(self, h, what):
        if (h, what) in self.broken or (what == "util" and self.devices[h]["util"] is None):
            raise not_supported()
        return self.devices[h][what]

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return ["a100", "h200"][i]

    def nvmlDeviceGetUUID(self, h):
        return self._get(h, "uuid")

    def nvmlDeviceGetName(self, h):
        return self._get(h, "name").encode()  # older nvidia-ml-py returns bytes

    def nvmlSystemGetDriverVersion(self):
        return "580.65.06"

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        if h == "h200":
            raise not_supported()
        return 2  # two slots, the second empty

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, j):
        if j == 0:
            return "mig"
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=self._get(h, "used") * MIB, total=self._get(h, "total") * MIB)

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=self._get(h, "util"), memory=0)


@pytest.fixture
def fake_nvml(monkeypatch):
    # A stage's log set-up (rectrain.log.setup, run in-process by other tests) stops propagation to the
    # root logger, where caplog listens.
    monkeypatch.setattr(logging.getLogger("rectrain"), "propagate", True)
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return fake


@pytest.fixture
def torch_sees_h200_then_a100(monkeypatch):
    """torch's CUDA order is the reverse of NVML's; its device properties give bare UUIDs."""
    uuids = ["bbbbbbbb-2222-2222-2222-222222222222", "aaaaaaaa-1111-1111-1111-111111111111"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))


def test_gpu_columns_follow_torch_device_order_by_uuid_not_nvml_order(fake_nvml, torch_sees_h200_then_a100):
    assert telemetry._Nvml().sample() == {
        "gpu0_util": 77,
        "gpu0_mem_used_mb": 2048.0,
        "gpu0_mem_total_mb": 143771.0,
        "gpu1_util": 11,
        "gpu1_mem_used_mb": 1024.0,
        "gpu1_mem_total_mb": 40960.0,
    }
    assert telemetry.gpu_inventory() == [
        {"index": 0, "name": "NVIDIA H200", "memory_total_mb": 143771.0, "driver": "580.65.06"},
        {"index": 1, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mb": 40960.0, "driver": "580.65.06"},
    ]


def test_torch_device_without_nvml_counterpart_keeps_its_columns_empty(fake_nvml, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="dddd-unknown"))
    assert telemetry._Nvml().sample() == {"gpu0_util": "", "gpu0_mem_used_mb": "", "gpu0_mem_total_mb": ""}


@pytest.mark.parametrize(
    "visible,handles",
    [
        (None, ["a100", "h200"]),  # unset: every GPU (MIG instances are not separate GPUs then)
        ("", []),
        ("-1", []),  # the usual way to hide every GPU: must not crash
        ("1", ["h200"]),
        ("1,0", ["h200", "a100"]),
        ("0,-1,1", ["a100"]),  # CUDA stops at the first invalid entry
        ("7", []),
        (H200, ["h200"]),
        ("GPU-bbbb,GPU-aaaaaaaa-11", ["h200", "a100"]),  # unique prefixes, as CUDA accepts them
        ("GPU-", []),  # ambiguous prefix
        ("MIG-cccccccc", ["mig"]),
        (MIG, ["mig"]),
        ("bbbbbbbb-2222", []),  # CUDA needs the GPU-/MIG- prefix
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(fake_nvml, visible, handles):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert telemetry.visible_handles(fake_nvml, None, env) == handles


def test_unsupported_field_stays_empty_and_the_sampler_keeps_writing(fake_nvml, monkeypatch, tmp_path, caplog):
    """A MIG instance answers NotSupported for utilisation; before, that exception ended the sampler
    thread and with it every CPU row."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-cccc")
    s = telemetry.SystemSampler(tmp_path / "system.csv", 0.05, None, [psutil.Process()])
    s.start()
    time.sleep(0.4)
    assert s.is_alive()
    s.stop()
    with open(tmp_path / "system.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "time",
        "cpu_percent",
        "iowait_percent",
        "disk_read_mb_s",
        "rss_mb",
        "job_cpu_percent",
        "gpu0_util",
        "gpu0_mem_used_mb",
        "gpu0_mem_total_mb",
    ]
    assert len(rows) >= 3
    for r in rows:
        assert (r["gpu0_util"], r["gpu0_mem_used_mb"], r["gpu0_mem_total_mb"]) == ("", "512.0", "9984.0")
        assert float(r["cpu_percent"]) >= 0 and float(r["rss_mb"]) > 10
    warnings = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(warnings) == 1, "a failing field is reported once, not on every sample"
    assert "GPU 0 util" in warnings[0] and "NotSupported" in warnings[0]


@pytest.mark.parametrize("visible", ["-1", ""])
def test_hidden_gpus_give_no_gpu_columns_and_no_crash(fake_nvml, monkeypatch, tmp_path, visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    s = telemetry.SystemSampler(tmp_path / "system.csv", 0.05, None, [psutil.Process()])
    assert s.columns == ["time", "cpu_percent", "iowait_percent", "disk_read_mb_s", "rss_mb", "job_cpu_percent"]
    s.start()
    s.stop()
    assert telemetry.gpu_inventory() == []


def test_nvml_that_cannot_list_devices_gives_no_gpu_columns(fake_nvml, monkeypatch, caplog):
    def broken_count():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetCount", broken_count)
    assert telemetry._Nvml().columns() == []
    assert any("cannot list the GPUs" in r.getMessage() for r in caplog.records)


def test_without_nvml_the_sampler_writes_cpu_columns_only(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    s = telemetry.SystemSampler(tmp_path / "system.csv", 0.05, None, [psutil.Process()])
    s.start()
    time.sleep(0.3)
    s.stop()
    with open(tmp_path / "system.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == [
        "time",
        "cpu_percent",
        "iowait_percent",
        "disk_read_mb_s",
        "rss_mb",
        "job_cpu_percent",
    ]
    assert rows[0]["disk_read_mb_s"] == "" and float(rows[0]["rss_mb"]) > 10
    assert telemetry.gpu_inventory() == []


def test_inventory_reports_an_unreadable_field_as_none(fake_nvml, torch_sees_h200_then_a100):
    fake_nvml.broken.update({("h200", "name"), ("a100", "total")})
    assert telemetry.gpu_inventory() == [
        {"index": 0, "name": None, "memory_total_mb": 143771.0, "driver": "580.65.06"},
        {"index": 1, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mb": None, "driver": "580.65.06"},
    ]
