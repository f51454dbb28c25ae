"""train.augment.policy: timm's grammar parsed once (rectrain.loaders.augment.parse_policy) as timm's own
parser reads it, refused at config time in one line naming the key when it is not timm's grammar or
when DALI cannot compute it; the level -> argument maps the DALI graph uses are timm's; the torch
loader runs timm's own transform, repeatable per sample."""

import math
import random
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO
from timm.data import auto_augment

from rectrain.config import ConfigError
from rectrain.loaders.augment import (
    KEY,
    NONE,
    PolicyError,
    SeededPIL,
    config_problems,
    parse_policy,
    timm_hparams,
    torch_transform,
)
from rectrain.loaders.dali_augment import BODIES, SIGNED_LEVEL_TO_ARG, timm_arg

RAND = [
    "rand-m9-mstd0.5-inc1",
    "rand-m6-mstd0.5-inc1",
    "rand-m9-n3-mstd0.5",
    "rand-m7-p0.3-mmax12-inc0",
    "rand-mstd101",
]


@pytest.mark.parametrize("text", RAND)
def test_a_randaugment_string_parses_to_what_timms_parser_builds(text):
    policy = parse_policy(text)
    timm = auto_augment.rand_augment_transform(text, timm_hparams(224))
    assert policy.family == "rand" and policy.layers == timm.num_layers
    assert [op.name for op in timm.ops] == list(auto_augment.rand_augment_choices("", policy.increasing))
    for op in timm.ops:
        assert (op.prob, op.magnitude, op.magnitude_std, op.magnitude_max) == (
            policy.prob,
            policy.magnitude,
            policy.magnitude_std,
            policy.magnitude_max,
        )


@pytest.mark.parametrize("text", ["original", "originalr", "v0", "v0r-mstd0.5"])
def test_an_autoaugment_string_parses_to_timms_policy_and_noise(text):
    policy = parse_policy(text)
    timm = auto_augment.auto_augment_transform(text, timm_hparams(224))
    assert (policy.family, policy.name) == ("auto", text.split("-")[0])
    assert {op.magnitude_std for sub in timm.policy for op in sub} == {policy.magnitude_std}


def test_none_and_trivial_parse_and_none_is_off():
    assert parse_policy("none") is NONE and not NONE.on
    assert parse_policy("trivial").family == parse_policy("ta_wide").family == "trivial"


@pytest.mark.parametrize(
    "text",
    [
        "rand-x9",
        "rand-m9.5",
        "rand-m9-foo",
        "foo",
        "rand-m9-tfoo",
        "v0-m9",
        "trivial-m9",
        "rand-n0",
        "rand-p1.5",
        " none",
    ],
)
def test_a_string_outside_timms_grammar_is_refused_in_one_line_naming_the_key(text):
    with pytest.raises(PolicyError) as err:
        parse_policy(text)
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"config key '{KEY}' = {text!r} is invalid")


def loaders(policy, loader="dali"):
    return SimpleNamespace(augment={"policy": policy}, loader=loader)


@pytest.mark.parametrize("text", ["augmix-m3-w3", "rand-m9-tweights", "rand-m9-t3a", "3a"])
def test_a_policy_dali_cannot_compute_is_refused_for_the_dali_loader_naming_why_and_runs_on_torch(text):
    (line,) = config_problems(loaders(text))
    assert line.startswith(f"config key '{KEY}' = {text!r} cannot run on the DALI loader: ") and "\n" not in line
    assert "train.loader: torch" in line
    assert config_problems(loaders(text, "torch")) == []
    assert torch_transform(parse_policy(text), 32) is not None


def test_the_snakefiles_config_check_refuses_an_unknown_policy_before_any_job(tmp_path):
    from rectrain.snakefile.checks import check_config

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config.setdefault("train", {})["augment"] = {"policy": "rand-m9-x"}
    with pytest.raises(ConfigError, match=r"train\.augment\.policy' = 'rand-m9-x' is invalid: unknown section 'x'"):
        check_config(config, workdir=REPO)
    config["train"]["augment"] = {"policy": "rand-m9-mstd0.5-inc1"}
    check_config(config, workdir=REPO)


@pytest.mark.parametrize("name", sorted(set(BODIES) & set(auto_augment.LEVEL_TO_ARG)))
def test_each_level_to_argument_map_is_timms_for_either_sign(name):
    """The DALI graph's arguments (its parameter tables) against timm's LEVEL_TO_ARG, timm's random
    negation forced each way (it negates when random.random() > 0.5)."""
    hparams = timm_hparams(224)
    for level in np.arange(0, 10.01, 0.25):
        for negative in (False, True) if name in SIGNED_LEVEL_TO_ARG else (False,):
            with mock.patch("random.random", return_value=1.0 if negative else 0.0):
                timm = auto_augment.LEVEL_TO_ARG[name]
                expected = timm(level, hparams)[0] if timm else None
            got = timm_arg(name, -level if negative else level, hparams)
            assert got == expected or math.isclose(got, expected, rel_tol=1e-12, abs_tol=1e-12), (name, level)


def test_the_torch_loaders_policy_is_timms_transform_and_repeats_under_the_samples_seed():
    transform = torch_transform(parse_policy("rand-m9-mstd0.5-inc1"), 32)
    assert isinstance(transform, SeededPIL) and isinstance(transform.transform, auto_augment.RandAugment)
    assert len(transform.transform.ops) == 15 and transform.transform.ops[0].hparams["img_mean"] == (124, 116, 104)
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    state = random.getstate(), np.random.get_state()[1].copy()
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(torch.stack([transform(image) for _ in range(8)]))
    assert torch.equal(outs[0], outs[1]), "the same torch seed, the same ops and magnitudes"
    assert not all(torch.equal(outs[0][0], o) for o in outs[0][1:]), "each draw its own"
    assert random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1])
    assert outs[0].dtype == torch.uint8 and outs[0].shape == (8, 3, 32, 32)


def test_trivial_on_the_torch_loader_is_torchvisions_trivial_augment_wide():
    from torchvision.transforms import v2

    assert isinstance(torch_transform(parse_policy("trivial"), 32).transform, v2.TrivialAugmentWide)
    assert torch_transform(NONE, 32) is None
