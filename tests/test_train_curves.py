"""The live TensorBoard curves (rectrain.train.curves), read back with tensorboard's own reader: a
resumed writer drops what the killed process wrote after the resume step, a run moved aside takes its
curves along, an epoch's system means, the evaluate stage's top-1 per test resolution.  A real run's
curves across a SIGTERM and its resume: tests/test_train_preempt.py."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rectrain.progress import Window
from rectrain.train import curves
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle.checkpoint import CheckpointSaver


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
    dest, _ = CheckpointSaver(ck).move_aside("the train config changed (lr)")
    assert not (tmp_path / ckpt.CURVES).exists()
    assert [s for s, _ in scalars(dest / ckpt.CURVES)["train/lr"]] == [1, 2, 3, 4, 5]
    CheckpointSaver(ck).move_back(dest)
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


def step_row(epoch, step, wall, wait):
    """A line of steps_rank<r>.csv (rectrain.train.telemetry.STEP_COLUMNS)."""
    return f"1,{epoch},{step},0,{wall},{wait},{wall - wait},8,2.0,0.1\n"


def test_every_other_ranks_data_wait_share_per_line_is_read_from_its_live_step_log_since_the_last_line(tmp_path):
    (tmp_path / "telemetry").mkdir()
    log = tmp_path / "telemetry" / "steps_rank1.csv"
    log.write_text("rank,epoch,step,time,wall_s,data_wait_s,compute_s,images,loss,lr\n")
    c = curves.Curves(tmp_path, steps_per_epoch=5, steps_done=0)
    window = Window(steps=1, wall_s=0.5, wait_s=0.1, images=8)
    with open(log, "a") as f:
        f.write(step_row(0, 0, 0.5, 0.25) + step_row(0, 1, 0.5, 0.25) + "1,0,2,0,0.5")  # a line half-written
    c.interval(0, 2, window, 2, 0.1, None)
    with open(log, "a") as f:
        f.write(",0.0,0.5,8,2.0,0.1\n" + step_row(0, 3, 1.0, 0.1))  # step 2 waited 0 s
    c.interval(0, 4, window, 2, 0.1, None)
    c.interval(0, 5, window, 2, 0.1, None)  # rank 1 logged no step since: no point
    c.close()
    got = scalars(tmp_path / ckpt.CURVES)
    assert [(s, round(v, 3)) for s, v in got["train/data_wait_share/rank1"]] == [(2, 0.5), (4, round(0.1 / 1.5, 3))]
    assert [s for s, _ in got["train/data_wait_share/rank0"]] == [2, 4, 5]


def test_a_resumed_run_reads_a_peers_steps_after_the_resume_step_only_and_a_missing_log_gives_no_point(tmp_path):
    """Resumed at epoch 1 step 2 (global step 7): rank 1's rows of steps 6-7 are the earlier launch's."""
    (tmp_path / "telemetry").mkdir()
    (tmp_path / "telemetry" / "steps_rank1.csv").write_text(
        "rank,epoch,step,time,wall_s,data_wait_s,compute_s,images,loss,lr\n"
        + step_row(1, 0, 1.0, 0.9)
        + step_row(1, 1, 1.0, 0.9)
        + step_row(1, 2, 1.0, 0.2)
    )
    c = curves.Curves(tmp_path, steps_per_epoch=5, steps_done=5 + 2)
    c.interval(1, 3, Window(steps=1, wall_s=0.5, wait_s=0.1, images=8), 3, 0.1, None)  # rank 2 has no log here
    c.close()
    got = scalars(tmp_path / ckpt.CURVES)
    assert [(s, round(v, 3)) for s, v in got["train/data_wait_share/rank1"]] == [(8, 0.2)]
    assert "train/data_wait_share/rank2" not in got


def test_every_nodes_system_means_are_curves_node_0_as_before_and_node_k_named_by_its_number(tmp_path):
    header = "time,cpu_percent,iowait_percent,disk_read_mb_s,rss_mb,gpu0_util,gpu0_mem_used_mb\n"
    (tmp_path / "system_node0.csv").write_text(header + "100,50,10,,1,90,1000\n")
    (tmp_path / "system_node1.csv").write_text(header + "100,20,0,,1,30,500\n101,40,0,,1,50,700\n")
    (tmp_path / "system_node2.csv").write_text(header + "50,20,0,,1,30,500\n")  # an earlier launch's node
    got = curves.node_means(tmp_path, 100, 101)
    assert got == {
        "cpu_busy_percent": 50.0,
        "iowait_percent": 10.0,
        "gpu_util_percent/gpu0": 90.0,
        "gpu_mem_used_mb/gpu0": 1000.0,
        "cpu_busy_percent/node1": 30.0,
        "iowait_percent/node1": 0.0,
        "gpu_util_percent/node1_gpu0": 40.0,
        "gpu_mem_used_mb/node1_gpu0": 600.0,
    }
