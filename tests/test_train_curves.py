"""The live TensorBoard curves (rectrain.train.curves), read back with tensorboard's own reader: a
resumed writer drops what the killed process wrote after the resume step, a run moved aside takes its
curves along, an epoch's system means, the evaluate stage's top-1 per test resolution.  A real run's
curves across a SIGTERM and its resume: tests/test_train_preempt.py."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rectrain.progress import Window
from rectrain.train import curves
from rectrain.train.lifecycle import checkpoint as ckpt


def scalars(folder):
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def write_lines(c, epoch, dones, lr):
    for done in dones:
        c.add_loss(2.0)
        c.interval(epoch, done, Window(steps=1, wall_s=0.5, wait_s=0.1, images=8), 2, lr, None)


def test_a_resumed_run_drops_what_the_killed_process_wrote_after_the_resume_step_no_step_twice(tmp_path):
    """Killed (SIGKILL) at epoch 1 step 4 after a checkpoint at step 2: the resumed process rewrites 3-4."""
    first = curves.Curves(tmp_path, steps_per_epoch=5, steps_done=0)
    write_lines(first, 0, range(1, 6), lr=0.1)
    write_lines(first, 1, range(1, 5), lr=0.1)
    first.w.flush()  # killed: never closed
    again = curves.Curves(tmp_path, steps_per_epoch=5, steps_done=5 + 2)
    write_lines(again, 1, range(3, 6), lr=0.05)
    again.close()
    lr = scalars(tmp_path / ckpt.CURVES)["train/lr"]
    assert [s for s, _ in lr] == list(range(1, 11)), "every step once, in order"
    assert [round(v, 3) for s, v in lr if s > 7] == [0.05] * 3, "the resumed process's points"
    assert scalars(tmp_path / ckpt.CURVES)["train/images_per_s"][0] == (1, 32.0)  # 8 images x 2 ranks / 0.5 s


def test_a_run_moved_aside_takes_its_curves_along_and_the_new_run_starts_apart(tmp_path):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    ckpt.save_atomic({"epoch": 0}, ck / "last.pt")
    old = curves.Curves(tmp_path, steps_per_epoch=5, steps_done=0)
    write_lines(old, 0, range(1, 6), lr=0.1)
    old.close()
    dest, _ = ckpt.move_aside(ck, "the train config changed (lr)")
    assert not (tmp_path / ckpt.CURVES).exists()
    assert [s for s, _ in scalars(dest / ckpt.CURVES)["train/lr"]] == [1, 2, 3, 4, 5]
    ckpt.move_back(dest, ck)
    assert (tmp_path / ckpt.CURVES).is_dir() and not (dest / ckpt.CURVES).exists(), "back with its run"


def test_an_epoch_gets_node_0_s_cpu_and_per_gpu_means_over_its_own_samples(tmp_path):
    csv = tmp_path / "system_node0.csv"
    csv.write_text(
        "time,cpu_percent,iowait_percent,disk_read_mb_s,rss_mb,gpu0_util,gpu0_mem_used_mb,gpu1_util,gpu1_mem_used_mb\n"
        "99,10,0,,1,0,0,0,0\n"  # before the epoch
        "100,50,10,,1,90,1000,80,2000\n"
        "101,70,30,,1,100,3000,60,2000\n"
        "102.5,"  # a torn last line
    )
    assert curves.system_means(csv, 100, 101) == {
        "cpu_busy_percent": 60.0,
        "iowait_percent": 20.0,
        "gpu_util_percent/gpu0": 95.0,
        "gpu_mem_used_mb/gpu0": 2000.0,
        "gpu_util_percent/gpu1": 70.0,
        "gpu_mem_used_mb/gpu1": 2000.0,
    }


def test_an_epoch_s_values_are_written_at_its_last_step(tmp_path):
    c = curves.Curves(tmp_path, steps_per_epoch=5, steps_done=0)
    stats = {"train_loss": 1.5, "wall_s": 12.0, "data_wait_shares": [0.1, 0.3]}
    val = {"val_single_view_top1": 0.4, "val_single_view_top5": 0.9}
    c.epoch(1, curves.epoch_values(stats, val, efficiency=None), {"cpu_busy_percent": 55.0})
    c.close()
    got = scalars(tmp_path / ckpt.CURVES)
    assert (
        got["epoch/val_single_view_top1"] == [(10, 0.4000000059604645)]
        and got["epoch/data_wait_share/rank1"][0][0] == 10
    )
    assert "epoch/input_efficiency" not in got, "not measured (no calibration): no point"


def test_the_evaluate_stage_s_top1_per_test_resolution_and_a_rerun_replaces_it(tmp_path):
    curves.evaluation(tmp_path, [{"top1": 0.5, "top5": 0.9, "crop": 224}, {"top1": 0.6, "top5": 0.95, "crop": 288}])
    curves.evaluation(tmp_path, [{"top1": 0.7, "top5": 0.97, "crop": 224}])
    top1 = scalars(tmp_path / ckpt.CURVES / "evaluate")["evaluate/top1"]
    assert [(s, round(v, 3)) for s, v in top1] == [(224, 0.7)]


def test_no_curves_on_other_ranks_or_when_switched_off(tmp_path):
    with curves.opened(False, tmp_path, 5, 0, 0) as c:
        assert c is None
    assert not (tmp_path / ckpt.CURVES).exists()
    with curves.opened(True, tmp_path, 5, 1, 2) as c:
        c.interval(1, 3, Window(steps=1, wall_s=0.5, wait_s=0.1, images=8), 1, 0.1, None)
    assert scalars(tmp_path / ckpt.CURVES)["train/lr"][0][0] == 8
