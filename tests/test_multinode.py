"""The multi-node path on one machine: two torchrun "nodes" (one CPU process each) meeting through
c10d rendezvous on localhost train exactly like the standalone path with two processes."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers.train_data import packed_dataset, rows, tiny_train_config

from rectrain.train.lifecycle.checkpoint import load
from rectrain.train.local_copy import stage_key

TELEMETRY = [
    "model.pt",
    "checkpoints/last.pt",
    "checkpoints/epoch_0.pt",
    "steps.csv",
    "epochs.csv",
    "system.csv",
    "run.json",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_dataset(tmp_path_factory.mktemp("packed"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(cfg, data, out, extra=()):
    return [
        sys.executable,
        "-m",
        "rectrain.train",
        "--config-json",
        json.dumps(cfg),
        *data,
        "--out",
        str(out),
        *extra,
    ]


def clean_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith(("SLURM_", "RECTRAIN_"))
    }
    env.update(extra)
    return env


@pytest.mark.slow
def test_two_localhost_nodes_match_the_standalone_run(data, tmp_path):
    standalone = tmp_path / "standalone"
    # One CPU thread per rank in both runs, so the float maths (and so the weights) can be compared exactly.
    proc = subprocess.run(
        launch_cmd(tiny_train_config(epochs=1, cpu_processes=2), data, standalone, ["--threads", "2"]),
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--standalone" in proc.stderr

    multi = tmp_path / "multinode"
    cfg = tiny_train_config(epochs=1, cpu_processes=1, nodes=2)
    endpoint = f"127.0.0.1:{free_port()}"
    # Each "node" has its own node-local disk (TMPDIR) and stages the shared pair there first.
    nodes = [
        subprocess.Popen(
            launch_cmd(cfg, data, multi, ["--threads", "1", "--stage-to-local", "auto"]),
            env=clean_env(RECTRAIN_RDZV_ENDPOINT=endpoint, TMPDIR=str(tmp_path / f"local{n}")),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in range(2)
    ]
    logs = [p.communicate(timeout=240)[0] for p in nodes]
    for n, (p, log) in enumerate(zip(nodes, logs, strict=True)):
        assert p.returncode == 0, f"node {n}:\n{log[-3000:]}"
        assert "--nnodes=2" in log and "--rdzv_backend=c10d" in log and f"--rdzv_endpoint={endpoint}" in log
        # staged under the shared folder's name and its real path's hash (rectrain.train.local_copy.stage_key)
        staged = tmp_path / f"local{n}" / stage_key(data[data.index("--rec") + 1])
        assert (staged / "train.rec").is_file() and (staged / "val.idx").is_file(), log[-2000:]

    for name in TELEMETRY:
        assert (standalone / name).is_file(), name
        assert (multi / name).is_file(), f"multi-node run lacks {name}"

    info_s = json.loads((standalone / "run.json").read_text())
    info_m = json.loads((multi / "run.json").read_text())
    assert info_s["world_size"] == info_m["world_size"] == 2
    assert info_m["nodes"] == 2 and info_s["nodes"] == 1
    assert info_m["global_batch"] == info_s["global_batch"]

    steps_s, steps_m = rows(standalone / "steps.csv"), rows(multi / "steps.csv")
    assert list(steps_m[0]) == list(steps_s[0])
    assert {r["rank"] for r in steps_m} == {"0", "1"}
    assert len(steps_m) == len(steps_s)
    assert [r["loss"] for r in steps_m if r["rank"] == "0"] == [r["loss"] for r in steps_s if r["rank"] == "0"]
    assert list(rows(multi / "epochs.csv")[0]) == list(rows(standalone / "epochs.csv")[0])
    system = rows(multi / "system.csv")
    assert list(system[0]) == list(rows(standalone / "system.csv")[0])
    # Two nodes sampling into one shared directory must not interleave their rows.
    assert all(len(r) == len(system[0]) and all(float(v) >= 0 for v in r.values()) for r in system), system[:3]

    # Same ranks, same shards, same all-reduce: the two-node run learns exactly what the standalone one does.
    a, b = load(standalone / "model.pt"), load(multi / "model.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{k} differs between standalone and 2-node runs"
