"""The training recipe's mechanics (issue 23 items 1, 3, 4): weight decay by model family and not on
norm and bias parameters, zero-initialised residual branches, the three LR schedules per optimizer
step (exact across a mid-epoch resume), BlurPool, fused SGD."""

import contextlib
import os
import sys

import numpy as np
import pytest
import torch
from helpers import REPO
from helpers.train_data import packed_dataset, rows, tiny_train_settings, train_settings
from test_train_preempt import run_train

from rectrain import model as models
from rectrain.train import optim
from rectrain.train.lifecycle.status import EXIT_STOPPED

sys.path.insert(0, str(REPO / "bench"))


def test_the_resnets_no_decay_group_holds_exactly_the_norm_and_bias_parameters():
    """timm's rule (1-D tensors and no_weight_decay()) on a ResNet is FFCV's bn_wd 0: norms and biases."""
    net = models.build("resnet50", 10)
    cfg = tiny_train_settings(weight_decay=1e-4).optim
    opt = optim.make_optimizer(cfg, net, 256, 1, family="resnet50", precision="fp32")[0]
    norms = {n for n, m in net.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    names = {id(p): n for n, p in net.named_parameters()}
    by_decay = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}
    want = {n for n in names.values() if n.endswith(".bias") or n.rsplit(".", 1)[0] in norms}
    assert by_decay[0.0] == want and "fc.bias" in want and "layer1.0.downsample.1.weight" in want
    assert by_decay[1e-4] == set(names.values()) - want and "fc.weight" in by_decay[1e-4]
    everything = tiny_train_settings(weight_decay=1e-4, decay_norm_and_bias=True).optim
    assert [
        g["weight_decay"]
        for g in optim.make_optimizer(everything, net, 256, 1, family="r", precision="fp32")[0].param_groups
    ] == [1e-4]


def test_weight_decay_null_takes_the_model_familys_published_value():
    assert optim.weight_decay(train_settings({"weight_decay": None}).optim, "resnet50") == 1e-4
    assert optim.weight_decay(train_settings({"weight_decay": None}).optim, "resnet18") == 5e-5
    assert optim.weight_decay(train_settings({"weight_decay": 0.0}).optim, "resnet18") == 0.0


@pytest.mark.parametrize("name, last_bn", [("resnet18", "bn2"), ("resnet50", "bn3")])
def test_zero_init_residual_zeroes_each_residual_branchs_last_batchnorm_weight(name, last_bn):
    torch.manual_seed(0)
    net = models.build(name, 10, zero_init_residual=True)
    blocks = [m for layer in (net.layer1, net.layer2, net.layer3, net.layer4) for m in layer]
    assert blocks and all(torch.count_nonzero(getattr(b, last_bn).weight) == 0 for b in blocks)
    assert torch.all(net.bn1.weight == 1) and torch.all(blocks[0].bn1.weight == 1), "only the last BN"
    plain = models.build(name, 10, zero_init_residual=False)
    assert all(torch.all(getattr(b, last_bn).weight == 1) for b in plain.layer1)


def test_zero_init_residual_is_off_by_default_and_on_in_the_imagenet_config():
    """Off in the schema (a short run on a small set learns: bench/RESULTS.md); the ImageNet box's config
    keeps Goyal et al.'s zero-init explicitly."""
    from helpers import REPO
    from helpers.config_edits import filled

    from rectrain.train.run import make_model

    net, _, applied = make_model(tiny_train_settings().network, 5, torch.device("cpu"))
    assert applied["zero_init_residual"] == {"asked": False, "changed": 0, "what": {}}
    assert all(torch.all(b.bn2.weight == 1) for b in net.layer1)
    assert filled(REPO / "config" / "imagenet-2gpu.yaml")["train"]["zero_init_residual"] is True


def ffcv_linear_lrs(epochs, peak_epoch, iters):
    """FFCV's per-iteration LRs (as a fraction of the peak): train_imagenet.py get_cyclic_lr at each
    epoch boundary, np.interp between them over the epoch's iterations."""
    per_epoch = lambda e: np.interp([e], [0, peak_epoch, epochs], [1e-4, 1, 0])[0]  # noqa: E731
    return np.concatenate(
        [np.interp(np.arange(iters), [0, iters], [per_epoch(e), per_epoch(e + 1)]) for e in range(epochs)]
    )


def test_the_linear_schedule_equals_ffcvs_per_iteration_lrs():
    sched = optim.Schedule("linear", steps_per_epoch=7, epochs=16, peak_epoch=2)
    got = [sched.factor(s) for s in range(16 * 7)]
    np.testing.assert_allclose(got, ffcv_linear_lrs(16, 2, 7), rtol=1e-12, atol=1e-15)
    assert got[0] == pytest.approx(1e-4) and got[14] == 1.0 and sched.factor(16 * 7) == 0.0


def test_the_step_schedule_multiplies_by_the_ratio_at_each_milestone_epoch_after_warmup():
    sched = optim.Schedule("step", steps_per_epoch=10, epochs=90, warmup_steps=5, step_epochs=(30, 60, 80))
    assert [sched.factor(s) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert sched.factor(299) == 1.0 and sched.factor(300) == pytest.approx(0.1)
    assert sched.factor(599) == pytest.approx(0.1) and sched.factor(600) == pytest.approx(0.01)
    assert sched.factor(800) == pytest.approx(0.001) and sched.factor(899) == pytest.approx(0.001)


def test_the_cosine_schedule_warms_up_linearly_then_follows_the_cosine_to_zero():
    sched = optim.Schedule("cosine", steps_per_epoch=10, epochs=4, warmup_steps=10)
    assert [sched.factor(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    for s in range(10, 40):
        assert sched.factor(s) == pytest.approx(0.5 * (1 + np.cos(np.pi * (s - 10) / 30)))
    assert sched.factor(40) == pytest.approx(0.0)


def test_the_optimizer_is_fused_sgd_with_the_schedule_and_the_family_decay():
    cfg = tiny_train_settings(lr_schedule="linear", epochs=4, lr_peak_epoch=1)
    net = models.build("resnet18", 5)
    opt, sched, _ = optim.make_optimizer(
        cfg.optim,
        net,
        global_batch=512,
        opt_steps_per_epoch=3,
        family=cfg.network.model,
        precision=cfg.network.precision,
    )
    assert opt.defaults["fused"] is True, "CPU has torch's fused SGD kernel"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 5e-5]
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(lrs, 0.2 * ffcv_linear_lrs(4, 1, 3), rtol=1e-12)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_dataset(tmp_path_factory.mktemp("lrdata"), n_train=45, classes=5)


def formula_lrs(cfg_overrides, steps_per_epoch=12, batch=4):
    cfg = tiny_train_settings(**cfg_overrides).optim
    sched = optim.schedule(cfg, steps_per_epoch)
    return [cfg.lr * batch / 256 * sched.factor(s) for s in range(cfg.epochs * steps_per_epoch)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [
        {"lr_schedule": "linear", "lr_peak_epoch": 1},
        {"lr_schedule": "step", "lr_step_epochs": [1.5, 2], "warmup_epochs": 0.5},
    ],
    ids=["linear", "step"],
)
def test_the_lr_at_every_step_equals_the_schedules_formula_across_a_mid_epoch_resume(data, tmp_path, schedule):
    """One process, 12 steps an epoch, 3 epochs; SIGTERM after step 4 of epoch 1, then the resume."""
    cfg = {**schedule, "epochs": 3}
    out = tmp_path / "t"
    stopped = run_train(data, out, {"RECTRAIN_SIGNAL_AT": "0:1:4"}, loader="torch", extra=["--single-process"], **cfg)
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    resumed = run_train(data, out, loader="torch", extra=["--single-process"], **cfg)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing at epoch 1 step 5" in resumed.stderr
    got = sorted((int(r["epoch"]), int(r["step"]), float(r["lr"])) for r in rows(out / "steps.csv"))
    assert [(e, s) for e, s, _ in got] == [(e, s) for e in range(3) for s in range(12)], "each step once"
    want = formula_lrs({**FAST_CFG, **cfg})
    # steps.csv writes 6 significant digits: a relative rounding of at most 5e-6
    np.testing.assert_allclose([lr for _, _, lr in got], want, rtol=5e-6)


FAST_CFG = {"model": "squeezenet1_1", "precision": "fp32", "calibration_steps": 0, "batch_size": 4}


def test_blurpool_wraps_the_strided_convolutions_except_the_rgb_stem():
    net = models.build("resnet50", 10, blurpool=True)
    blurred = [n for n, m in net.named_modules() if isinstance(m, models.BlurPoolConv2d)]
    strided = [
        n
        for n, m in models.build("resnet50", 10).named_modules()
        if isinstance(m, torch.nn.Conv2d) and max(m.stride) > 1 and m.in_channels >= 16
    ]
    assert blurred == strided and "conv1" not in blurred and "layer2.0.downsample.0" in blurred
    flat = torch.full((1, 64, 8, 8), 3.0)
    blur = net.layer2[0].conv2.blur
    inner = torch.nn.functional.conv2d(flat, blur[:64], padding=1, groups=64)[..., 1:-1, 1:-1]
    assert torch.allclose(inner, flat[..., 1:-1, 1:-1]), "the kernel sums to 1: a low-pass filter"
    state = net.state_dict()
    assert not any(k.endswith(".blur") for k in state), "the fixed kernel is not a weight"
    models.build("resnet50", 10, blurpool=True).load_state_dict(state)  # evaluation rebuilds it strictly


def test_a_blurpool_resnet_trains_a_step():
    torch.manual_seed(0)
    net = models.build("resnet18", 5, channels_last=True, blurpool=True, zero_init_residual=True)
    cfg = tiny_train_settings(blurpool=True)
    opt, sched, scaler = optim.make_optimizer(
        cfg.optim, net, 8, 4, family=cfg.network.model, precision=cfg.network.precision
    )
    x, y = torch.randn(8, 3, 32, 32).contiguous(memory_format=torch.channels_last), torch.arange(8) % 5
    before = net.layer2[0].conv1.conv.weight.detach().clone()
    with models.autocast(torch.device("cpu"), "bf16"):
        loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    assert net.layer2[0].conv1.conv.weight.grad is not None and torch.isfinite(loss)
    opt.step()
    sched.step()
    assert not torch.equal(before, net.layer2[0].conv1.conv.weight), "the step moved the wrapped conv"


def _ddp_rank(rank, port, accum, hook, out):
    import torch.distributed as dist

    from rectrain.distributed import Dist
    from rectrain.train.run import ddp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = models.build("resnet18", 5, zero_init_residual=True)
    cfg = tiny_train_settings(ddp_comm_hook=hook)
    net = ddp(model, Dist(rank, 2, rank, 2, torch.device("cpu")), cfg.launch, accum)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    for _ in range(2):
        for micro in range(accum):
            with net.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                net(torch.randn(4, 3, 32, 32) + rank).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.save({"static": net.static_graph, "fc": model.fc.weight.detach()}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("accum, hook", [(1, "bf16"), (2, "fp16")])
def test_ddp_with_bucket_views_static_graph_and_a_compression_hook_keeps_the_ranks_equal(tmp_path, accum, hook):
    """Two gloo ranks on different data: after two optimizer steps their weights are equal; the static
    graph is on without accumulation and off with it (torch cannot start one under no_sync)."""
    port = 29500 + os.getpid() % 1000
    torch.multiprocessing.spawn(_ddp_rank, args=(port, accum, hook, str(tmp_path)), nprocs=2)
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert torch.equal(a["fc"], b["fc"]) and a["static"] is (accum == 1)


def test_two_epochs_of_the_dali_loaders_permutation_are_uncorrelated_and_rebatch_pairs_as_a_full_permutation(tmp_path):
    """bench/shuffle_bench.py's figures on 40k records, 2 ranks, from the loader itself (the mxnet
    reader's buffer it replaced: correlation 0.992 and 10x the pairs at ImageNet's size)."""
    from shuffle_bench import batch_cooccurrence, loader_orders, position_correlation, write_idx_only

    n = 40000
    orders, held, _ = loader_orders(*write_idx_only(tmp_path, n), ranks=2, batch=64, epochs=2, order="permutation")
    assert abs(position_correlation(orders[0, 0], orders[0, 1], n)) < 0.03
    again, full = batch_cooccurrence(orders[0, 0], [orders[0, 1], orders[1, 1]], 64, n)
    assert again < 1.2 * full, f"{again:.5f} of the pairs met again, a full permutation's share is {full:.5f}"
    assert held < 48 * n, f"{held / n:.0f} bytes per record for the order"
