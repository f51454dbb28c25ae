"""Issue 49: today's recipe ingredients are timm's, shown beside timm itself with the same random draws -
random erasing and Mixup/CutMix on the device batch (train.augment.reprob, train.mixup), the losses
(train.loss), LAMB and LARS, betas and eps, the LR scaling per optimizer family and layer decay
(train.optimizer, train.lr_scaling, train.layer_decay), the weights' EMA (train.ema) - each reached through
the code the trainer runs (settings -> rectrain.train.batchaug / losses / optim / ema -> step.train_step);
and every new key refused in one line naming it where it cannot work."""

import copy
import math
import random

import numpy as np
import pytest
import timm
import torch
from helpers.train_data import tiny_train_config, train_settings
from timm.data import Mixup
from timm.data.random_erasing import RandomErasing
from timm.loss import BinaryCrossEntropy, SoftTargetCrossEntropy
from timm.optim import Lamb, Lars, create_optimizer_v2
from timm.utils import ModelEmaV3

from rectrain import settings
from rectrain.config import ConfigError, stage_block
from rectrain.distributed import Dist
from rectrain.train import batchaug, losses, optim
from rectrain.train import ema as emas
from rectrain.train.step import Step, train_step

CPU = torch.device("cpu")
MIX = {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "prob": 0.9, "switch_prob": 0.5}


def seed(k: int) -> None:
    """The draws timm's classes take: NumPy (Mixup), Python (erasing's boxes), torch (erasing's noise)."""
    np.random.seed(k)
    random.seed(k)
    torch.manual_seed(k)


def batch(n=8, classes=10, size=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_the_mixed_batch_and_soft_targets_equal_timms_mixup_in_each_mode_with_the_same_draws(mode):
    s = train_settings({"mixup": {**MIX, "mode": mode}, "label_smoothing": 0.1})
    ours = batchaug.build(s.loaders, s.network.label_smoothing, 10, CPU)
    theirs = Mixup(**{k: v for k, v in MIX.items()}, mode=mode, label_smoothing=0.1, num_classes=10)
    mixed = 0
    for k in range(12):  # Mixup and CutMix both drawn, and some not mixed at all (prob 0.9)
        x, y = batch()
        seed(k)
        xa, ta = ours(x.clone(), y.clone())
        seed(k)
        xb, tb = theirs(x.clone(), y.clone())
        assert torch.equal(xa, xb) and torch.equal(ta, tb), f"draw {k}"
        mixed += not torch.equal(xa, x)
    assert mixed >= 6 and ta.shape == (8, 10) and torch.allclose(ta.sum(1), torch.ones(8))


def test_from_mixup_off_epoch_on_nothing_is_mixed_and_the_targets_stay_timms_smoothed_ones():
    s = train_settings({"mixup": {"mixup_alpha": 0.8, "off_epoch": 2}, "label_smoothing": 0.1})
    aug = batchaug.build(s.loaders, 0.1, 10, CPU)
    x, y = batch()
    aug.begin_epoch(1)
    seed(0)
    assert not torch.equal(aug(x.clone(), y)[0], x)
    aug.begin_epoch(2)
    xa, ta = aug(x.clone(), y)
    assert torch.equal(xa, x) and torch.equal(ta.argmax(1), y) and ta.max() == pytest.approx(0.91)


@pytest.mark.parametrize("remode", ["pixel", "rand", "const"])
def test_random_erasing_equals_timms_on_the_normalised_device_batch_before_mixup(remode):
    s = train_settings({"augment": {"policy": "none", "reprob": 0.5, "remode": remode, "recount": 3}, "mixup": MIX})
    ours = batchaug.build(s.loaders, 0.1, 10, CPU)
    erase = RandomErasing(probability=0.5, mode=remode, max_count=3, device="cpu")
    mix = Mixup(**MIX, label_smoothing=0.1, num_classes=10)
    x, y = batch(size=32)
    seed(5)
    xa, ta = ours(x.clone(), y)
    seed(5)
    xb, tb = mix(erase(x.clone()), y)  # DeiT's and ConvNeXt's order: the transform erases, the loop mixes
    assert torch.equal(xa, xb) and torch.equal(ta, tb)
    seed(5)
    assert not torch.equal(ours.erasing(x.clone()), x), "some image was erased"


def test_train_accuracy_under_mixup_counts_each_image_against_the_label_of_its_larger_share():
    targets = torch.tensor([[0.7, 0.3, 0.0], [0.2, 0.0, 0.8]])
    assert batchaug.hard_labels(targets).tolist() == [0, 2]
    assert batchaug.hard_labels(torch.tensor([2, 1])).tolist() == [2, 1]


def test_bce_equals_timms_binary_cross_entropy_on_hard_and_on_mixed_soft_targets():
    logits = torch.randn(8, 10, generator=torch.Generator().manual_seed(1))
    x, y = batch()
    hard = train_settings({"loss": "bce", "label_smoothing": 0.1, "bce_target_threshold": 0.2}).network
    ours = losses.train_loss(hard, mixed=False)
    assert torch.equal(ours(logits, y), BinaryCrossEntropy(smoothing=0.1, target_threshold=0.2)(logits, y))
    seed(2)
    soft = Mixup(mixup_alpha=0.8, label_smoothing=0.1, num_classes=10)(x, y)[1]
    mixed = losses.train_loss(hard, mixed=True)  # smoothing is already in Mixup's targets: timm's train.py
    assert torch.equal(mixed(logits, soft), BinaryCrossEntropy(smoothing=0.0, target_threshold=0.2)(logits, soft))
    unthresholded = train_settings({"loss": "bce"}).network
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits, soft)
    assert torch.allclose(losses.train_loss(unthresholded, mixed=True)(logits, soft), want)
    ce = losses.train_loss(train_settings({}).network, mixed=True)
    assert isinstance(ce, SoftTargetCrossEntropy) and torch.equal(
        ce(logits, soft), SoftTargetCrossEntropy()(logits, soft)
    )


def test_train_step_trains_on_the_mixed_batch_and_its_soft_target_loss():
    """The Step's phases in order: the batch augmentation's output is what the network and the loss see."""
    s = train_settings({"mixup": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}, "label_smoothing": 0.1})
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    step = Step(
        net, losses.train_loss(s.network, mixed=True), opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0),
        torch.amp.GradScaler("cpu", enabled=False), 1, "fp32", False, Dist(0, 1, 0, 1, CPU),
        augment_batch=batchaug.build(s.loaders, 0.1, 10, CPU),
    )  # fmt: skip
    x, y = batch()
    seed(3)
    out = train_step(step, 0, x.clone(), y, last_micro=True)
    seed(3)
    xb, tb = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10)(x.clone(), y)
    assert torch.equal(out.loss, SoftTargetCrossEntropy()(net(xb), tb).detach())
    assert out.hits == (net(xb).argmax(1) == tb.argmax(1)).sum()


class Net(torch.nn.Module):
    """Convolution, BatchNorm (running buffers and a counter: what ModelEmaV3 averages or copies), head."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(4, 10)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def test_the_ema_after_50_optimizer_steps_with_warmup_equals_timms_model_ema_v3_and_survives_a_checkpoint():
    """Two micro-batches per optimizer step (grad_accum 2): the EMA moves after the optimizer steps only."""
    cfg = {"decay": 0.998, "warmup": True, "result": "ema"}
    torch.manual_seed(0)
    ours_net, theirs_net = Net(), Net()
    theirs_net.load_state_dict(ours_net.state_dict())
    opt_a = torch.optim.SGD(ours_net.parameters(), lr=0.05, momentum=0.9)
    opt_b = torch.optim.SGD(theirs_net.parameters(), lr=0.05, momentum=0.9)
    step = Step(
        ours_net, torch.nn.CrossEntropyLoss(), opt_a, torch.optim.lr_scheduler.LambdaLR(opt_a, lambda k: 1.0),
        torch.amp.GradScaler("cpu", enabled=False), 2, "fp32", False, Dist(0, 1, 0, 1, CPU),
        ema=emas.build(cfg, ours_net),
    )  # fmt: skip
    reference = ModelEmaV3(theirs_net, decay=0.998, use_warmup=True)
    for k in range(100):
        x, y = batch(4, size=8)
        x = x + 0.1 * k
        train_step(step, k, x, y, last_micro=k % 2 == 1)
        (torch.nn.functional.cross_entropy(theirs_net(x), y) / 2).backward()
        if k % 2 == 1:
            opt_b.step()
            opt_b.zero_grad()
            reference.update(theirs_net, step=(k + 1) // 2)
    ours, theirs = step.ema.module.state_dict(), reference.module.state_dict()
    assert step.scheduler.last_epoch == 50 and list(ours) == list(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
        assert ours[name].dtype == theirs[name].dtype and ours[name].device == CPU
    assert not torch.equal(ours["conv.weight"], ours_net.state_dict()["conv.weight"]), "an average, not a copy"
    assert reference.get_decay(50) < 0.998, "50 steps are still inside the warm-up"
    again = emas.build(cfg, Net())
    emas.load(again, emas.state(step.ema))
    assert all(torch.equal(again.module.state_dict()[n], ours[n]) for n in ours)


def lamb_settings(**extra):
    flat = {"optimizer": "lamb", "lr": 0.004, "weight_decay": 0.02, "lr_scaling": "sqrt", "lr_schedule": "step"}
    flat.update(warmup_epochs=0, lr_step_epochs=[1000], betas=[0.85, 0.98], eps=1e-7, **extra)
    return settings.train(tiny_train_config(**flat)).optim


def test_lambs_first_20_steps_equal_timms_lamb_at_the_sqrt_scaled_lr_with_betas_and_eps():
    torch.manual_seed(0)
    ours_net, theirs_net = Net(), Net()
    theirs_net.load_state_dict(ours_net.state_dict())
    ours = optim.make_optimizer(lamb_settings(), ours_net, 2048, 100, family="timm:x", precision="fp32")[0]
    peak = 0.004 * math.sqrt(2048 / 256)  # timm's train.py rule for LAMB
    groups = [
        {"params": [p for n, p in theirs_net.named_parameters() if p.ndim <= 1], "weight_decay": 0.0},
        {"params": [p for n, p in theirs_net.named_parameters() if p.ndim > 1], "weight_decay": 0.02},
    ]
    theirs = Lamb(groups, lr=peak, betas=(0.85, 0.98), eps=1e-7)
    assert type(ours) is Lamb and [g["lr"] for g in ours.param_groups] == pytest.approx([peak, peak])
    for k in range(20):
        x, y = batch(4, size=8)
        for net, opt in ((ours_net, ours), (theirs_net, theirs)):
            torch.nn.functional.cross_entropy(net(x * (1 + k)), y).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(ours_net.state_dict().items(), theirs_net.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert optim.recorded(ours, ours_net, lamb_settings(), 2048)["settings"] == {
        "betas": [0.85, 0.98],
        "eps": 1e-7,
        "max_grad_norm": 1.0,
        "trust_clip": False,
    }, "run.json records LAMB's settings as it ran them"
    # timm's Lamb counts its steps in each group: the state dict a checkpoint saves carries them
    saved = ours.state_dict()
    assert int(saved["param_groups"][0]["step"]) == 20 and "exp_avg_sq" in next(iter(saved["state"].values()))


def test_lars_is_timms_with_nesterov_as_train_nesterov_says():
    net = Net()
    cfg = settings.train(tiny_train_config(optimizer="lars", momentum=0.9, nesterov=True)).optim
    opt = optim.make_optimizer(cfg, net, 256, 10, family="resnet50", precision="fp32")[0]
    assert type(opt) is Lars and opt.defaults["nesterov"] is True and opt.defaults["momentum"] == 0.9
    plain = cfg.__class__(**{**cfg.as_dict(), "nesterov": False})
    assert (
        optim.make_optimizer(plain, net, 256, 10, family="resnet50", precision="fp32")[0].defaults["nesterov"] is False
    )


@pytest.mark.parametrize(
    "opt, rule, factor",
    [("sgd", "linear", 8.0), ("lars", "linear", 8.0), ("adamw", "sqrt", math.sqrt(8)), ("lamb", "sqrt", math.sqrt(8))],
)
def test_lr_scaling_auto_is_timms_rule_per_optimizer_family_and_run_json_states_it(opt, rule, factor):
    cfg = settings.train(tiny_train_config(optimizer=opt, lr=0.01, lr_scaling="auto")).optim
    assert optim.lr_rule(cfg) == rule and optim.peak_lr(cfg, 2048) == pytest.approx(0.01 * factor)
    net = Net()
    record = optim.recorded(optim.make_optimizer(cfg, net, 2048, 10, family="x", precision="fp32")[0], net, cfg, 2048)
    assert record["lr_scaling"].startswith(f"{rule} (train.lr_scaling auto: timm's rule for {opt})")
    assert f"= {0.01 * factor:.6g} at global batch 2048" in record["lr_scaling"]
    assert [g["peak_lr"] for g in record["groups"]] == pytest.approx([0.01 * factor] * len(record["groups"]))
    linear = cfg.__class__(**{**cfg.as_dict(), "lr_scaling": "linear"})
    assert optim.peak_lr(linear, 2048) == pytest.approx(0.08), "linear whatever the optimizer"


@pytest.mark.parametrize("name", ["timm:convnext_atto", "timm:vit_tiny_patch16_224"])
def test_layer_decay_groups_and_their_lr_scales_equal_create_optimizer_v2s(name):
    from rectrain import model as models

    net = models.build(name, 10)
    cfg = settings.train(tiny_train_config(optimizer="adamw", lr=0.001, layer_decay=0.7)).optim
    ours, sched, _ = optim.make_optimizer(cfg, net, 256, 10, family=name, precision="fp32")
    theirs = create_optimizer_v2(net, opt="adamw", lr=0.001, weight_decay=0.05, layer_decay=0.7)
    ids = lambda opt: [(g["lr_scale"], g["weight_decay"], [id(p) for p in g["params"]]) for g in opt.param_groups]  # noqa: E731
    assert ids(ours) == ids(theirs) and len(ours.param_groups) > 10
    # timm's schedulers multiply by lr_scale; torch's LambdaLR runs each group from the peak set here
    assert [g["initial_lr"] for g in ours.param_groups] == pytest.approx(
        [0.001 * g["lr_scale"] for g in theirs.param_groups]
    )
    assert sched.base_lrs == pytest.approx([0.001 * g["lr_scale"] for g in theirs.param_groups])
    record = optim.recorded(ours, net, cfg, 256)
    assert min(g["lr_scale"] for g in record["groups"]) == pytest.approx(
        0.7 ** (len(ours.param_groups) // 2 - 1), rel=0.5
    )


def test_layer_decay_on_a_model_timm_cannot_group_is_refused_in_one_line_naming_the_key():
    from rectrain import model as models

    cfg = settings.train(tiny_train_config(layer_decay=0.7)).optim
    with pytest.raises(ValueError) as err:
        optim.make_optimizer(cfg, models.build("resnet18", 10), 256, 10, family="resnet18", precision="fp32")
    line = str(err.value)
    assert (
        "\n" not in line and "config key 'train.layer_decay' = 0.7" in line and "ResNet has no group_matcher()" in line
    )


@pytest.mark.parametrize(
    "given, key",
    [
        ({"mixup": {"mixup_alpha": -0.1}}, "train.mixup.mixup_alpha"),
        ({"mixup": {"mode": "pairs"}}, "train.mixup.mode"),
        ({"augment": {"reprob": 1.5}}, "train.augment.reprob"),
        ({"augment": {"remode": "noise"}}, "train.augment.remode"),
        ({"loss": "focal"}, "train.loss"),
        ({"ema": {"decay": 1.0}}, "train.ema.decay"),
        ({"betas": [0.9]}, "train.betas"),
        ({"optimizer": "adagrad"}, "train.optimizer"),
    ],
)
def test_every_new_key_out_of_range_is_refused_in_one_line_naming_it(given, key):
    with pytest.raises(ConfigError) as err:
        stage_block("train", __import__("json").dumps(given))
    lines = [line for line in str(err.value).splitlines()[1:]]
    assert len(lines) == 1 and f"config key '{key}'" in lines[0]


def test_an_odd_batch_under_mixup_is_refused_before_any_job_and_a_bce_threshold_without_bce_is_warned_about():
    s = train_settings({"mixup": {"cutmix_alpha": 1.0}, "batch_size": 15, "bce_target_threshold": 0.2})
    (odd,) = batchaug.config_problems(s.loaders, s.batch.batch_size)
    (threshold,) = losses.config_warnings(s.network)
    assert "config key 'train.mixup'" in odd and "train.batch_size = 15" in odd and "16 or 14" in odd
    assert "config key 'train.bce_target_threshold' = 0.2 changes nothing with train.loss = 'ce'" in threshold
    assert batchaug.config_problems(train_settings({"batch_size": 15}).loaders, 15) == []
    with pytest.raises(ValueError, match="config key 'train.mixup' mixes the labels of 1 class"):
        batchaug.build(s.loaders, 0.1, 1, CPU)


def test_every_new_key_is_off_by_default_and_the_default_step_is_todays():
    s = train_settings({})
    assert batchaug.build(s.loaders, s.network.label_smoothing, 10, CPU) is None
    assert emas.build(s.optim.ema, Net()) is None
    assert isinstance(losses.train_loss(s.network), torch.nn.CrossEntropyLoss)
    assert (s.optim.betas, s.optim.eps, s.optim.layer_decay, s.optim.lr_scaling) == (None, None, None, "linear")
    net = Net()
    record = optim.recorded(
        optim.make_optimizer(s.optim, net, 512, 10, family="x", precision="fp32")[0], net, s.optim, 512
    )
    assert [g["peak_lr"] for g in record["groups"]] == pytest.approx([0.2, 0.2]), "train.lr 0.1 x 512 / 256"


def test_the_ema_is_fp32_on_the_models_device_and_a_copy_not_the_model():
    net = Net()
    averaged = emas.build({"decay": 0.9, "warmup": False, "result": "raw"}, net)
    assert averaged.module is not net and all(t.dtype == torch.float32 for t in averaged.module.parameters())
    assert copy.deepcopy(averaged.module.state_dict()).keys() == net.state_dict().keys()
    assert "timm's ModelEmaV3, decay 0.9" in emas.words({"decay": 0.9, "warmup": False, "result": "raw"})


def test_timm_is_the_version_these_tests_compare_with():
    assert timm.__version__ == "1.0.31"


def test_a_finished_ema_run_keeps_and_republishes_both_weight_files_and_a_plain_run_leaves_none_behind(tmp_path):
    """checkpoints/finished/ keeps weights-raw/-ema.safetensors beside the published outputs, a restore
    links them back, and a run without train.ema restored over them leaves no stale variant."""
    from rectrain.train.lifecycle import checkpoint as ckpt
    from rectrain.train.lifecycle.checkpoint import CheckpointSaver

    out, ck = tmp_path / "train", tmp_path / "train" / "checkpoints"
    ck.mkdir(parents=True)
    for name in (*ckpt.PUBLISHED, *ckpt.VARIANTS):
        (out / name).write_text(name)
    CheckpointSaver(ck).keep_finished(out)
    assert sorted(p.name for p in CheckpointSaver(ck).kept.iterdir()) == sorted((*ckpt.PUBLISHED, *ckpt.VARIANTS))
    ckpt.clear(out)
    assert not any((out / name).exists() for name in (*ckpt.PUBLISHED, *ckpt.VARIANTS))
    CheckpointSaver(ck).restore_finished(out)
    assert all((out / name).read_text() == name for name in (*ckpt.PUBLISHED, *ckpt.VARIANTS))
    for name in ckpt.VARIANTS:  # a plain run kept: its restore removes the EMA run's variants
        (CheckpointSaver(ck).kept / name).unlink()
    CheckpointSaver(ck).restore_finished(out)
    assert not any((out / name).exists() for name in ckpt.VARIANTS)
