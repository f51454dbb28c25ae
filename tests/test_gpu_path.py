"""The GPU path's decisions and knobs, proven on CPU: config/gpu.yaml, loader dispatch without DALI,
DALI decoder arguments, and the torch loader's raw-bytes + batched-decode train path."""

import dataclasses
import os

import pytest
import torch
import yaml
from helpers import REPO, job_headers
from helpers.train_data import colour_class, write_rec

from rectrain import loaders, settings
from rectrain.loaders import DaliOptions, LoaderSpec, build_loader, choose_loader, resolve_workers
from rectrain.loaders.pytorch import TorchLoader
from rectrain.snakefile.checks import check_config

SCHEMA = REPO / "config" / "schema.yaml"


def gpu_config():
    with open(REPO / "config" / "gpu.yaml") as fh:
        return check_config(yaml.safe_load(fh), SCHEMA, workdir=REPO)


def test_gpu_config_is_valid_and_asks_for_the_gpu_path():
    cfg = gpu_config()
    t = cfg["train"]
    # Two ranks on the one GPU of the device machine: DDP and per-rank telemetry with real CUDA.
    assert t["devices"] == [0, 0] and t["precision"] == "bf16" and t["channels_last"] and t["gpu_decode"]
    assert (t["model"], t["image_size"], t["batch_size"]) == ("resnet50", 224, 256)
    d = cfg["demo"]
    assert 300 <= d["min_size"] <= d["max_size"] <= 600 and d["quality"] == 90
    # Enough images to run past warm-up: at least 15 full steps of 2 ranks x 256 per epoch.
    assert d["classes"] * d["train_per_class"] >= 15 * 2 * 256
    assert t["workers"] == cfg["evaluate"]["workers"] == "auto"


def test_auto_workers_share_the_nodes_cores_among_its_ranks():
    assert resolve_workers("auto", local_ranks=1, cores=16) == 16
    assert resolve_workers("auto", local_ranks=8, cores=16) == 2  # not 8 x 12 threads on 16 cores
    assert resolve_workers("auto", local_ranks=4, cores=2) == 1  # never zero: DALI needs a thread
    assert resolve_workers(0, local_ranks=8, cores=16) == 0  # a number is taken as given
    assert resolve_workers("auto", local_ranks=1) == len(os.sched_getaffinity(0))


def test_gpu_knobs_have_defaults_and_descriptions():
    with open(SCHEMA) as fh:
        train = yaml.safe_load(fh)["properties"]["train"]["properties"]
    for key in (
        "cudnn_benchmark",
        "dali_hw_decoder_load",
        "dali_prefetch_queue_depth",
        "dali_device_memory_padding",
        "dali_host_memory_padding",
        "dali_preallocate",
        "workers",
        "gpu_decode",
    ):
        assert "default" in train[key] and train[key].get("description"), key
    filled = check_config({"dataset": "demo"}, SCHEMA, workdir=REPO)["train"]
    assert DaliOptions.from_config(settings.train(filled).loaders) == DaliOptions.defaults()
    opts = DaliOptions.from_config(settings.train(gpu_config()["train"]).loaders)
    # The GPU config preallocates the decoder's buffers (no re-allocation on the first large image).
    assert min(opts.preallocate) > 0 and 0 < opts.hw_decoder_load <= 1


def test_bad_hw_decoder_load_is_rejected_naming_the_key():
    from rectrain.config import ConfigError

    with pytest.raises(ConfigError, match="train.dali_hw_decoder_load"):
        check_config({"dataset": "demo", "train": {"dali_hw_decoder_load": 1.5}}, SCHEMA, workdir=REPO)


@pytest.mark.parametrize(
    "has_cuda,has_dali,gpu_decode,kind,decode_on",
    [
        (True, True, True, "dali", "gpu: DALI mixed"),
        (True, True, False, "dali", "cpu: DALI"),
        (False, True, True, "dali", "cpu: DALI"),
        (True, False, True, "torch", "gpu: TorchCodec decode_jpeg"),
        (False, False, True, "torch", "cpu: simplejpeg"),
    ],
)
def test_dali_request_dispatch(has_cuda, has_dali, gpu_decode, kind, decode_on):
    choice = choose_loader("dali", has_cuda, has_dali, gpu_decode, dali_error="ImportError: no nvidia.dali")
    assert choice.kind == kind and choice.decode.startswith(decode_on)
    if has_dali:
        assert choice.note is None
    else:
        # The fallback names the cause, what runs instead, and both fixes.
        for fragment in (
            "train.loader is 'dali'",
            "ImportError: no nvidia.dali",
            "torch loader",
            "nvidia-dali-cuda",
            "train.loader: torch",
        ):
            assert fragment in choice.note


@pytest.mark.parametrize("has_cuda", [True, False])
def test_torch_request_never_needs_dali(has_cuda):
    choice = choose_loader("torch", has_cuda, has_dali=False)
    assert choice.kind == "torch" and choice.note is None
    assert choice.decode.startswith("gpu" if has_cuda else "cpu")


@pytest.mark.parametrize("requested", ["dali", "torch"])
def test_torch_gpu_decode_without_torchcodec_decodes_on_the_cpu_and_says_how_to_fix(requested):
    choice = choose_loader(requested, True, has_dali=False, torchcodec_error="ModuleNotFoundError: no torchcodec")
    assert choice.kind == "torch" and choice.decode.startswith("cpu: simplejpeg")
    for fragment in (
        "train.gpu_decode is true",
        "ModuleNotFoundError: no torchcodec",
        "torchcodec==",
        "gpu_decode: false",
    ):
        assert fragment in choice.note
    assert choose_loader("dali", True, has_dali=True, torchcodec_error="absent").decode.startswith("gpu: DALI")


def test_unknown_loader_names_the_key():
    with pytest.raises(ValueError, match="train.loader"):
        choose_loader("ffcv", True, True)


def test_dali_decoder_knobs_reach_only_the_mixed_decoder():
    from rectrain.loaders.dali import decoder_args

    opts = dataclasses.replace(DaliOptions.defaults(), hw_decoder_load=0.9, preallocate=(640, 480))
    args = decoder_args("mixed", opts, jpeg_engine=True)
    assert args["hw_decoder_load"] == 0.9 and args["preallocate_width_hint"] == 640
    assert args["preallocate_height_hint"] == 480 and args["device_memory_padding"] == opts.device_memory_padding
    assert decoder_args("cpu", opts, jpeg_engine=True) == {}


def test_the_preallocation_hints_reach_the_decoder_only_on_a_gpu_with_jpeg_engines():
    from rectrain.loaders.dali import decoder_args

    opts = dataclasses.replace(DaliOptions.defaults(), preallocate=(6430, 5980))
    args = decoder_args("mixed", opts, jpeg_engine=False)
    assert (args["preallocate_width_hint"], args["preallocate_height_hint"]) == (0, 0), "a 2080 Ti: nothing to hint"
    assert args["device_memory_padding"] == opts.device_memory_padding


@pytest.fixture(scope="module")
def colour_rec(tmp_path_factory):
    labels = [i % 5 for i in range(21)]
    return write_rec(tmp_path_factory.mktemp("gpu_colour"), labels), labels


def test_dali_missing_falls_back_to_torch_loader_with_the_reason(colour_rec, monkeypatch, caplog):
    monkeypatch.setattr(loaders, "dali_import_error", lambda: "ImportError: simulated")
    (rec, idx), labels = colour_rec
    loader = build_loader("dali", LoaderSpec(rec, idx, batch_size=8, image_size=16, train=False, workers=0))
    assert loader.kind == "torch" and "simulated" in loader.choice.note
    assert any(r.levelname == "WARNING" and "simulated" in r.getMessage() for r in caplog.records)  # in the log
    seen = [y for _, ys in loader.epoch(0) for y in ys.tolist()]
    assert sorted(seen) == sorted(labels)


def test_raw_bytes_train_path_matches_the_worker_decode_path(colour_rec):
    """Workers returning raw JPEG bytes + a batched decode_jpeg later (device='cpu' here, 'cuda' on a GPU)
    yields the same labels, shapes, dtype and colour-label pairing as decoding in the workers."""
    (rec, idx), labels = colour_rec
    spec = LoaderSpec(rec, idx, batch_size=8, image_size=24, train=True, workers=0, seed=3)
    by_bytes, in_workers = TorchLoader(spec, decode_on_device=True), TorchLoader(spec, decode_on_device=False)
    assert by_bytes.dataset.decode is False and in_workers.dataset.decode is True
    for (xa, ya), (xb, yb) in zip(by_bytes.epoch(1), in_workers.epoch(1), strict=True):
        assert torch.equal(ya, yb)  # same sampler order: same records in the same batches
        assert xa.shape == xb.shape == (8, 3, 24, 24) and xa.dtype == xb.dtype == torch.float32
        assert torch.equal(colour_class(xa), ya % 5) and torch.equal(colour_class(xb), yb % 5)


def test_capped_gpu_label_says_what_the_process_may_use():
    from rectrain.train.batchplan import GpuInfo, oom_message

    capped = GpuInfo(0, "NVIDIA H200", 11 * 1024, card_mb=140 * 1024)
    assert capped.label() == "GPU 0 (NVIDIA H200, 11.0 GB of the card's 140.0 GB, capped for this process)"
    assert GpuInfo(0, "RTX 2080 Ti", 11 * 1024).label() == "GPU 0 (RTX 2080 Ti, 11.0 GB)"
    msg = oom_message(capped, 256, 96, 1, need_mb=25 * 1024)
    assert "batch 256" in msg and "11.0 GB" in msg and "96" in msg and "grad_accum" in msg


def test_gpu_config_plans_the_whole_pipeline(tmp_path):
    """What bench/gpu_check.sh runs: the config parses, and a dry run from scratch schedules every stage."""
    from helpers import snakemake

    proc = snakemake(
        "-n",
        "--configfile",
        str(REPO / "config" / "gpu.yaml"),
        "--directory",
        str(tmp_path),
        "results/report.html",
        check=True,
    )
    announced = {rule for rule, _ in job_headers(proc.stdout)}
    for rule in ("demo_data", "index_raw", "pack", "train", "evaluate", "report"):
        assert rule in announced, rule


def test_gpu_check_scripts_parse_as_bash():
    """(What the script does is run for real on CPU in tests/test_gpu_check.py.)"""
    import subprocess

    for name in ("gpu_check.sh", "fetch_gpu_wheels.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / "bench" / name)]).returncode == 0, name


@pytest.mark.parametrize("decode", ["cpu", "mixed"])
def test_dali_outputs_leave_the_pipeline_on_the_gpu_when_training_on_one(decode):
    """With gpu_decode false the images are decoded on the CPU; they and the labels must still come out
    of the pipeline on the GPU (DALI copies them on its stream), never as DALI-owned pinned host memory
    that torch would copy asynchronously while DALI refills it. Checked on the pipeline's graph."""
    pytest.importorskip("nvidia.dali")
    import numpy as np

    from rectrain.loaders.dali import EpochRecords, _pipeline

    def outputs(on_gpu):
        pipe = _pipeline(
            records=EpochRecords(None, np.arange(2), 2), image_size=32, eval_resize=36,
            decode_device=decode if on_gpu else "cpu", decoder_kwargs={}, on_gpu=on_gpu,
            batch_size=2, num_threads=1, device_id=0 if on_gpu else None, prefetch_queue_depth=2, seed=1,
        )  # fmt: skip
        # The graph DALI 1.34 (the pinned version) traced at construction: nothing built, no device needed.
        return [out.device for out in pipe._graph_out]

    assert outputs(on_gpu=True) == ["gpu", "gpu"]
    assert outputs(on_gpu=False) == ["cpu", "cpu"]
