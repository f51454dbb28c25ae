"""Each diagnosis rule fires on telemetry made to show its condition, with the right ranks and numbers,
and stays silent on a healthy run."""

import pandas as pd
import pytest
from helpers.synthetic_run import REPORT, make_calibration, make_manifest, make_run, make_steps, make_system

from rectrain.report.diagnosis import Finding, diagnose
from rectrain.report.stats import data_wait_share_by_rank
from rectrain.train.telemetry import STEP_COLUMNS

HEALTHY_GPUS = {0: (95.0, 7000.0, 11264.0), 1: (94.0, 7100.0, 11264.0)}
PROBLEM_IDS = {
    "input_bound",
    "rank_imbalance",
    "rec_on_rotational",
    "high_iowait",
    "gpu_memory_high",
    "gpu_memory_headroom",
    "low_gpu_util",
    "images_skipped",
}


def run_diag(
    wait=None, iowait=2.0, gpus=HEALTHY_GPUS, run=None, manifests=None, cpu=50.0, sizes=None
) -> dict[str, Finding]:
    steps = make_steps(wait or {0: 0.02, 1: 0.03})
    system = make_system(iowait=iowait, gpus=gpus, cpu=cpu, cpu_jitter=0.0)
    found = diagnose(
        steps,
        system,
        run or make_run(gpus=len(gpus or {})),
        manifests if manifests is not None else {"train": make_manifest("train")},
        REPORT,
        image_sizes=sizes,
    )
    ids = [f.id for f in found]
    assert len(ids) == len(set(ids)), f"duplicate findings: {ids}"
    return {f.id: f for f in found}


def test_healthy_run_reports_no_problems_with_its_numbers():
    found = run_diag()
    assert set(found) == {"no_problems"}
    f = found["no_problems"]
    assert f.title == "No problems found"
    assert "data wait 2.5 %" in f.measured and "compute-bound" in f.measured


def test_rank_starving_for_data_is_named_with_both_ranks_and_shares():
    found = run_diag(wait={0: 0.02, 1: 0.60})
    f = found["rank_imbalance"]
    assert "rank 1" in f.title and "rank 0" in f.title
    assert "rank 1 waits on data 60.0 %" in f.measured
    assert "rank 0 2.0 %" in f.measured and "30.0x" in f.measured
    assert "report.imbalance_ratio = 3x" in f.threshold
    assert "pack.fast_storage" in f.fix
    # the starving rank also makes the job input-bound, and that finding names rank 1 as the worst
    assert "rank 1 waits most" in found["input_bound"].measured
    assert "no_problems" not in found


def test_small_waits_are_not_called_imbalance_even_at_a_large_ratio():
    found = run_diag(wait={0: 0.001, 1: 0.01})
    assert "rank_imbalance" not in found


def test_input_bound_uses_the_configured_share():
    found = run_diag(wait={0: 0.35, 1: 0.30})
    f = found["input_bound"]
    assert "32.5 % of step time" in f.measured and "rank 0: 35.0 %" in f.measured
    assert "report.data_wait_share = 20.0 %" in f.threshold
    assert "rank_imbalance" not in found


def test_first_step_of_each_epoch_is_excluded_from_data_wait():
    steps = make_steps({0: 0.0})
    steps.loc[steps["step"] == 0, "data_wait_s"] = steps.loc[steps["step"] == 0, "wall_s"]
    assert data_wait_share_by_rank(steps)[0] == 0.0


def test_high_iowait_reports_mean_and_p90_and_the_seed_fix():
    f = run_diag(iowait=45.0)["high_iowait"]
    assert "iowait mean 45.0 %, p90 45.0 %" in f.measured
    assert "report.iowait_percent = 20 %" in f.threshold
    assert "pack.fast_storage" in f.fix and "47 % iowait" in f.fix


def test_rec_on_rotational_disk_from_manifest_or_run_json():
    from_manifest = run_diag(manifests={"train": make_manifest("train", rotational=True)})
    f = from_manifest["rec_on_rotational"]
    assert "train.rec" in f.measured and "/dev/sdb" in f.measured
    assert "pack.fast_storage" in f.fix and "SSD" in f.fix
    from_run = run_diag(run=make_run(rotational=True))
    assert "training read results/fast_storage/demo/train.rec" in from_run["rec_on_rotational"].measured


def test_gpu_memory_near_limit_suggests_half_batch_with_accumulation():
    f = run_diag(gpus={0: (95.0, 10927.0, 11264.0), 1: (95.0, 7000.0, 11264.0)})["gpu_memory_high"]
    assert "GPU 0: 10.7 of 11.0 GB (97.0 %)" in f.measured
    assert "train.batch_size: 64 with train.grad_accum: 2 keeps the global batch of 256" in f.fix
    assert "illegal memory access" in f.fix


def test_unused_gpu_memory_suggests_a_larger_batch():
    f = run_diag(gpus={0: (95.0, 3379.0, 11264.0), 1: (95.0, 3379.0, 11264.0)})["gpu_memory_headroom"]
    assert "(30.0 %)" in f.measured
    assert "train.batch_size: 384 (now 128)" in f.fix
    assert "report.gpu_mem_low = 50.0 %" in f.threshold


def test_low_gpu_util_without_data_wait_suggests_only_what_is_off():
    gpus = {0: (40.0, 7000.0, 11264.0), 1: (40.0, 7000.0, 11264.0)}
    found = run_diag(wait={0: 0.01, 1: 0.01}, gpus=gpus)
    f = found["low_gpu_util"]
    assert "mean GPU util 40 %" in f.measured and "data wait 1.0 %" in f.measured
    assert "train.compile: true" in f.fix
    assert "channels_last" not in f.fix and "precision" not in f.fix  # already on in run.json
    all_on = run_diag(
        wait={0: 0.01, 1: 0.01}, gpus=gpus, run=make_run(compile=True, channels_last=True, precision="fp32")
    )["low_gpu_util"]
    assert "train.precision: bf16" in all_on.fix and "train.compile" not in all_on.fix
    # rectrain.train keeps compile / channels_last in run.json's copy of the train block
    nested = make_run(config={"compile": True, "channels_last": False})
    del nested["compile"], nested["channels_last"]
    tip = run_diag(wait={0: 0.01, 1: 0.01}, gpus=gpus, run=nested)["low_gpu_util"].fix
    assert "train.channels_last: true" in tip and "train.compile" not in tip


def test_low_gpu_util_with_high_data_wait_is_input_bound_not_a_compute_tip():
    gpus = {0: (40.0, 7000.0, 11264.0), 1: (40.0, 7000.0, 11264.0)}
    found = run_diag(wait={0: 0.5, 1: 0.5}, gpus=gpus)
    assert "low_gpu_util" not in found and "input_bound" in found


def test_skipped_and_repaired_images_are_reported_with_reasons():
    skipped = [{"id": 3, "source": "train/n1/x.JPEG", "reason": "truncated JPEG"}]
    repaired = [{"id": 5, "source": "train/n1/cmyk.JPEG", "reason": "CMYK converted to RGB"}]
    found = run_diag(manifests={"train": make_manifest("train", skipped=skipped, repaired=repaired)})
    assert "1 of 601 discovered images skipped" in found["images_skipped"].measured
    assert "train/n1/x.JPEG (truncated JPEG)" in found["images_skipped"].measured
    assert found["images_repaired"].severity == "info"
    assert "no_problems" not in found


def test_repaired_images_alone_still_say_no_problems():
    repaired = [{"id": 5, "source": "cmyk.JPEG", "reason": "CMYK"}]
    found = run_diag(manifests={"train": make_manifest("train", repaired=repaired)})
    assert set(found) == {"images_repaired", "no_problems"}


def test_cpu_only_run_has_no_gpu_findings():
    found = run_diag(gpus=None, run=make_run(gpus=0))
    assert set(found) == {"no_problems"}
    assert "GPU" not in found["no_problems"].measured


def test_every_problem_condition_at_once_is_sorted_most_urgent_first():
    gpus = {0: (40.0, 10927.0, 11264.0), 1: (40.0, 3379.0, 11264.0)}
    skipped = [{"id": 3, "source": "x.JPEG", "reason": "zero bytes"}]
    steps = make_steps({0: 0.02, 1: 0.60})
    found = diagnose(
        steps,
        make_system(iowait=45.0, gpus=gpus),
        make_run(rotational=True),
        {"train": make_manifest(rotational=True, skipped=skipped)},
        REPORT,
    )
    ids = [f.id for f in found]
    assert {
        "rank_imbalance",
        "input_bound",
        "high_iowait",
        "rec_on_rotational",
        "gpu_memory_high",
        "images_skipped",
    } <= set(ids)
    order = [f.severity for f in found]
    assert order == sorted(order, key=["critical", "warning", "info", "ok"].index)
    for f in found:
        assert f.measured and f.threshold and f.fix and any(ch.isdigit() for ch in f.measured)


def test_empty_telemetry_does_not_crash():
    found = diagnose(pd.DataFrame(columns=STEP_COLUMNS), pd.DataFrame(columns=["time", "cpu_percent"]), {}, {}, REPORT)
    assert [f.id for f in found] == ["no_problems"]


# --- GPU knobs: the input-bound fix names the knob of the decoder the run actually used -----------------


def _input_fix(**run_fields):
    run = make_run(gpus=2, **run_fields)
    return run_diag(wait={0: 0.35, 1: 0.30}, run=run)["input_bound"].fix


def test_input_bound_with_dali_gpu_decode_suggests_hw_decoder_load_and_threads():
    fix = _input_fix(
        decode="gpu: DALI mixed decoder (nvJPEG)",
        config={"workers": 4, "dali_hw_decoder_load": 0.65, "dali_prefetch_queue_depth": 2},
    )
    assert "train.dali_hw_decoder_load (now 0.65)" in fix and "train.workers (now 4)" in fix
    assert "train.dali_prefetch_queue_depth (now 2)" in fix and "pack.resize" in fix


def test_input_bound_quotes_the_worker_count_auto_became():
    fix = _input_fix(decode="gpu: DALI mixed decoder (nvJPEG)", workers=6, config={"workers": "auto"})
    assert "train.workers (now 6)" in fix


def test_input_bound_with_cpu_decode_on_gpus_suggests_gpu_decode():
    fix = _input_fix(decode="cpu: DALI (libjpeg-turbo) in train.workers threads", config={"workers": 2})
    assert "train.gpu_decode: true" in fix and "train.loader: dali" in fix and "(now 2)" in fix


def test_input_bound_after_dali_fallback_says_install_dali():
    fix = _input_fix(
        decode="gpu: TorchCodec decode_jpeg (nvJPEG), one batched call per step",
        loader="torch",
        loader_note="train.loader is 'dali' but DALI cannot be imported (ImportError)",
    )
    assert "install DALI" in fix and "hardware JPEG engines" in fix


@pytest.mark.parametrize(
    "decode",
    [
        "gpu: TorchCodec decode_jpeg (nvJPEG), one batched call per step",
        "gpu: torchvision.io.decode_jpeg, one batched call per step",  # what run.json said before #24
    ],
)
def test_input_bound_with_torch_gpu_decode_suggests_dali(decode):
    fix = _input_fix(decode=decode, loader="torch")
    assert "train.loader: dali" in fix and "CUDA cores" in fix


def test_input_bound_without_decode_in_run_json_gives_the_generic_fix():
    fix = run_diag(wait={0: 0.35, 1: 0.30})["input_bound"].fix
    assert "train.gpu_decode: true" in fix and "pack.fast_storage" in fix


def test_low_gpu_util_suggests_cudnn_benchmark_when_it_was_off():
    gpus = {0: (40.0, 7000.0, 11264.0), 1: (40.0, 7000.0, 11264.0)}
    run = make_run(gpus=2, compile=True, config={"cudnn_benchmark": False})
    fix = run_diag(wait={0: 0.01, 1: 0.01}, gpus=gpus, run=run)["low_gpu_util"].fix
    assert "train.cudnn_benchmark: true" in fix


# --- input efficiency: real steady img/s against the calibration on synthetic data ---------------------
# make_steps: 32 images per 0.5 s step, so every rank runs at 64.0 img/s on real data.


def calibrated(rate: float, **fields) -> dict:
    return make_run(gpus=2, calibration=make_calibration({0: rate, 1: rate}), **fields)


def test_loader_that_cannot_keep_up_gets_the_fixes_its_evidence_supports():
    sizes = pd.DataFrame({"width": [500] * 8, "height": [375] * 8})
    run = calibrated(128.0, decode="cpu: DALI (libjpeg-turbo) in train.workers threads", workers=2)
    found = run_diag(wait={0: 0.35, 1: 0.30}, iowait=45.0, run=run, cpu=50.0, sizes=sizes)
    f = found["input_bound"]
    assert f.title == "Training is input-bound: the loader cannot keep up"
    assert "input efficiency 0.50: 128.0 img/s on real data against 256.0 img/s on synthetic data" in f.measured
    assert "rank 0: 0.50, rank 1: 0.50" in f.measured and "32.5 % of step time" in f.measured
    assert "report.input_efficiency = 0.90" in f.threshold
    assert "stage the .rec to faster storage" in f.fix.lower() and "iowait averaged 45.0 %" in f.fix
    assert "add decode workers (train.workers (now 2)): the CPU was busy 50 %, about 8.0 of 16 cores idle" in f.fix
    # 500x375 -> shorter side 80 (8/7 of image_size 64): (80/375)^2 of the pixels remain
    assert "pack.resize: 80, now pass-through" in f.fix
    assert "average 0.19 Mpx (sample of 8), 0.01 Mpx at 80 px" in f.fix and "about 95 % less decode work" in f.fix
    # the RTX 2080 Ti has no hardware JPEG decoder and decoding is on the CPU: no GPU-decoder advice
    assert "hw_decoder" not in f.fix
    assert "contention" not in found and "cpu_bound" not in found


def test_an_input_bound_run_on_large_photos_is_advised_max_side_and_on_imagenet_sizes_resize():
    run = calibrated(128.0, decode="cpu: DALI (libjpeg-turbo) in train.workers threads", workers=2)
    photos = pd.DataFrame({"width": [4000, 3000] * 4, "height": [3000, 4000] * 4})
    fix = run_diag(wait={0: 0.35, 1: 0.30}, run=run, cpu=95.0, sizes=photos)["input_bound"].fix
    # 12 Mpx -> 500x375: 98 % of the pixels go, nearly resize 80's 100 %
    assert "pack.max_side: 500, now pass-through" in fix and "pack.resize: 80" in fix
    assert "0.19 Mpx at 500 px on the longest side, so about 98 % less decode work, nearly the 100 %" in fix
    # ImageNet's 500x375: max_side 500 removes nothing, so the advice stays resize
    imagenet = pd.DataFrame({"width": [500] * 8, "height": [375] * 8})
    fix = run_diag(wait={0: 0.35, 1: 0.30}, run=run, cpu=95.0, sizes=imagenet)["input_bound"].fix
    assert "pack.max_side" not in fix and "pack.resize: 80, now pass-through" in fix


def test_low_efficiency_without_data_wait_is_contention_on_the_sms_of_a_gpu_without_jpeg_engine():
    run = calibrated(88.9, decode="gpu: DALI mixed decoder (nvJPEG)", config={"dali_hw_decoder_load": 0.65})
    found = run_diag(wait={0: 0.01, 1: 0.01}, run=run, cpu=50.0)
    f = found["contention"]
    assert f.title == "Decoding competes with the model for the GPU's SMs"
    assert "input efficiency 0.72: 128.0 img/s on real data against 177.8 img/s" in f.measured
    assert "data wait is only 1.0 % of step time" in f.measured
    assert f.severity == "critical"  # 28 % lost, more than twice the 10 % the threshold tolerates
    assert "RTX 2080 Ti has no hardware JPEG decoder" in f.fix
    assert "decode on the CPU instead (train.gpu_decode: false; about 8.0 cores are idle)" in f.fix
    assert "input_bound" not in found and "cpu_bound" not in found and "no_problems" not in found


def test_contention_on_a_gpu_with_a_jpeg_engine_raises_the_hardware_decoder_load():
    run = calibrated(88.9, decode="gpu: DALI mixed decoder (nvJPEG)", config={"dali_hw_decoder_load": 0.65})
    run["gpus"] = [{"index": i, "name": "NVIDIA H200", "memory_total_mb": 143771} for i in range(2)]
    fix = run_diag(wait={0: 0.01, 1: 0.01}, run=run, gpus=None)["contention"].fix
    assert "raise train.dali_hw_decoder_load (now 0.65) toward 0.9: the NVIDIA H200 has a hardware JPEG decoder" in fix


def test_saturated_cpu_is_named_the_bottleneck_with_the_cores_decoding_needs():
    # CPU processes on 2 cores: 128 img/s real, 160 on synthetic data, CPU 99 % busy.
    # 1.98 busy cores / 128 img/s = 15.5 ms per image, the model alone 2 / 160 = 12.5 ms: decode 3.0 ms,
    # 337 img/s per core, and 160 img/s need 160 x 3.0 ms = 0.48 -> 1 core on top of the model's 2.
    run = make_run(gpus=0, cores=2, calibration=make_calibration({0: 80.0, 1: 80.0}))
    found = run_diag(wait={0: 0.01, 1: 0.01}, gpus=None, run=run, cpu=99.0)
    f = found["cpu_bound"]
    assert f.title == "The CPU is the bottleneck"
    assert "CPU busy 99 % (median while training) of the job's 2 cores" in f.measured
    assert "input efficiency 0.80" in f.measured
    assert "3.0 ms of CPU per image, 337 img/s per core (1.98 busy cores delivered 128.0 img/s" in f.measured
    assert "less the model's own 12.5 ms per image on 160.0 img/s in the calibration" in f.measured
    assert "needs about 1 core of decoding at the measured 337 img/s per core on top of the 2" in f.fix
    assert "report.cpu_busy_percent = 90 %" in f.threshold
    assert found["contention"].title == "Decoding competes with the model for the CPU cores"
    for finding in found.values():  # no idle cores: never more workers
        assert "add decode workers" not in finding.fix


def test_saturated_cpu_feeding_gpus_counts_all_busy_time_as_input_work():
    # 8 cores 98 % busy feeding 2 GPUs: 7.84 cores / 128 img/s = 61.25 ms per image, 16 img/s per core;
    # 256 img/s on synthetic data need 256 x 61.25 ms = 15.7 -> 16 cores.
    run = calibrated(128.0, cores=8, decode="cpu: DALI (libjpeg-turbo) in train.workers threads")
    f = run_diag(wait={0: 0.30, 1: 0.30}, run=run, cpu=98.0)["cpu_bound"]
    assert (
        "61.2 ms of CPU per image, 16 img/s per core (7.84 busy cores" in f.measured
        and "all of it counted" in f.measured
    )
    assert "needs about 16 cores of decoding" in f.fix and "the job has 8" in f.fix


def test_healthy_run_quotes_its_input_efficiency():
    found = run_diag(run=calibrated(66.0))
    assert set(found) == {"no_problems"}
    assert "input efficiency 0.97: 128.0 img/s on real data against 132.0 img/s" in found["no_problems"].measured


def test_run_without_calibration_says_not_measured_and_keeps_the_data_wait_diagnosis():
    found = run_diag()
    assert "input efficiency not measured: run.json has no calibration" in found["no_problems"].measured
    waited = run_diag(wait={0: 0.35, 1: 0.30})["input_bound"]
    assert waited.title == "Training is input-bound: the model waits for data"
    assert "input efficiency" not in waited.measured and "pack.fast_storage" in waited.fix
    skipped = run_diag(run=make_run(gpus=2, calibration=make_calibration(skipped="train.calibrate is false")))
    assert "not measured: the calibration did not run (train.calibrate is false)" in skipped["no_problems"].measured


def test_gpu_busy_in_the_steps_but_idle_around_them_is_not_called_underused():
    """The first GPU run: 84-100 % while its 20-step epochs ran, 0 % during start-up, validation and
    set-up between them - 44 % over the run. Utilisation is judged inside the steps."""
    steps = make_steps({0: 0.01, 1: 0.01}, epochs=2, steps=10, step_s=0.5)  # epochs at t0+0.5..5, 5.5..10
    system = make_system(n=40, gpus={0: (0.0, 7000.0, 11264.0)}, cpu_jitter=0.0)  # t0 .. t0+39
    in_steps = system["time"].between(steps["time"].min(), steps["time"].max())
    system.loc[in_steps, "gpu0_util"] = 95.0
    assert system["gpu0_util"].mean() < 30  # the whole-run mean that fooled the old diagnosis
    found = {f.id for f in diagnose(steps, system, make_run(gpus=1), {"train": make_manifest("train")}, REPORT)}
    assert "low_gpu_util" not in found
    system.loc[in_steps, "gpu0_util"] = 40.0
    found = {f.id: f for f in diagnose(steps, system, make_run(gpus=1), {}, REPORT)}
    assert (
        "mean GPU util 40 %" in found["low_gpu_util"].measured
        and "during the training steps" in found["low_gpu_util"].measured
    )


def paced_run(slow_from: int, other_cpu: float, slow_factor: float = 5.0):
    """6 epochs of 20 steps on 2 ranks at 0.5 s a step, epochs from `slow_from` on `slow_factor` x slower;
    one system sample a second: the job's own processes at 45 % of the machine throughout, other
    processes at 5 % before `slow_from` and `other_cpu` % from there."""
    frames, t = [], 1_700_000_000.0
    for epoch in range(6):
        step_s = 0.5 * (slow_factor if epoch >= slow_from else 1.0)
        rows = make_steps({0: 0.02, 1: 0.03}, epochs=1, steps=20, step_s=step_s, t0=t)
        frames.append(rows.assign(epoch=epoch))
        t = float(rows["time"].max()) + 3.0  # validation and the checkpoint
    steps = pd.concat(frames, ignore_index=True)
    starts = (steps["time"] - steps["wall_s"]).groupby(steps["epoch"]).min()
    times = pd.Series(range(int(starts.iloc[0]), int(t)), dtype=float)
    later = times >= starts[slow_from]
    own = pd.Series(45.0, index=times.index)
    system = pd.DataFrame({"time": times, "cpu_percent": own + 5.0 + later * (other_cpu - 5.0), "job_cpu_percent": own})
    return steps, system.assign(iowait_percent=1.0, disk_read_mb_s=10.0, rss_mb=900.0)


def test_other_processes_are_named_when_their_load_coincides_with_slow_epochs():
    from rectrain.report import slowdown

    steps, system = paced_run(slow_from=4, other_cpu=50.0)
    f = slowdown.other_processes(steps, system, REPORT)
    assert f.id == "other_processes" and f.severity == "warning"
    assert f.title == (
        "Other processes slowed training: epochs 4-5 ran at 0.2x the other epochs' rate while other processes "
        "used 50 % of the CPUs"
    )
    assert "other processes used 50 % of the machine's CPUs then and 5 % in the other epochs" in f.measured
    assert "this run's own processes 45 % and 45 %" in f.measured
    assert "report.slow_epoch_ratio = 0.7" in f.threshold and "report.other_cpu_percent = 25 %" in f.threshold
    found = diagnose(steps, system, make_run(gpus=0), {"train": make_manifest("train")}, REPORT,
                     paced=[f])  # fmt: skip
    assert "other_processes" in [x.id for x in found] and "no_problems" not in [x.id for x in found]


@pytest.mark.parametrize(
    ("slow_from", "other_cpu", "slow_factor", "why"),
    [
        (4, 5.0, 5.0, "slow epochs, but no other load: something else slowed them"),
        (4, 50.0, 1.0, "other load, but no epoch slowed"),
        (4, 20.0, 5.0, "other processes at 20 % of the CPUs: under report.other_cpu_percent"),
    ],
)
def test_other_processes_are_not_named_without_both_a_slowdown_and_their_load(slow_from, other_cpu, slow_factor, why):
    from rectrain.report import slowdown

    steps, system = paced_run(slow_from, other_cpu, slow_factor)
    assert slowdown.other_processes(steps, system, REPORT) is None, why
    assert slowdown.other_processes(steps, system.drop(columns="job_cpu_percent"), REPORT) is None
