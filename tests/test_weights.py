"""The published weights file (rectrain.weights, rectrain.model.load_weights): torchvision's own key
names, rebuilt from the file alone (BlurPool included), a backbone view without the head; a header is
data, never code (issue 47: a factory it names is refused, yours only through the name you give), and
the file follows the umask."""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch
import torchvision
from helpers.users import as_other_user, needs_root, shared_folder
from safetensors.torch import load_file

from rectrain import model as models
from rectrain import weights

CLASSES = [{"label": str(k), "wnid": f"n0000000{k}", "name": f"class {k}"} for k in range(3)]


def publish(tmp_path, blurpool: bool, channels_last: bool = False):
    torch.manual_seed(0)
    net = models.build("resnet18", len(CLASSES), channels_last, blurpool=blurpool).eval()
    about = weights.describe(
        32,
        None,
        {"model": "resnet18", "blurpool": blurpool},
        CLASSES,
        epoch=2,
        recipe={"lr": 0.1},
    )
    path = tmp_path / weights.FILE
    weights.save(net.state_dict(), about, path)
    return net, path


def test_a_channels_last_network_is_published_and_loads_strict_into_torchvision_giving_the_same_logits(tmp_path):
    net, path = publish(tmp_path, blurpool=False, channels_last=True)
    plain = torchvision.models.get_model("resnet18", num_classes=3)
    plain.load_state_dict(load_file(str(path)), strict=True)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(plain.eval()(x), net(x), rtol=0, atol=1e-5)


def test_the_header_describes_classes_normalisation_and_epochs(tmp_path):
    _, path = publish(tmp_path, blurpool=False)
    about = weights.description(path)
    assert [c["wnid"] for c in about["classes"]] == ["n00000000", "n00000001", "n00000002"]
    assert about["classes"][1] == {"label": 1, "wnid": "n00000001", "name": "class 1"}
    assert about["normalisation"]["mean"] == [0.485, 0.456, 0.406]
    assert about["normalisation"]["std"] == [0.229, 0.224, 0.225]
    assert (about["epochs_trained"], about["train_resolution"], about["crop_ratio"]) == (2, 32, 0.875)


def test_a_blurpool_network_is_refused_by_plain_torchvision_and_rebuilt_by_load_weights(tmp_path):
    net, path = publish(tmp_path, blurpool=True)
    with pytest.raises(RuntimeError, match="conv.weight"):
        torchvision.models.get_model("resnet18", num_classes=3).load_state_dict(load_file(str(path)), strict=True)
    rebuilt = models.load_weights(path)
    assert any(isinstance(m, models.BlurPoolConv2d) for m in rebuilt.modules())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(rebuilt(x), net(x), rtol=0, atol=1e-5)


def test_the_backbone_view_returns_the_features_the_head_reads(tmp_path):
    net, path = publish(tmp_path, blurpool=False)
    features = models.load_weights(path, backbone=True)
    x = torch.randn(2, 3, 32, 32)
    f = features(x)
    assert f.shape == (2, 512)
    torch.testing.assert_close(net.fc(f), net(x), rtol=0, atol=1e-5)


def test_a_safetensors_file_not_published_by_rectrain_is_refused_naming_what_to_do(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not published by rectrain"):
        models.load_weights(tmp_path / "other.safetensors")


# ---- issue 47 items 1, 9: a weights file runs no code, and follows the umask ----------------------

# The other user's helper: a marker written the moment it is imported, and again when its factory runs.
HELPER = """
MARKER = {marker!r}
open(MARKER, "a").write("imported\\n")


def build(num_classes):
    import torch

    open(MARKER, "a").write("built\\n")
    return torch.nn.Linear(4, num_classes)
"""
# Run as the other user (argv: the shared folder): their helper.py and a weights file naming it.
SHARE = """
import json, sys
import torch
from safetensors.torch import save_file
base = sys.argv[1]
open(base + "/helper.py", "w").write(sys.argv[2])
about = {"model": base + "/helper.py:build", "num_classes": 3, "classes": [], "train_resolution": 32}
save_file({"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}, base + "/weights.safetensors",
          metadata={"rectrain": json.dumps(about)})
"""


@pytest.fixture(scope="module")
def shared_weights():
    """A weights.safetensors another user shared in a folder every user reaches, whose header names a
    factory in their own helper.py; (the file, the marker its code would write)."""
    with shared_folder() as base:
        base.chmod(0o1777)
        marker = base / "ran"
        made = as_other_user(SHARE, base, HELPER.format(marker=str(marker)))
        assert made.returncode == 0, made.stderr
        yield base / "weights.safetensors", marker


@needs_root
def test_a_weights_file_naming_a_factory_of_its_own_is_refused_by_load_weights_and_its_code_never_runs(
    shared_weights,
):
    path, marker = shared_weights
    with pytest.raises(
        models.WeightsRefused, match=r"a model of its own .*helper.py:build.*never makes rectrain import"
    ):
        models.load_weights(path)
    assert not marker.exists(), marker.read_text()


@needs_root
def test_the_check_stage_refuses_a_weights_file_naming_a_factory_of_its_own_and_its_code_never_runs(
    shared_weights, tmp_path
):
    path, marker = shared_weights
    argv = ["--config-json", json.dumps({"weights": str(path)}), "--rec", "v.rec", "--idx", "v.idx"]
    argv += ["--classes", "classes.tsv", "--out", str(tmp_path / "check" / "report.json")]
    proc = subprocess.run([sys.executable, "-m", "rectrain.check", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "never makes rectrain import code" in proc.stderr and "check.model" in proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()


OWN = """
import torch


def tiny(num_classes, width=4):
    return torch.nn.Sequential(torch.nn.Conv2d(3, width, 3, stride=2), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(width, num_classes))
"""


def test_a_model_of_your_own_is_rebuilt_only_through_the_factory_you_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(OWN)
    net = models.build("net.py:tiny", 3, model_args={"width": 5}).eval()
    architecture = {"model": "net.py:tiny", "model_args": {"width": 5}, "blurpool": False}
    weights.save(
        net.state_dict(),
        weights.describe(32, None, architecture, CLASSES, epoch=1, recipe={}),
        tmp_path / "w.safetensors",
    )
    with pytest.raises(models.WeightsRefused, match="name the factory yourself"):
        models.load_weights(tmp_path / "w.safetensors")
    rebuilt = models.load_weights(tmp_path / "w.safetensors", model="net.py:tiny")
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(rebuilt(x), net(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "args",
    [{"pretrained": True}, {"pretrained_cfg_overlay": {"file": "/elsewhere/evil.pth"}}, {"checkpoint_path": "/x.pth"}],
)
def test_header_model_args_that_would_fetch_or_read_other_weights_are_refused(tmp_path, args):
    from safetensors.torch import save_file

    about = {"model": "timm:resnet18", "model_args": args, "num_classes": 3, "classes": CLASSES}
    save_file({"w": torch.zeros(1)}, str(tmp_path / "w.safetensors"), metadata={"rectrain": json.dumps(about)})
    with pytest.raises(models.WeightsRefused, match=f"model_args {next(iter(args))} would make the constructor"):
        models.load_weights(tmp_path / "w.safetensors")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_weights_safetensors_gets_the_mode_the_umask_gives_every_output(tmp_path, umask):
    old = os.umask(umask)
    try:
        _, path = publish(tmp_path, blurpool=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert not [p for p in tmp_path.iterdir() if p.name != weights.FILE], "no temporary is left"
