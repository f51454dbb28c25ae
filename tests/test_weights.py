"""The published weights file (rectrain.weights, rectrain.model.load_weights): torchvision's own key
names, rebuilt from the file alone (BlurPool included), a backbone view without the head."""

import pytest
import torch
import torchvision
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
