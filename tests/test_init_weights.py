"""train.init_weights (rectrain.train.init_weights): a new run from given weights - a published
weights.safetensors, a checkpoint, or torchvision's weight enum read from torch's cache - with the head
replaced, and said, when the class count differs."""

import logging
import os
import subprocess
import sys

import pytest
import torch
import torchvision
from helpers.torchhub import cache_as_published

from rectrain import model as models
from rectrain import weights
from rectrain.train import init_weights

CLASSES = [{"label": k, "wnid": f"n{k:08d}", "name": str(k)} for k in range(3)]


@pytest.fixture
def published(tmp_path):
    torch.manual_seed(1)
    net = models.build("resnet18", 3).eval()
    about = weights.describe(32, None, {"model": "resnet18", "blurpool": False}, CLASSES, epoch=2, recipe={})
    weights.save(net.state_dict(), about, tmp_path / weights.FILE)
    return net, str(tmp_path / weights.FILE)


def test_the_same_class_count_starts_from_exactly_the_published_network(published):
    net, path = published
    torch.manual_seed(2)
    fresh = models.build("resnet18", 3)
    init_weights.apply(fresh, path)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fresh.eval()(x), net(x), rtol=0, atol=0)


def test_another_class_count_replaces_the_head_and_says_so(published, caplog):
    net, path = published
    fresh = models.build("resnet18", 5)
    with caplog.at_level(logging.INFO):
        init_weights.apply(fresh, path)
    assert torch.equal(fresh.layer4[1].conv2.weight, net.layer4[1].conv2.weight)
    assert fresh.fc.weight.shape == (5, 512)
    assert "the head is replaced" in caplog.text and "fc.weight (3, 512) -> (5, 512)" in caplog.text


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_key(tmp_path):
    torch.save({"model": models.build("resnet34", 3).state_dict()}, tmp_path / "model.pt")
    with pytest.raises(
        ValueError,
        match=r"train.init_weights .* does not fit train.model beyond its head: .*layer1.2.*train.init_weights_strict: false",
    ):
        init_weights.apply(models.build("resnet18", 3), str(tmp_path / "model.pt"))


def test_torchvision_weights_come_from_torchs_cache_without_network(tmp_path, monkeypatch, caplog):
    """A file placed where torch.hub caches ResNet18_Weights.IMAGENET1K_V1, under a name carrying its
    own hash as torchvision's published names do: read from there."""
    torch.manual_seed(3)
    source = torchvision.models.resnet18()
    cache_as_published(tmp_path, monkeypatch, source.state_dict())
    fresh = models.build("resnet18", 10)
    with caplog.at_level(logging.INFO):
        init_weights.apply(fresh, "torchvision:ResNet18_Weights.IMAGENET1K_V1")
    assert torch.equal(fresh.conv1.weight, source.conv1.weight)
    assert "fc.weight (1000, 512) -> (10, 512)" in caplog.text


def test_a_missing_init_weights_file_is_refused_before_any_job_naming_the_key(tmp_path):
    import json

    from rectrain import settings
    from rectrain.config import ConfigError, stage_block
    from rectrain.snakefile.modelcheck import check_model

    train = settings.train(stage_block("train", json.dumps({"init_weights": str(tmp_path / "absent.safetensors")})))
    with pytest.raises(ConfigError, match=r"train.init_weights' = .*absent.safetensors.*no such file"):
        check_model(train.network, train.resolution.image_size, tmp_path / "classes.tsv")


# ---- issue 47 item 10: odd files are one-line refusals, not hangs or tracebacks -------------------


@pytest.mark.parametrize("name", ["swapped.pt", "swapped.safetensors"])
def test_init_weights_swapped_for_a_fifo_after_the_parse_is_refused_not_waited_on(tmp_path, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    code = f"from rectrain.train import init_weights; init_weights.state_dict({str(fifo)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"{fifo} ({'train.init_weights' if name.endswith('.pt') else 'the weights file'}) is a named pipe (FIFO), "
            "not a regular file: point it at the file itself"
        )
    )


@pytest.mark.parametrize(("saved", "holds"), [(torch.zeros(3), "Tensor"), ([torch.zeros(3)], "list")])
def test_a_pt_holding_a_bare_tensor_or_a_list_is_refused_naming_the_key(tmp_path, saved, holds):
    torch.save(saved, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match=rf"train.init_weights .*odd.pt' holds {holds}, not a state dict"):
        init_weights.apply(models.build("resnet18", 3), str(tmp_path / "odd.pt"))


def test_init_weights_that_is_a_fifo_at_parse_time_is_named_a_fifo_not_a_missing_file(tmp_path):
    import json

    from rectrain import settings
    from rectrain.config import ConfigError, stage_block
    from rectrain.snakefile.modelcheck import check_model

    os.mkfifo(tmp_path / "pipe.pt")
    train = settings.train(stage_block("train", json.dumps({"init_weights": str(tmp_path / "pipe.pt")})))
    with pytest.raises(ConfigError) as err:
        check_model(train.network, train.resolution.image_size, tmp_path / "classes.tsv")
    assert "a named pipe (FIFO), not a regular file" in str(err.value) and "no such file" not in str(err.value)
