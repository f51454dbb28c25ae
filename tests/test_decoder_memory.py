"""bench/decoder_memory.py, the device run's decoder-memory part (issue 23, point 8), rehearsed on the CPU:
it must work before it costs device time."""

import json
import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.slow  # 9 s of DALI pipelines: make test, not make check
def test_the_decoder_memory_rehearsal_runs_every_variant_padding_and_thread_count_through_rectrains_loader(tmp_path):
    out = tmp_path / "tables"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "decoder_memory.py"),
            "--dry",
            "--out",
            str(out),
            "--scratch",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "decoder_memory.json").read_text())["results"]
    assert list(results) == ["original", "longest 500", "shorter 256"]
    assert results["original"]["largest"] == "1600x1200"
    assert results["longest 500"]["largest"] in ("500x375", "400x500", "375x500")
    for res in results.values():
        assert [(r["padding_mib"] == 0, r["threads"]) for r in res["rows"]] == [(True, 1), (True, 4), (False, 4)]
        # 17 images in batches of 32: one padded batch per epoch, from rectrain's own DALI train loader.
        assert all(r["batches"] == 1 and r["mib"] is None for r in res["rows"])
    table = (out / "decoder_memory.md").read_text()
    assert table.count("\n| ") == 1 + 9 and "no GPU, no memory measured (dry run)" in table
    assert not list(tmp_path.glob("decoder_memory_*")), "the variants' .rec files were left in the scratch folder"
