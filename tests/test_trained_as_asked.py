"""Issue 46: every setting does what it says for every model kind (torchvision, timm, a file of one's own),
or is refused in one line; what each did is counted (rectrain.model.construct) and the optimizer's groups
are timm's (rectrain.train.optim). Each test failed on the code before issue 46."""

import argparse

import pytest
import timm
import torch
import torchvision
from helpers.train_data import tiny_train_settings
from safetensors.torch import load_file
from timm.optim import create_optimizer_v2

from rectrain import model as models
from rectrain import weights
from rectrain.train import init_weights, optim


def norm_weights_all_zero(net) -> list[str]:
    norms = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm)
    return [n for n, m in net.named_modules() if isinstance(m, norms) and m.weight is not None and not m.weight.any()]


@pytest.mark.parametrize("name", ["timm:resnet50", "timm:regnety_016", "timm:cspresnet50"])
def test_timm_models_zero_no_norm_weight_when_zero_init_residual_is_false_and_count_what_true_zeroes(name):
    """timm's default is zero_init_last=True: with the flag false these had 16, 27 and 13 all-zero BN weights."""
    net, applied = models.construct(name, 10, zero_init_residual=False)
    assert norm_weights_all_zero(net) == [] and applied["zero_init_residual"]["changed"] == 0
    net, applied = models.construct(name, 10, zero_init_residual=True)
    zeroed = norm_weights_all_zero(net)
    assert zeroed and applied["zero_init_residual"]["changed"] == len(zeroed)
    assert sum(applied["zero_init_residual"]["what"].values()) == len(zeroed)


@pytest.mark.parametrize(
    "name, key",
    [
        ("convnext_tiny", "zero_init_residual"),
        ("regnet_y_400mf", "zero_init_residual"),
        ("efficientnet_b0", "zero_init_residual"),
        ("vit_b_16", "blurpool"),
        ("swin_t", "blurpool"),
    ],
)
def test_a_torchvision_mechanic_that_would_change_nothing_is_refused_in_one_line_naming_the_key(name, key):
    with pytest.raises(ValueError) as err:
        models.build(name, 10, **{key: True})
    line = str(err.value)
    assert "\n" not in line and f"train.{key}: true" in line and name in line and f"set train.{key}: false" in line


def test_the_log_line_and_counts_say_what_each_mechanic_changed_in_a_torchvision_resnet():
    net, applied = models.construct("resnet18", 10, zero_init_residual=True, blurpool=True)
    assert applied["zero_init_residual"]["what"] == {f"layer{k}.*.bn2.weight": 2 for k in (1, 2, 3, 4)}
    assert applied["blurpool"]["what"] == models.blurpool_layers(net) and applied["blurpool"]["changed"] == 6
    line = models.mechanics_line("resnet18", applied)
    assert (
        "zeroed 8 weight(s) (layer1.*.bn2.weight, layer2.*.bn2.weight" in line
        and "wraps 6 strided convolution(s)" in line
    )


class ScaledNet(torch.nn.Module):
    """A model of one's own with what the old groups decayed: an RMSNorm weight and a 1-D layer scale."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3)
        self.norm = torch.nn.RMSNorm(8)
        self.scale = torch.nn.Parameter(torch.ones(8))
        self.token = torch.nn.Parameter(torch.zeros(1, 8))
        self.fc = torch.nn.Linear(8, num_classes)

    def no_weight_decay(self):
        return {"token"}

    def forward(self, x):
        x = self.stem(x).mean((2, 3))
        return self.fc(self.norm(x) * self.scale + self.token)


def groups_by_decay(opt, net) -> dict[float, set[str]]:
    names = {id(p): n for n, p in net.named_parameters()}
    return {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}


@pytest.mark.parametrize(
    "name, exempt",
    [
        ("timm:resnet50", {"bn1.weight", "layer4.2.bn3.bias", "fc.bias"}),
        ("timm:vit_small_patch16_224", {"cls_token", "pos_embed"}),
        ("timm:convnext_tiny", {"stages.0.blocks.0.gamma"}),
        ("swin_t", {"features.1.0.attn.relative_position_bias_table"}),
        ("own", {"norm.weight", "scale", "token"}),
    ],
)
def test_the_decay_groups_equal_timms_create_optimizer_v2_and_exempt_what_the_recipes_exempt(name, exempt):
    net = ScaledNet() if name == "own" else models.build(name, 10)
    cfg = tiny_train_settings(optimizer="adamw").optim
    ours = optim.make_optimizer(cfg, net, 256, 1, family=name, precision="fp32")[0]
    theirs = create_optimizer_v2(net, opt="adamw", lr=0.1, weight_decay=0.05)
    assert groups_by_decay(ours, net) == groups_by_decay(theirs, net)
    assert exempt <= groups_by_decay(ours, net)[0.0]
    record = optim.recorded(ours, net)
    assert [g["weight_decay"] for g in record["groups"]] == [0.0, 0.05]
    assert sum(g["tensors"] for g in record["groups"]) == len(list(net.parameters()))


def test_adamw_with_weight_decay_unset_decays_at_its_recipes_0_05_and_sgd_at_the_familys():
    assert optim.weight_decay(tiny_train_settings(optimizer="adamw").optim, "resnet50") == 0.05
    assert optim.weight_decay(tiny_train_settings(optimizer="sgd").optim, "resnet50") == 1e-4
    assert optim.weight_decay(tiny_train_settings(optimizer="adamw", weight_decay=0.1).optim, "resnet50") == 0.1


def vit_tiny(num_classes, **kw):
    return timm.create_model("vit_tiny_patch16_224", num_classes=num_classes, **kw)


def test_a_vit_fine_tuned_at_288_px_resamples_its_position_embedding_as_timm_and_replaces_only_its_head(tmp_path):
    """FixRes: 1x197x192 -> 1x325x192 was kept at its random init while the log said only the head was."""
    from timm.layers import resample_abs_pos_embed

    torch.manual_seed(0)
    trained = vit_tiny(10)
    torch.save(trained.state_dict(), tmp_path / "vit.pt")
    fine = vit_tiny(5, img_size=288)
    report = init_weights.apply(fine, str(tmp_path / "vit.pt"))
    want = resample_abs_pos_embed(trained.pos_embed.detach(), [18, 18], [14, 14], num_prefix_tokens=1)
    assert torch.equal(fine.pos_embed.detach(), want) and report["resampled"] == ["pos_embed"]
    assert report["head_at_init"] == ["head.weight", "head.bias"] and report["at_init"] == []
    assert torch.equal(fine.blocks[3].mlp.fc1.weight, trained.blocks[3].mlp.fc1.weight)


def test_a_non_head_tensor_of_another_shape_is_refused_unless_init_weights_strict_is_false(tmp_path):
    torch.save(vit_tiny(10).state_dict(), tmp_path / "vit.pt")
    wider = timm.create_model("vit_tiny_patch16_224", num_classes=10, mlp_ratio=2.0)
    with pytest.raises(ValueError, match=r"beyond its head: blocks.0.mlp.fc1.weight \(768, 192\) -> \(384, 192\)"):
        init_weights.apply(wider, str(tmp_path / "vit.pt"))
    report = init_weights.apply(wider, str(tmp_path / "vit.pt"), strict=False)
    assert len(report["at_init"]) == 4 * 12 - 12 and report["head_at_init"] == []  # fc1 w/b, fc2 w per block


def test_a_timm_train_checkpoint_with_ddp_prefixes_initialises_a_run_from_its_ema(tmp_path):
    """timm's train.py saves args (an argparse.Namespace) beside state_dict and state_dict_ema: a raw
    UnpicklingError before; now read with weights_only=True, the EMA first as timm's loader takes it."""
    torch.manual_seed(1)
    raw, ema = models.build("resnet18", 3).state_dict(), models.build("resnet18", 3).state_dict()
    checkpoint = {
        "epoch": 9,
        "arch": "resnet18",
        "state_dict": {f"module.{k}": v for k, v in raw.items()},
        "state_dict_ema": {f"_orig_mod.{k}": v for k, v in ema.items()},
        "args": argparse.Namespace(lr=0.1, model="resnet18"),
        "version": 2,
        "metric": 0.5,
    }
    torch.save(checkpoint, tmp_path / "last.pth.tar")
    net = models.build("resnet18", 3)
    report = init_weights.apply(net, str(tmp_path / "last.pth.tar"))
    assert report["read_from"] == "state_dict_ema" and report["loaded"] == len(ema)
    assert all(torch.equal(v, ema[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("name", ["timm:resnet18", "resnet18"])
def test_a_blurpool_runs_weights_load_strictly_into_the_plain_architecture_and_rectrain_puts_the_filter_back(
    name, tmp_path
):
    """The file held `layer2.0.conv1.conv.weight`-style keys that timm.create_model refused (issue 46 item 9)."""
    torch.manual_seed(2)
    trained = models.build(name, 4, blurpool=True).eval()
    layers = models.blurpool_layers(trained)
    about = {"model": name, "model_args": {}, "blurpool": True, "blurpool_layers": layers, "num_classes": 4}
    path = tmp_path / weights.FILE
    weights.save(models.plain_state_dict(trained.state_dict(), layers), about, path)
    plain = (
        timm.create_model("resnet18", num_classes=4)
        if name.startswith("timm:")
        else torchvision.models.resnet18(num_classes=4)
    )
    plain.load_state_dict(load_file(path), strict=True)
    rebuilt = models.load_weights(path)
    x = torch.randn(2, 3, 64, 64)
    assert torch.allclose(rebuilt(x), trained(x), atol=1e-6) and models.blurpool_layers(rebuilt) == layers
    assert not torch.allclose(plain.eval()(x), trained(x), atol=1e-3), "the filter changes what it computes"
