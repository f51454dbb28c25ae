"""A GPU machine whose NVIDIA driver is too old for the torch build must stop, not train on CPU processes.

NVML and torch.cuda are faked: a machine with two GPUs on driver 535.104.05 (CUDA up to 12.2) and the
pinned torch built for CUDA 13.0.  The first stage's check runs without importing torch (a fake torch
package that raises on import proves it); the launcher's uses torch's own answer.  Machines without
GPUs, `train.devices: cpu` and GPUs hidden on purpose keep running CPU processes as before."""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers import REPO, snakemake

from rectrain import distributed, driver_check
from rectrain.driver_check import DriverMismatch, Gpus, TorchBuild, check
from rectrain.train import direct

# The data arguments a training command needs (print-only: never opened)
DUMMY_DATA = ["--rec", "t.rec", "--idx", "t.idx", "--classes", "c.tsv", "--out", "o"]

OLD_DRIVER = Gpus(2, "535.104.05", "12.2", "NVML")
NEW_DRIVER = Gpus(2, "580.65.06", "13.0", "NVML")
NO_GPU = Gpus(0, None, None, "/dev/nvidia[0-9]*")
CU130 = TorchBuild("2.14.1+cu130", "13.0")
CPU_ONLY = TorchBuild("2.14.1+cpu", None)
TOO_OLD_WARNING = "CUDA initialization: The NVIDIA driver on your system is too old (found version 12020)."

FAKE_PYNVML = textwrap.dedent(
    """
    class NVMLError(Exception):
        pass

    def nvmlInit():
        pass

    def nvmlShutdown():
        pass

    def nvmlDeviceGetCount():
        return 2

    def nvmlSystemGetDriverVersion():
        return b"535.104.05"

    def nvmlSystemGetCudaDriverVersion():
        return 12020
    """
)


def fake_site(tmp_path, torch_cuda="13.0"):
    """A folder for PYTHONPATH: the fake pynvml above and a torch package that must never be imported."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "pynvml.py").write_text(FAKE_PYNVML)
    (site / "torch" / "__init__.py").write_text("raise ImportError('the first stage imported torch')\n")
    (site / "torch" / "version.py").write_text(
        f"from typing import Optional\n__version__ = '2.14.1+cu130'\ncuda: Optional[str] = {torch_cuda!r}\n"
    )
    return site


def test_old_driver_with_a_cuda13_build_is_an_error_naming_both_versions_and_the_fix():
    with pytest.raises(DriverMismatch) as err:
        check("auto", None, env={}, gpus=OLD_DRIVER, build=CU130)
    msg = str(err.value)
    assert "2 GPU(s) seen through NVML with NVIDIA driver 535.104.05 (supports CUDA up to 12.2)" in msg
    assert "torch 2.14.1+cu130 is built for CUDA 13.0" in msg
    assert "CUDA 13.0 needs driver 580.65.06" in msg
    assert "install torch 2.14.1 built for CUDA 12.x or older (a '+cu12x' wheel)" in msg
    assert "or upgrade the NVIDIA driver to 580.65.06 or newer" in msg
    assert "train.devices: cpu" in msg


def test_listed_gpu_ids_are_checked_like_auto():
    with pytest.raises(DriverMismatch, match="driver 535.104.05"):
        check([0, 1], None, env={}, gpus=OLD_DRIVER, build=CU130)


def test_cpu_only_torch_build_on_a_gpu_machine_is_an_error_asking_for_a_cuda_build():
    with pytest.raises(DriverMismatch) as err:
        check("auto", False, env={}, gpus=NEW_DRIVER, build=CPU_ONLY)
    assert "torch 2.14.1+cpu is a CPU-only build" in str(err.value)
    assert "install torch 2.14.1 built for CUDA 13.x or older (a '+cu13x' wheel)" in str(err.value)


def test_matching_versions_pass_the_first_stage_and_a_usable_gpu_passes_the_launcher():
    assert check("auto", None, env={}, gpus=NEW_DRIVER, build=CU130) is None
    assert check("auto", True, env={}, gpus=OLD_DRIVER, build=CU130) is None


def test_no_gpu_runs_cpu_processes_as_today():
    assert check("auto", False, env={}, gpus=NO_GPU, build=CU130) is None
    plan = distributed.plan_processes("auto", 2, 0)
    assert (plan.kind, plan.nproc) == ("cpu", 2)


def test_devices_cpu_and_hidden_gpus_are_never_probed(monkeypatch):
    def probed():
        raise AssertionError("the driver was probed")

    monkeypatch.setattr(driver_check, "find_gpus", probed)
    check("cpu", False, env={}, build=CU130)
    for hidden in ("", "-1", "-1,0"):
        check("auto", False, env={"CUDA_VISIBLE_DEVICES": hidden}, build=CU130)


@pytest.mark.filterwarnings("ignore:CUDA initialization")  # the launcher's own is_available() call says it too
def test_launcher_stops_with_torchs_own_reason_when_cuda_is_unavailable(monkeypatch, capsys):
    def is_available():
        warnings.warn(TOO_OLD_WARNING, UserWarning, stacklevel=1)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(driver_check, "find_gpus", lambda: Gpus(2, "575.51.03", "12.9", "NVML"))
    monkeypatch.setattr(driver_check, "torch_build", lambda: TorchBuild("2.14.1+cu128", "12.8"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = ["--config-json", json.dumps({"devices": "auto"}), "--print-only", *DUMMY_DATA]
    with pytest.raises(SystemExit) as err:
        direct.main(args)
    msg = str(err.value)
    assert re.match(r"\[train[^]]*\] error: 2 GPU\(s\) seen through NVML with NVIDIA driver 575\.51\.03", msg), msg
    assert "torch 2.14.1+cu128 is built for CUDA 12.8" in msg
    assert TOO_OLD_WARNING in msg
    assert "rectrain._torchrun" not in capsys.readouterr().err  # stopped before planning any process


def test_launcher_on_a_machine_without_gpus_plans_cpu_processes(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(driver_check, "find_gpus", lambda: NO_GPU)
    direct.main(["--config-json", json.dumps({"devices": "auto", "cpu_processes": 2}), "--print-only", *DUMMY_DATA])
    said = capsys.readouterr().err
    assert "no GPU is visible: 2 CPU processes" in said
    assert "--nproc_per_node=2" in said


def test_nvml_gives_count_driver_and_its_cuda_version(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(fake_site(tmp_path)))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    import pynvml as fake

    assert driver_check.find_gpus(fake) == Gpus(2, "535.104.05", "12.2", "NVML")


def test_without_nvml_the_device_files_and_proc_version_are_read(tmp_path):
    class NoNvml:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    found = driver_check.find_gpus(NoNvml(), str(tmp_path / "nvidia[0-9]*"), str(proc))
    assert (found.count, found.driver, found.driver_cuda) == (2, "535.104.05", "12.x")
    with pytest.raises(DriverMismatch, match=r"supports CUDA up to 12\.x"):
        check("auto", None, env={}, gpus=found, build=CU130)


def run_first_stage(site, devices=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO / "workflow")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop(driver_check.DEVICES_ENV, None)
    if devices is not None:
        env[driver_check.DEVICES_ENV] = json.dumps(devices)
    return subprocess.run(
        [sys.executable, "-m", "rectrain.driver_check"], env=env, capture_output=True, text=True, timeout=60
    )


def test_first_stage_check_reads_the_torch_build_without_importing_torch(tmp_path):
    site = fake_site(tmp_path)
    proc = run_first_stage(site)
    assert proc.returncode == 1
    assert "[driver_check] error: 2 GPU(s) seen through NVML with NVIDIA driver 535.104.05" in proc.stderr
    assert "torch 2.14.1+cu130 is built for CUDA 13.0" in proc.stderr
    assert "imported torch" not in proc.stderr
    assert run_first_stage(site, devices="cpu").returncode == 0
    assert run_first_stage(fake_site(tmp_path / "cu12", torch_cuda="12.1")).returncode == 0


@pytest.mark.slow
def test_index_rule_stops_before_indexing_on_a_mismatched_machine(tmp_path, monkeypatch):
    site = fake_site(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    work = tmp_path / "work"
    proc = snakemake("--cores", "1", "--directory", str(work), "results/demo/index/classes.tsv", timeout=300)
    assert proc.returncode != 0
    log = (work / "logs" / "index_raw" / "demo.log").read_text()
    assert "[driver_check] error: 2 GPU(s) seen through NVML with NVIDIA driver 535.104.05" in log
    assert "upgrade the NVIDIA driver to 580.65.06 or newer" in log
    assert not (work / "results" / "demo" / "index" / "classes.tsv").exists()
    ok = snakemake(
        "--cores", "1", "--directory", str(work), "results/demo/index/classes.tsv", "--config", "train={devices: cpu}"
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (work / "results" / "demo" / "index" / "classes.tsv").exists()
