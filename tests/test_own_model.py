"""train.model beyond torchvision (rectrain.modelspec, rectrain.model.build): your own factory in a file
or module, and timm:<name>; each way it can be wrong is refused before any job, in one line naming the
key, the file and the fix."""

import json
import textwrap

import pytest
import torch

from rectrain import model as models
from rectrain import modelspec, settings
from rectrain.config import ConfigError, stage_block
from rectrain.snakefile.modelcheck import PROBE_CLASSES, check_model
from rectrain.train.optim import make_optimizer

NET = """
import torch
from layers import Stem


def tiny(num_classes, width=8):
    return torch.nn.Sequential(Stem(width), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(width, num_classes))


def fixed(num_classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(1000))


def broken(num_classes):
    raise RuntimeError("no such width")


def not_a_module(num_classes):
    return "a string"


class Idle(torch.nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = tiny(num_classes)
        self.spare = torch.nn.Linear(3, 3)  # never used in forward

    def forward(self, x):
        return self.body(x)


def idle(num_classes):
    return Idle(num_classes)
"""
LAYERS = """
import torch


class Stem(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, width, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x).relu()
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "net.py").write_text(NET)
    (tmp_path / "layers.py").write_text(LAYERS)
    (tmp_path / "unrelated.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def train_block(model, **kw):
    return stage_block("train", json.dumps({"model": model, "zero_init_residual": False, "image_size": 32, **kw}))


def checked(model, **kw) -> None:
    """check_model of train_block(model, **kw), as the Snakefile hands it the block's parts."""
    train = settings.train(train_block(model, **kw))
    check_model(train.model, train.resolution.image_size, "no/classes.tsv")


def refusal(model, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        checked(model, **kw)
    line = str(err.value).strip()
    assert "train." in line
    return line


def test_a_relative_a_home_and_a_variable_path_resolve_to_the_same_file(user_dir, monkeypatch):
    monkeypatch.setenv("HOME", str(user_dir.parent))
    monkeypatch.setenv("NETS", str(user_dir))
    want = str(user_dir / "net.py")
    assert modelspec.parse("net.py:tiny").target == want
    assert modelspec.parse(f"~/{user_dir.name}/net.py:tiny").target == want
    assert modelspec.parse("$NETS/net.py:tiny") == modelspec.ModelSpec("file", want, "tiny")
    assert modelspec.parse("timm:convnext_tiny") == modelspec.ModelSpec("timm", "convnext_tiny")
    assert modelspec.parse("json.decoder:JSONDecoder").kind == "module"
    assert modelspec.parse("resnet50").kind == "torchvision"


def test_the_model_file_and_its_local_imports_are_the_sources_and_an_unrelated_file_is_not(user_dir):
    assert modelspec.sources("net.py:tiny") == [str(user_dir / "layers.py"), str(user_dir / "net.py")]
    assert modelspec.sources("resnet18") == [] and modelspec.sources("timm:resnet18") == []


def test_a_factory_in_a_file_builds_with_num_classes_and_model_args(user_dir):
    net = models.build("net.py:tiny", 5, model_args={"width": 4})
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 5) and net[0].conv.out_channels == 4
    checked("net.py:tiny", model_args={"width": 4})


def test_a_missing_model_file_is_refused_naming_key_file_and_fix(user_dir):
    line = refusal("nets/absent.py:tiny")
    assert "train.model" in line and str(user_dir / "nets" / "absent.py") in line and "fix the path" in line


def test_an_absent_factory_is_refused_naming_key_file_and_fix(user_dir):
    line = refusal("net.py:nothing")
    assert "train.model" in line and "net.py" in line and "has no function 'nothing'" in line and "define it" in line


def test_a_raising_factory_is_refused_naming_key_file_and_the_error(user_dir):
    line = refusal("net.py:broken")
    assert "train.model" in line and "net.py" in line and "RuntimeError: no such width" in line and "fix" in line


def test_a_factory_returning_no_module_is_refused_naming_key_file_and_fix(user_dir):
    line = refusal("net.py:not_a_module")
    assert "train.model" in line and "net.py" in line and "returned str, not a torch.nn.Module" in line


def test_logits_of_the_wrong_shape_are_refused_naming_key_and_fix(user_dir):
    line = refusal("net.py:fixed")
    assert "train.model 'net.py:fixed'" in line and f"(2, 1000), not (2, {PROBE_CLASSES})" in line
    assert "num_classes" in line


def test_parameters_without_gradient_are_refused_before_ddp_naming_them_and_the_fix(user_dir):
    line = refusal("net.py:idle")
    assert "spare.weight, spare.bias" in line and "DDP" in line and "requires_grad=False" in line


def test_blurpool_and_zero_init_residual_are_refused_where_they_cannot_apply_naming_the_key(user_dir):
    assert "train.blurpool: true" in refusal("net.py:tiny", blurpool=True)  # its one strided conv has 3 inputs
    assert "train.zero_init_residual: true" in refusal("net.py:tiny", zero_init_residual=True)
    assert "set train.zero_init_residual: false" in refusal("timm:vit_tiny_patch16_224", zero_init_residual=True)


def test_an_unknown_timm_name_is_refused_naming_the_key():
    assert "timm has no model 'no_such_net'" in refusal("timm:no_such_net")


def test_a_timm_model_takes_zero_init_last_and_blurpool_and_trains_a_step_under_adamw():
    torch.manual_seed(0)
    net = models.build("timm:resnet18", 3, zero_init_residual=True, blurpool=True, model_args={"drop_rate": 0.1})
    assert any(isinstance(m, models.BlurPoolConv2d) for m in net.modules())
    assert all(float(b.bn2.weight.detach().abs().sum()) == 0 for b in net.layer1)  # zero_init_last
    optim = settings.train(train_block("timm:resnet18", optimizer="adamw", weight_decay=0.05)).optim
    opt, _, _ = make_optimizer(optim, net, 256, 10, family="timm:resnet18", precision="fp32")
    assert isinstance(opt, torch.optim.AdamW)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(net.fc.weight) in decayed and id(net.fc.bias) not in decayed and id(net.bn1.weight) not in decayed
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    before = net.fc.weight.detach().clone()
    torch.nn.functional.cross_entropy(net.train()(x), y).backward()
    opt.step()
    assert not torch.equal(before, net.fc.weight)


def test_a_factory_in_an_importable_module_is_built(tmp_path, monkeypatch):
    (tmp_path / "mynets").mkdir()
    (tmp_path / "mynets" / "__init__.py").write_text("")
    (tmp_path / "mynets" / "small.py").write_text(
        textwrap.dedent("""
        import torch
        def net(num_classes):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, num_classes))
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert models.build("mynets.small:net", 4)(torch.zeros(1, 3, 32, 32)).shape == (1, 4)
    assert modelspec.sources("mynets.small:net") == [str(tmp_path / "mynets" / "small.py")]
