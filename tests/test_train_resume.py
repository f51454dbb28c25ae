"""Resume decisions without training: train.resume (auto, always, never), moving a replaced run's
checkpoints aside instead of deleting them, pruning to train.keep_checkpoints, and the batch plan of
`batch_size: auto` reusing the checkpoint's (on CPU, and on a GPU faked at what the preflight measures)."""

import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.train_data import plan_batch_of, rank_parts, run_identity, train_settings

from rectrain import atomic
from rectrain.distributed import Dist
from rectrain.loaders import LoaderSpec
from rectrain.train import batchplan
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import identity as runid
from rectrain.train.lifecycle import resume as resume_mod
from rectrain.train.lifecycle.checkpoint import CheckpointSaver
from rectrain.train.lifecycle.resume import ResumeRefused, previous_plan, resume
from rectrain.train.lifecycle.status import FORCED_ENV

IDENT = run_identity(world_size=1)


def fake_run(tmp_path, mode="auto", identity=IDENT, batch_size=32):
    """What resume reads of a Run: its folder, config, ranks, identity, model and step states."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = SimpleNamespace(
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        ema=None,  # train.ema off
    )
    cfg = train_settings({**identity.config, "resume": mode, "batch_size": batch_size, "workers": 2})
    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    return SimpleNamespace(
        out=tmp_path,
        ck_dir=tmp_path / "checkpoints",
        settings=cfg,
        d=Dist(0, identity.world_size, 0, identity.world_size, torch.device("cpu")),
        identity=identity,
        model=model,
        step=step,
        plan=batchplan.BatchPlan(identity.batch_size, identity.grad_accum, identity.world_size),
    )


def write_checkpoints(run, epochs=2, identity=IDENT, finished=False):
    """epoch_0.pt .. epoch_<epochs-1>.pt and last.pt as a run with `identity` writes them."""
    state = {
        "model": run.model.state_dict(),
        "optimizer": run.step.optimizer.state_dict(),
        "scheduler": run.step.scheduler.state_dict(),
        "scaler": run.step.scaler.state_dict(),
        "ema": run.step.ema.module.state_dict() if run.step.ema is not None else None,
        "rng": [ckpt.rng_state()],
        "config": {**identity.config, "workers": 2},
        **identity.stamp(),
    }
    for epoch in range(epochs):
        ckpt.save_atomic({**state, "epoch": epoch}, run.ck_dir / f"epoch_{epoch}.pt")
    ckpt.save_atomic({**state, "epoch": epochs - 1}, run.ck_dir / "last.pt")
    if finished:
        CheckpointSaver(run.ck_dir).mark_finished(run.ck_dir.parent / "model.pt")


def replaced(ck_dir):
    return sorted((ck_dir / ckpt.REPLACED).iterdir())


def test_moving_aside_renames_every_checkpoint_into_a_folder_named_by_time_and_reason(tmp_path):
    for name in ("epoch_0.pt", "epoch_1.pt", "epoch_10.pt", "last.pt", ckpt.FINISHED, "notes.txt"):
        (tmp_path / name).write_text(name)
    inodes = {p.name: p.stat().st_ino for p in tmp_path.iterdir()}
    dest, moved = CheckpointSaver(tmp_path).move_aside("the train config changed (lr)")
    assert moved == ["epoch_0.pt", "epoch_1.pt", "epoch_10.pt", "last.pt", ckpt.FINISHED], "epochs by number"
    assert dest.parent == tmp_path / ckpt.REPLACED
    assert re.fullmatch(r"\d{8}T\d{6}Z-the-train-config-changed-lr", dest.name), dest.name
    for name in moved:
        assert (dest / name).read_text() == name, "nothing deleted"
        assert (dest / name).stat().st_ino == inodes[name], "renamed, not copied"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", ckpt.REPLACED]
    assert CheckpointSaver(tmp_path).move_aside("again") == (None, []), "nothing left to move: no empty folder"
    assert len(replaced(tmp_path)) == 1


def test_moving_aside_twice_in_one_second_keeps_both_runs(tmp_path):
    for _ in range(2):
        (tmp_path / "last.pt").write_text("x")
        CheckpointSaver(tmp_path).move_aside("train.resume is never")
    assert [len(list(d.iterdir())) for d in replaced(tmp_path)] == [1, 1]


def test_last_pt_is_the_epoch_checkpoint_under_a_second_name_and_a_later_save_replaces_last_pt_alone(tmp_path):
    import os

    epoch_file, last = tmp_path / "epoch_3.pt", tmp_path / "last.pt"
    ckpt.save_atomic({"epoch": 2}, last)  # the mid-epoch checkpoint the epoch's end replaces
    ckpt.save_atomic({"epoch": 3}, epoch_file)
    assert ckpt.save_linked({"epoch": 3}, epoch_file, last) is True
    assert os.path.samefile(epoch_file, last) and epoch_file.stat().st_nlink == 2, "one file on disk, two names"
    assert ckpt.load(last) == {"epoch": 3}
    ckpt.save_atomic({"epoch": 4, "step": 10}, last)  # the next epoch's mid-epoch checkpoint
    assert ckpt.load(epoch_file) == {"epoch": 3}, "the epoch checkpoint changed with last.pt"
    assert not os.path.samefile(epoch_file, last) and epoch_file.stat().st_nlink == 1


def test_last_pt_is_written_out_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    import os

    epoch_file, last = tmp_path / "epoch_0.pt", tmp_path / "last.pt"
    ckpt.save_atomic({"epoch": 0}, epoch_file)

    def no_links(*_):
        raise PermissionError(1, "Operation not permitted")  # what FAT, some FUSE and network mounts say

    monkeypatch.setattr(os, "link", no_links)
    assert ckpt.save_linked({"epoch": 0}, epoch_file, last) is False
    assert ckpt.load(last) == {"epoch": 0} and last.stat().st_nlink == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0.pt", "last.pt"], "no temporary file left"


def test_prune_keeps_the_newest_epoch_checkpoints_and_last_pt(tmp_path):
    for k in range(12):
        (tmp_path / f"epoch_{k}.pt").write_text("x")
    (tmp_path / "last.pt").write_text("x")
    (tmp_path / ckpt.REPLACED).mkdir()
    (tmp_path / ckpt.REPLACED / "epoch_0.pt").write_text("a replaced run's")
    gone = CheckpointSaver(tmp_path, keep=3).prune()
    assert gone == [f"epoch_{k}.pt" for k in range(9)], "by epoch number, not by name (epoch_10 > epoch_9)"
    assert ckpt.run_files(tmp_path) == ["epoch_9.pt", "epoch_10.pt", "epoch_11.pt", "last.pt"]
    assert (tmp_path / ckpt.REPLACED / "epoch_0.pt").exists(), "moved-aside runs are not pruned"
    assert CheckpointSaver(tmp_path, keep=3).prune() == []


def test_resume_auto_starts_over_on_a_config_difference_moving_the_checkpoints_aside(tmp_path, caplog):
    run = fake_run(tmp_path, "auto", dataclasses.replace(IDENT, config={"lr": 0.2, "epochs": 4}))
    write_checkpoints(run)
    with caplog.at_level(logging.INFO):
        decided = resume(run)
    assert decided == resume_mod.Resumed(0)
    (dest,) = replaced(run.ck_dir)
    assert sorted(p.name for p in dest.iterdir()) == ["epoch_0.pt", "epoch_1.pt", "last.pt"]
    assert "the train config changed (lr)" in caplog.text and f"aside to {dest}" in caplog.text


def test_resume_always_continues_across_a_config_and_code_difference_and_names_them(tmp_path, caplog):
    changed = dataclasses.replace(IDENT, config={"lr": 0.2, "epochs": 4}, code={**IDENT.code, "train.py": "edited"})
    run = fake_run(tmp_path, "always", changed)
    write_checkpoints(run)
    with caplog.at_level(logging.INFO):
        decided = resume(run)
    assert decided.start_epoch == 2 and decided.rng_states
    assert decided.despite == ("the train config changed (lr)", "the training code changed (train.py)")
    assert "despite the train config changed (lr); the training code changed (train.py)" in caplog.text
    assert not (run.ck_dir / ckpt.REPLACED).exists() and (run.ck_dir / "last.pt").exists()


def test_resume_always_refuses_another_batch_plan_on_the_same_world_size_naming_it(tmp_path):
    changes = {"batch_size": 16, "grad_accum": 2}
    run = fake_run(tmp_path, "always", dataclasses.replace(IDENT, config={"lr": 0.2, "epochs": 4}, **changes))
    write_checkpoints(run)
    with pytest.raises(ResumeRefused) as err:
        resume(run)
    named = "the chosen batch changed (32 x accum 1 then, 16 x accum 2 now)"
    assert named in str(err.value) and "train.resume: auto" in str(err.value)
    assert "the train config changed" not in str(err.value), "only what cannot be crossed is named"
    assert ckpt.run_files(run.ck_dir) == ["epoch_0.pt", "epoch_1.pt", "last.pt"], "refusing touches nothing"


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_another_world_size_that_cannot_keep_the_global_batch_is_refused_naming_both_plans_and_the_fix(tmp_path, mode):
    run = fake_run(tmp_path, mode, dataclasses.replace(IDENT, batch_size=11, world_size=3))  # 33, not 32
    write_checkpoints(run)
    with pytest.raises(ResumeRefused) as err:
        resume(run)
    text = str(err.value)
    assert "32 x accum 1 x 1 process(es) = global batch 32" in text, "the checkpoint's plan"
    assert "11 x accum 1 x 3 process(es) = global batch 33" in text, "this run's plan"
    assert "divides it (1, 2, 4, 8, 16, 32: train.devices, train.cpu_processes" in text, "the setting that keeps it"
    assert ckpt.run_files(run.ck_dir) == ["epoch_0.pt", "epoch_1.pt", "last.pt"], "refusing touches nothing"


def regrouped_run(tmp_path, mode="auto"):
    """A run on 2 processes planning 16 x accum 1 (global batch 32): the checkpoints' 32 x 1 x 1 regrouped,
    its config naming the other process count (train.cpu_processes: not a config difference)."""
    ident = dataclasses.replace(IDENT, batch_size=16, world_size=2, config={**IDENT.config, "cpu_processes": 2})
    run = fake_run(tmp_path, mode, ident)
    run.d = Dist(0, 1, 0, 1, torch.device("cpu"))  # rank 0's decision alone: no process group here
    return run


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_an_epoch_end_checkpoint_resumes_on_another_world_size_with_its_global_batch_as_the_same_run(
    tmp_path, caplog, mode
):
    run = regrouped_run(tmp_path, mode)
    write_checkpoints(run, identity=dataclasses.replace(IDENT, config={**IDENT.config, "cpu_processes": 1}))
    with caplog.at_level(logging.INFO):
        decided = resume(run)
    assert (decided.start_epoch, decided.start_step, decided.despite) == (2, 0, ())
    assert decided.regrouped and decided.rng_states is None, "the old ranks' RNG streams are not continued"
    assert decided.world_sizes == (
        {"epoch": 0, "world_size": 1, "batch_size": 32, "grad_accum": 1},
        {"epoch": 2, "world_size": 2, "batch_size": 16, "grad_accum": 1},
    )
    assert "it was trained with 32 x accum 1 x 1 process(es) = global batch 32" in caplog.text
    assert "keeps its global batch with 16 x accum 1 x 2 process(es) = global batch 32" in caplog.text
    assert not (run.ck_dir / ckpt.REPLACED).exists(), "a resume, not a new run"


def lamb_and_ema(model, steps: int):
    """timm's Lamb after `steps` steps (its moments and step counts) and timm's ModelEmaV3 of `model` after as
    many updates, as a run with train.optimizer lamb and train.ema holds them."""
    from timm.optim import Lamb
    from timm.utils import ModelEmaV3

    opt, ema = Lamb(model.parameters(), lr=0.01), ModelEmaV3(model, decay=0.9, use_warmup=True)
    for k in range(steps):
        model(torch.full((1, 2), float(k + 1))).sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update(model, step=k + 1)
    return opt, ema


def test_lambs_state_and_the_ema_resume_exactly_on_another_world_size(tmp_path):
    """A checkpoint of 1 process continued on 2: LAMB's moments and step counts and the weights' EMA are the
    checkpoint's, bit for bit (the optimizer and the EMA are the same on every rank: nothing to re-split)."""
    run = regrouped_run(tmp_path)
    run.step.optimizer, run.step.ema = lamb_and_ema(run.model, 3)
    run.step.scheduler = torch.optim.lr_scheduler.LambdaLR(run.step.optimizer, lambda s: 1.0)
    write_checkpoints(run, identity=dataclasses.replace(IDENT, config={**IDENT.config, "cpu_processes": 1}))
    saved = ckpt.load(run.ck_dir / "last.pt")
    run.step.optimizer, run.step.ema = lamb_and_ema(run.model, 1)  # the new run's, before the resume
    run.step.scheduler = torch.optim.lr_scheduler.LambdaLR(run.step.optimizer, lambda s: 1.0)
    assert resume(run).regrouped
    restored = run.step.optimizer.state_dict()
    assert int(restored["param_groups"][0]["step"]) == 3
    for i, state in saved["optimizer"]["state"].items():
        assert all(torch.equal(v, restored["state"][i][k]) for k, v in state.items())
    assert all(torch.equal(v, run.step.ema.module.state_dict()[k]) for k, v in saved["ema"].items())


def test_a_mid_epoch_checkpoint_on_another_world_size_restarts_its_epoch_from_the_checkpoint_before_it(
    tmp_path, caplog
):
    run = regrouped_run(tmp_path)
    write_checkpoints(run)  # epoch_0.pt, epoch_1.pt
    at_epoch_start = {k: v.clone() for k, v in run.model.state_dict().items()}
    state = ckpt.load(run.ck_dir / "last.pt")
    moved = {k: v + 1 for k, v in state["model"].items()}
    ckpt.save_atomic({**state, "model": moved, "epoch": 2, "step": 5, "ranks": [{}]}, run.ck_dir / "last.pt")
    with caplog.at_level(logging.INFO):
        decided = resume(run)
    assert (decided.start_epoch, decided.start_step, decided.ranks) == (2, 0, None)
    assert all(torch.equal(v, at_epoch_start[k]) for k, v in run.model.state_dict().items()), "epoch_1.pt's weights"
    assert "epoch 2 restarts from its start (epoch_1.pt), repeating those 5 steps" in caplog.text


def test_a_mid_epoch_checkpoint_of_epoch_0_on_another_world_size_starts_over_saying_what_it_repeats(tmp_path, caplog):
    run = regrouped_run(tmp_path)
    write_checkpoints(run, epochs=1)
    CheckpointSaver(run.ck_dir, keep=1).prune()
    (run.ck_dir / "epoch_0.pt").unlink()
    state = ckpt.load(run.ck_dir / "last.pt")
    ckpt.save_atomic({**state, "epoch": 0, "step": 3, "ranks": [{}]}, run.ck_dir / "last.pt")
    with caplog.at_level(logging.INFO):
        decided = resume(run)
    assert decided.start_epoch == 0 and not decided.continues
    assert (
        "no checkpoint holds that start (it is the first epoch), so the run starts from epoch 0 (repeating 3 steps)"
        in (caplog.text)
    )


def test_resume_never_starts_over_even_the_same_run_moving_its_checkpoints_aside(tmp_path, caplog):
    run = fake_run(tmp_path, "never")
    write_checkpoints(run)
    with caplog.at_level(logging.INFO):
        assert resume(run) == resume_mod.Resumed(0)
    (dest,) = replaced(run.ck_dir)
    assert dest.name.endswith("-train-resume-is-never") and ckpt.run_files(run.ck_dir) == []
    assert "train.resume is never" in caplog.text


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_finished_run_started_again_moves_its_checkpoints_aside_in_every_mode(tmp_path, mode):
    run = fake_run(tmp_path, mode)
    write_checkpoints(run, finished=True)
    assert resume(run).start_epoch == 0
    (dest,) = replaced(run.ck_dir)
    assert sorted(p.name for p in dest.iterdir()) == ["epoch_0.pt", "epoch_1.pt", ckpt.FINISHED, "last.pt"]


def write_finished_run(run, identity=IDENT):
    """A finished run as outputs.finish leaves it: checkpoints, the published outputs kept in
    checkpoints/finished/ and finished.json; then Snakemake's removal of the published outputs."""
    write_checkpoints(run, identity=identity)
    for name in ckpt.PUBLISHED:
        (run.out / name).write_text(f"{name} of the finished run")
    CheckpointSaver(run.ck_dir).keep_finished(run.out)
    CheckpointSaver(run.ck_dir).mark_finished(run.out / "model.pt")
    for name in ckpt.PUBLISHED:
        (run.out / name).unlink()


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_finished_run_whose_outputs_are_kept_is_republished_not_trained(tmp_path, monkeypatch, caplog, mode):
    monkeypatch.delenv(FORCED_ENV, raising=False)
    run = fake_run(tmp_path, mode)
    write_finished_run(run)
    caplog.set_level(logging.INFO)
    decided = resume(run)
    assert decided.restored and decided.start_epoch == run.settings.optim.epochs
    assert [(run.out / n).read_text() for n in ckpt.PUBLISHED] == [f"{n} of the finished run" for n in ckpt.PUBLISHED]
    assert "restored the finished run's outputs" in caplog.text and "no training needed" in caplog.text
    assert not (run.ck_dir / ckpt.REPLACED).exists() and (run.ck_dir / "last.pt").exists()


def test_a_finished_run_forced_by_snakemake_starts_over_with_its_kept_outputs_moved_aside(tmp_path, monkeypatch):
    monkeypatch.setenv(FORCED_ENV, "1")
    run = fake_run(tmp_path)
    write_finished_run(run)
    decided = resume(run)
    assert not decided.restored and decided.start_epoch == 0
    (dest,) = replaced(run.ck_dir)
    assert "forced-rerun" in dest.name and (dest / ckpt.KEPT / "model.pt").read_text() == "model.pt of the finished run"
    assert not (run.out / "model.pt").exists()


def test_a_finished_run_of_another_config_is_not_republished_and_says_what_differs(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(FORCED_ENV, raising=False)
    run = fake_run(tmp_path, identity=dataclasses.replace(IDENT, config={**IDENT.config, "lr": 0.05}))
    write_finished_run(run)
    caplog.set_level(logging.INFO)
    assert resume(run).start_epoch == 0
    (dest,) = replaced(run.ck_dir)
    assert (dest / ckpt.KEPT).is_dir() and "the train config changed (lr)" in caplog.text
    assert not (run.out / "model.pt").exists()


# --- batch_size auto reuses the checkpoint's plan ----------------------------------------------------


AUTO = train_settings({"batch_size": "auto", "global_batch": 256, "grad_accum": 1})


def test_the_checkpoints_plan_is_read_from_last_pt_for_batch_size_auto_only(tmp_path):
    ident = dataclasses.replace(IDENT, batch_size=43, grad_accum=3, world_size=2)
    run = fake_run(tmp_path, "auto", ident, batch_size="auto")
    write_checkpoints(run, identity=ident)
    found = previous_plan(run.ck_dir, run.settings.stops.resume)
    assert (found.batch, found.grad_accum, found.world_size) == (43, 3, 2)
    numeric = previous_plan(run.ck_dir, run.settings.stops.resume)  # it takes no train.batch_size: 32 reads it too
    assert numeric.global_batch == 43 * 3 * 2, "a numeric batch keeps it on another world size (regroup)"
    other = runid.maths_config({**run.settings.as_dict(), "lr": 9.0})
    assert previous_plan(run.ck_dir, run.settings.stops.resume, other) is None, "another run's plan"
    assert previous_plan(run.ck_dir, run.settings.replaced(resume="never").stops.resume) is None


def finished_run_replaced_by_an_lr_edit(run):
    """A finished run (IDENT), moved aside by a run with another lr that was then stopped after epoch 0."""
    write_finished_run(run)
    CheckpointSaver(run.ck_dir).move_aside("the train config changed (lr)")
    write_checkpoints(run, epochs=1, identity=dataclasses.replace(IDENT, config={**IDENT.config, "lr": 0.05}))
    return replaced(run.ck_dir)[0]


def test_a_finished_run_moved_aside_is_brought_back_and_republished_when_the_config_is_edited_back(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.delenv(FORCED_ENV, raising=False)
    run = fake_run(tmp_path)
    old = finished_run_replaced_by_an_lr_edit(run)
    caplog.set_level(logging.INFO)
    assert resume(run).restored
    assert f"brought back the finished run moved aside to {old}" in caplog.text
    assert (run.out / "model.pt").read_text() == "model.pt of the finished run"
    assert not old.exists() and (run.ck_dir / ckpt.FINISHED).exists()
    (lr_run,) = replaced(run.ck_dir)  # the stopped lr run, kept aside in its turn
    assert sorted(p.name for p in lr_run.iterdir()) == ["epoch_0.pt", "last.pt"]
    assert ckpt.load(lr_run / "last.pt")["config"]["lr"] == 0.05


def test_a_forced_job_does_not_bring_back_a_finished_run_moved_aside(tmp_path, monkeypatch):
    monkeypatch.setenv(FORCED_ENV, "1")
    run = fake_run(tmp_path)
    old = finished_run_replaced_by_an_lr_edit(run)
    decided = resume(run)
    assert decided.start_epoch == 0 and not decided.restored and old.exists()


def test_a_finished_runs_plan_is_reused_only_when_it_may_be_republished(tmp_path, monkeypatch):
    ident = dataclasses.replace(IDENT, batch_size=43, grad_accum=3)
    run = fake_run(tmp_path, "auto", ident, batch_size="auto")
    write_finished_run(run, identity=ident)
    monkeypatch.delenv(FORCED_ENV, raising=False)
    found = previous_plan(run.ck_dir, run.settings.stops.resume)
    assert (found.batch, found.grad_accum) == (43, 3)
    monkeypatch.setenv(FORCED_ENV, "1")
    assert previous_plan(run.ck_dir, run.settings.stops.resume) is None, "a forced rerun plans afresh"


def test_auto_batch_on_cpu_reuses_the_checkpoints_plan_as_is():
    d = Dist(0, 2, 0, 2, torch.device("cpu"))
    previous = batchplan.BatchPlan(43, 3, 2)  # planned on a GPU where 50 fitted
    chosen = batchplan.plan_batch(AUTO.batch, d, previous=previous)
    assert (chosen.batch, chosen.grad_accum, chosen.world_size) == (43, 3, 2) and chosen.auto
    assert "the checkpoint's plan 43 x accum 3 reused" in chosen.reason
    four = batchplan.plan_batch(AUTO.batch, Dist(0, 4, 0, 4, torch.device("cpu")), previous=previous)
    assert (four.batch, four.grad_accum) == (64, 1), "4 processes cannot split its 258: planned afresh"


@pytest.mark.parametrize(
    "batch_size,previous,world,want",
    [
        ("auto", (4, 1, 2), 1, (4, 2)),  # 2 -> 1 on CPU: the micro-batch kept, grad_accum doubled
        ("auto", (4, 2, 1), 2, (4, 1)),  # and back
        (4, (4, 1, 2), 1, (4, 2)),  # a numeric batch alike
        (4, (4, 1, 1), 2, (2, 1)),  # 1 -> 2 with nothing to halve: a smaller per-device batch
        (8, (8, 3, 1), 2, (6, 2)),  # 24 over 2: 12 per device, at most 8 at once, exactly
    ],
)
def test_a_plan_on_another_world_size_keeps_the_checkpoints_global_batch(batch_size, previous, world, want):
    part = train_settings({"batch_size": batch_size, "global_batch": 256, "grad_accum": 1}).batch
    old = batchplan.BatchPlan(*previous)
    chosen = batchplan.plan(part, world, previous=old, train_images=45)
    assert (chosen.batch, chosen.grad_accum) == want and chosen.global_batch == old.global_batch
    assert f"the checkpoint's global batch {old.global_batch}" in chosen.reason


def test_another_process_count_is_not_a_train_config_difference_but_a_world_size_one():
    ident = dataclasses.replace(IDENT, config={**IDENT.config, "cpu_processes": 2, "batch_size": 16})
    state = {**dataclasses.replace(IDENT, config={**IDENT.config, "cpu_processes": 1}).stamp(), "config": IDENT.config}
    assert [d.item for d in runid.differences(state, dataclasses.replace(ident, world_size=2))] == ["world_size"]


@pytest.fixture
def fake_gpu_preflight(monkeypatch):
    """plan_batch on a 'GPU' whose preflight measures that at most `fits[0]` samples fit per device."""
    fits = [128]
    monkeypatch.setattr(batchplan, "preflight_inputs", lambda *a, **k: (None, ()))
    monkeypatch.setattr(batchplan.GpuInfo, "of", classmethod(lambda cls, device: batchplan.GpuInfo(0, "fake", 11264.0)))
    monkeypatch.setattr(
        batchplan,
        "device_budget",
        lambda device, held, headroom=1.0: SimpleNamespace(available_bytes=10 * 2**30, held=()),
    )
    monkeypatch.setattr(batchplan, "cuda_try_step", lambda trial, budget: lambda batch: batch * 10.0)
    monkeypatch.setattr(
        batchplan, "preflight", lambda try_step, want, **kw: (fits[0], {"auto": True, "why_lower": None})
    )
    model = torch.nn.Linear(2, 2)
    d = Dist(0, 1, 0, 1, torch.device("cuda", 0))
    return fits, lambda previous: plan_batch_of(
        AUTO, d, rank_parts(AUTO, model, None, d, spec=LoaderSpec("", "", 0, 32)), previous=previous
    )


def test_auto_batch_on_a_gpu_with_more_memory_free_now_reuses_the_checkpoints_smaller_plan(fake_gpu_preflight):
    fits, choose = fake_gpu_preflight
    fits[0] = 128  # more fits now than when the checkpoint was written at 64 x 4 (one process, 256)
    chosen = choose(batchplan.BatchPlan(64, 4, 1))
    assert (chosen.batch, chosen.grad_accum) == (64, 4)
    assert chosen.preflight["batch"] == 64 and chosen.preflight["grad_accum"] == 4, "run.json says what ran"
    assert (choose(None).batch, choose(None).grad_accum) == (128, 2), "without a checkpoint: the largest"


def test_auto_batch_whose_checkpoint_plan_no_longer_fits_plans_afresh_naming_both(fake_gpu_preflight, caplog):
    fits, choose = fake_gpu_preflight
    fits[0] = 50  # less free memory than when 64 x 4 was planned
    with caplog.at_level(logging.INFO):
        chosen = choose(batchplan.BatchPlan(64, 4, 1))
    assert (chosen.batch, chosen.grad_accum) == (43, 6)
    for part in ("the checkpoint's plan 64 x accum 4 is not reused", "no longer fits", "this run plans 43 x accum 6"):
        assert part in chosen.reason and part in caplog.text


def test_replaced_keeps_the_newest_keep_replaced_runs_naming_what_it_deletes_and_its_size(tmp_path, caplog):
    """Each start-over moves a run aside; train.keep_replaced 2 deletes the oldest beyond two, and the
    line gives the folder's size with a hard-linked last.pt counted once."""
    for k in range(3):
        ckpt.save_atomic({"w": torch.zeros(1000)}, tmp_path / f"epoch_{k}.pt")
        ckpt.save_linked({"w": torch.zeros(1000)}, tmp_path / f"epoch_{k}.pt", tmp_path / "last.pt")
        with caplog.at_level(logging.INFO):
            CheckpointSaver(tmp_path, keep_replaced=2).start_over(f"edit {k}")
    runs = replaced(tmp_path)
    assert [p.name.split("-", 1)[1] for p in runs] == ["edit-1", "edit-2"]
    one = (runs[0] / "epoch_1.pt").stat().st_size
    assert ckpt.disk_bytes(tmp_path / ckpt.REPLACED) == 2 * one, "last.pt is a hard link: counted once"
    assert f"{tmp_path / ckpt.REPLACED} holds 2 replaced run(s)" in caplog.text
    assert (
        "(train.keep_replaced: 2 unfinished runs with a checkpoint); deleted the oldest unfinished: " in caplog.text
        and "-edit-0" in caplog.text
    )


# ---- issue 47 item 10: a crafted checkpoint, resume: always below its epoch, a killed write's leftovers ----


def crafted(run, **changes):
    """last.pt as write_checkpoints writes it (epoch 1 of 4), with `changes`."""
    write_checkpoints(run)
    state = ckpt.load(run.ck_dir / "last.pt")
    ckpt.save_atomic({**state, **changes}, run.ck_dir / "last.pt")


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"rng": []}, "its RNG states (0 entries) are not one per each of its 1 processes"),
        ({"epoch": 10**9}, "epoch 1000000000 is not an epoch of its run (4 epochs)"),
        ({"epoch": -1}, "epoch -1 is not an epoch of its run"),
        ({"step": 3, "ranks": None}, "its mid-epoch loader positions are not one per each of its 1 processes"),
    ],
)
def test_a_crafted_checkpoints_epoch_or_rng_state_is_refused_naming_the_file_and_the_fix(tmp_path, changes, said):
    run = fake_run(tmp_path, "auto")
    crafted(run, **changes)
    with pytest.raises(ResumeRefused) as err:
        resume(run)
    assert f"{run.ck_dir / 'last.pt'} is damaged: {said}" in str(err.value)
    assert "train.resume: never" in str(err.value)
    assert ckpt.run_files(run.ck_dir) == ["epoch_0.pt", "epoch_1.pt", "last.pt"], "refusing touches nothing"


def test_resume_always_below_the_checkpoints_epoch_is_refused_naming_both_numbers(tmp_path):
    """A checkpoint of 5 epochs done (epoch 4) and train.epochs: 2 would publish at once, run.json saying
    2 epochs and epochs.csv holding 5 rows."""
    ten = dataclasses.replace(IDENT, config={"lr": 0.1, "epochs": 10})
    run = fake_run(tmp_path, "always", dataclasses.replace(IDENT, config={"lr": 0.1, "epochs": 2}))
    write_checkpoints(run, epochs=5, identity=ten)
    with pytest.raises(ResumeRefused) as err:
        resume(run)
    line = str(err.value)
    assert "it holds 5 epochs done, beyond train.epochs = 2" in line and "Set train.epochs >= 5" in line


def test_the_next_start_removes_the_temporaries_of_a_checkpoint_write_that_was_killed(tmp_path):
    run = fake_run(tmp_path, "auto")
    write_checkpoints(run)
    killed = (
        "import os, signal, sys\n"
        "from rectrain import atomic\n"
        "tmp, fd = atomic.create_temporary(sys.argv[1])\n"
        "os.write(fd, b'half a checkpoint')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    for name in ("epoch_2.pt", "last.pt"):
        proc = subprocess.run([sys.executable, "-c", killed, str(run.ck_dir / name)], timeout=60)
        assert proc.returncode == -signal.SIGKILL
    live, fd = atomic.create_temporary(run.ck_dir / "epoch_3.pt")  # this process's own: it is alive
    os.close(fd)
    left = sorted(p.name for p in run.ck_dir.iterdir() if ".tmp" in p.name)
    assert len(left) == 3
    resume(run)
    assert [p.name for p in run.ck_dir.iterdir() if ".tmp" in p.name] == [live.name]


# ---- issue 50: a finished run is never deleted by the bound; a branch from another run's checkpoint ----


def test_a_finished_run_survives_any_number_of_start_overs_diverged_ones_included_keeping_all_it_published(
    tmp_path, monkeypatch, caplog
):
    """keep_replaced 1 exceeded many times over, by unfinished runs and by diverged ones without a
    checkpoint: the finished run moved aside stays whole, its evaluation and report with it, and the log
    names what is kept and where."""
    monkeypatch.delenv(FORCED_ENV, raising=False)
    out = tmp_path / "results" / "demo" / "main" / "train"
    out.mkdir(parents=True)
    run = fake_run(out)
    write_finished_run(run)
    (out / "weights.json").write_text('{"top1": 0.5}')
    (out.parent / "eval").mkdir()
    (out.parent / "eval" / "metrics.json").write_text('{"top1": 0.5}')
    (out.parent / "eval" / "per_class.csv").write_text("class,top1\n")
    (out.parent / "report.html").write_text("<html>the finished run's report</html>")
    caplog.set_level(logging.INFO)
    CheckpointSaver(run.ck_dir, keep_replaced=1).start_over("the train config changed (lr)")
    (kept,) = replaced(run.ck_dir)
    for k in range(4):  # unfinished runs with a checkpoint, and diverged ones before their first
        if k % 2 == 0:
            write_checkpoints(run, epochs=1)
        else:
            (run.ck_dir / ckpt.DIVERGED).write_text("{}")
        CheckpointSaver(run.ck_dir, keep_replaced=1).start_over(f"edit {k}")
    left = replaced(run.ck_dir)
    assert kept in left, "the finished run is never deleted"
    assert [ckpt.takes_slot(p) for p in left].count(True) == 1, "one unfinished run with a checkpoint (keep_replaced 1)"
    assert sum((p / ckpt.DIVERGED).is_file() for p in left) == 2, "the diverged runs took no slot"
    published = sorted(str(p.relative_to(kept / ckpt.KEPT)) for p in (kept / ckpt.KEPT).rglob("*.*"))
    assert published == sorted(
        [*ckpt.PUBLISHED, "weights.json", "eval/metrics.json", "eval/per_class.csv", "report.html"]
    )
    assert (kept / ckpt.KEPT / "report.html").read_text() == "<html>the finished run's report</html>"
    assert f"finished runs are never deleted: {kept.name} kept whole" in caplog.text
    assert "deleted the oldest unfinished: " in caplog.text


def test_resume_from_branches_a_new_run_from_another_runs_epoch_checkpoint_with_its_weights_and_optimizer(
    tmp_path, caplog
):
    """The branch's first step continues from the parent's epoch_<k>.pt: its weights, optimizer and LR
    schedule are the checkpoint's, it trains from epoch k+1, and run.json's parent names the checkpoint."""
    parent_out = tmp_path / "results" / "demo" / "base" / "train"
    parent_out.mkdir(parents=True)
    parent = fake_run(parent_out)
    with torch.no_grad():
        parent.model.weight.fill_(0.25)
    parent.step.optimizer.step()  # a momentum buffer in the optimizer's state
    write_checkpoints(parent, epochs=3)
    chosen = parent.ck_dir / "epoch_1.pt"
    branch_out = tmp_path / "results" / "demo" / "branch" / "train"
    branch_out.mkdir(parents=True)
    run = fake_run(branch_out)
    run.settings = run.settings.replaced(resume_from=str(chosen))
    assert not run.model.weight.eq(0.25).all()
    caplog.set_level(logging.INFO)
    decided = resume(run)
    assert decided.start_epoch == 2 and decided.regrouped and not decided.rng_states
    assert run.model.weight.eq(0.25).all(), "the branch starts from the checkpoint's weights"
    assert run.step.optimizer.state_dict()["state"] == ckpt.load(chosen)["optimizer"]["state"]
    assert decided.parent["run"] == "base" and decided.parent["epoch"] == 1
    assert decided.parent["checkpoint"] == str(chosen) and len(decided.parent["sha256"]) == 64
    assert "branching from" in caplog.text and ckpt.run_files(parent.ck_dir)[:3] == [
        "epoch_0.pt",
        "epoch_1.pt",
        "epoch_2.pt",
    ], "the parent's checkpoints untouched"
    with pytest.raises(ResumeRefused, match="raise train.epochs above"):
        run.settings = run.settings.replaced(resume_from=str(parent.ck_dir / "last.pt"), epochs=2)
        resume_mod.branch(run, parent.ck_dir / "last.pt")
