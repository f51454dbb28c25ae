"""A working folder and a model folder shared with another user, as on a lab server (issue 47, items 3-6):
what the other user plants there is never imported, signalled or written through.  The other user (uid
OTHER_UID, setpriv) plants a json.py in the 0777 working folder, a graphlib.py and a colorsys.py beside
the victim's model file in a 0777 model folder, and a .snakemake/ of their own with its pid file a link
to a file of the victim's; the victim runs a pipeline there (the demo_data job, its model checked while
the Snakefile is parsed) and `make stop`.  Each planted module writes a marker when imported."""

import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
import yaml
from helpers import REPO, VENV_BIN, copy_workflow, snakemake, tiny_demo, tiny_train
from helpers.users import as_other_user, needs_root, shared_folder

pytestmark = [pytest.mark.slow, needs_root]

# The victim's own network: it imports colorsys, a standard-library module nothing else has imported yet.
NET = """
import colorsys

import torch


def tiny(num_classes):
    assert colorsys.rgb_to_hsv(1, 0, 0)[0] == 0
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, num_classes))
"""
# Run by the other user: the plants (argv: the shared folder).
PLANT = """
import os, sys
base = sys.argv[1]
def plant(path, name):
    with open(path, "w") as f:
        f.write(f"open({base + '/markers/' + name!r}, 'w').write('imported')\\n")
plant(base + "/work/json.py", "json")
plant(base + "/models/graphlib.py", "graphlib")
plant(base + "/models/colorsys.py", "colorsys")
os.mkdir(base + "/work/.snakemake")
os.chmod(base + "/work/.snakemake", 0o777)
os.symlink(base + "/victim/precious.txt", base + "/work/.snakemake/rectrain-run.pid")
"""
PRECIOUS = "the victim's own notes\n"


@pytest.fixture(scope="module")
def planted():
    """The shared folders with the other user's plants, and the victim's pipeline run in them."""
    with shared_folder() as base:
        for name, mode in (("markers", 0o777), ("models", 0o777), ("victim", 0o755)):
            (base / name).mkdir()
            (base / name).chmod(mode)
        (base / "victim" / "precious.txt").write_text(PRECIOUS)
        (base / "models" / "net.py").write_text(NET)
        work = copy_workflow(base / "work")
        work.chmod(0o777)
        proc = as_other_user(PLANT, base)
        assert proc.returncode == 0, proc.stderr
        config = {"demo": tiny_demo(train_per_class=4), "train": tiny_train(model=f"{base}/models/net.py:tiny")}
        (work / "shared.yaml").write_text(yaml.safe_dump(config))
        args = ["--directory", str(work), "--cores", "1", "results/demo/raw/.done", "--configfile", "shared.yaml"]
        run = snakemake(*args, cwd=work, snakefile=work / "Snakefile")
        yield SimpleNamespace(base=base, work=work, run=run, markers=base / "markers")


def test_a_json_py_planted_in_the_working_folder_is_never_imported_by_a_job(planted):
    out = planted.run.stdout + planted.run.stderr
    assert planted.run.returncode == 0, out[-3000:]
    assert "demo_data" in out
    assert not (planted.markers / "json").exists(), "the job imported the json.py planted in its working folder"


def test_stdlib_named_modules_planted_beside_the_model_file_are_never_imported_by_snakemake(planted):
    """The model was imported and checked in Snakemake's own process; the colorsys it imports and the
    graphlib Snakemake imports later are the standard library's."""
    assert planted.run.returncode == 0, (planted.run.stdout + planted.run.stderr)[-3000:]
    assert sorted(p.name for p in planted.markers.iterdir()) == []


def test_a_pid_file_link_in_another_users_snakemake_folder_is_never_written_through_or_deleted(planted):
    assert planted.run.returncode == 0
    assert (planted.base / "victim" / "precious.txt").read_text() == PRECIOUS


def test_make_stop_signals_no_process_another_user_names_in_a_shared_folder_and_deletes_nothing(planted):
    """The other user's pid file names the victim's `tail -f` of a Snakemake log: make stop leaves it be."""
    log = planted.work / ".snakemake" / "log" / "run.snakemake.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text("")
    tail = subprocess.Popen(["tail", "-f", str(log)], stdout=subprocess.DEVNULL)
    try:
        pid_file = planted.work / ".snakemake" / "rectrain-run.pid"
        swap = "import os, sys; os.unlink(sys.argv[1]); open(sys.argv[1], 'w').write(sys.argv[2] + '\\n')"
        assert as_other_user(swap, pid_file, tail.pid).returncode == 0
        env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        stop = subprocess.run(["make", "-f", str(REPO / "Makefile"), "stop"], cwd=planted.work, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        time.sleep(0.5)
        assert tail.poll() is None, f"make stop signalled the victim's own tail: {stop.stdout}{stop.stderr}"
        assert "no run is going in this folder" in stop.stdout, stop.stdout + stop.stderr
        assert (planted.base / "victim" / "precious.txt").read_text() == PRECIOUS
        assert pid_file.read_text().strip() == str(tail.pid), "make stop deletes nothing of the other user's"
    finally:
        tail.send_signal(signal.SIGKILL)
        tail.wait()
