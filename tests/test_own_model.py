"""train.model beyond torchvision (rectrain.modelspec, rectrain.model.build): your own factory in a file
or module, and timm:<name>; each way it can be wrong is refused before any job, in one line naming the
key, the file and the fix."""

import hashlib
import json
import subprocess
import sys
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
    check_model(train.network, train.resolution.image_size, "no/classes.tsv")


def refusal(model, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        checked(model, **kw)
    line = str(err.value).strip()
    assert "train." in line
    return line


def checked_remembering(passed, model, **kw) -> None:
    train = settings.train(train_block(model, **kw))
    check_model(train.network, train.resolution.image_size, "no/classes.tsv", passed)


def test_a_passed_check_is_remembered_and_the_same_model_is_not_built_again(user_dir, monkeypatch):
    passed = user_dir / ".snakemake" / "rectrain" / "model-checks.json"
    checked_remembering(passed, "net.py:tiny")
    assert len(json.loads(passed.read_text())) == 1
    monkeypatch.setattr(models, "build", built_again)
    checked_remembering(passed, "net.py:tiny")
    with pytest.raises(AssertionError, match="built the model again"):  # another width: another check
        checked_remembering(passed, "net.py:tiny", model_args={"width": 4})


def built_again(*args, **kw):
    raise AssertionError("a remembered check built the model again")


@pytest.mark.parametrize("edited", ["net.py", "layers.py"])
def test_an_edit_to_the_model_file_or_its_local_import_is_checked_again(user_dir, monkeypatch, edited):
    """(Each Snakefile parse is a process of its own; in this one the model's module stays imported, so the
    test sees the build being asked for again rather than its answer.)"""
    passed = user_dir / "checks.json"
    checked_remembering(passed, "net.py:tiny")
    (user_dir / edited).write_text((user_dir / edited).read_text() + "\n# edited\n")
    monkeypatch.setattr(models, "build", built_again)
    with pytest.raises(AssertionError, match="built the model again"):
        checked_remembering(passed, "net.py:tiny")


def test_a_refused_check_is_never_remembered(user_dir):
    passed = user_dir / "checks.json"
    for _ in range(2):
        with pytest.raises(ConfigError, match="train.model"):
            checked_remembering(passed, "net.py:broken")
    assert not passed.exists()


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


# ---- issue 47 items 4, 7, 10: a model's folder imports nothing else, checks come first, what ran is hashed ----


def marker_module(path, marker):
    path.write_text(f"open({str(marker)!r}, 'w').write('imported')\n")


def test_files_named_as_standard_modules_beside_the_model_are_never_imported_nor_its_sources(user_dir):
    """colorsys (which the model imports) and graphlib (which Snakemake imports later) planted beside the
    model file: a fresh process builds the model and imports both, and gets the standard library's."""
    (user_dir / "net.py").write_text("import colorsys\n" + NET)
    for name in ("colorsys", "graphlib"):
        marker_module(user_dir / f"{name}.py", user_dir / f"ran_{name}")
    code = (
        "import sys; before = list(sys.path)\n"
        "from rectrain import model as models\n"
        "models.build('net.py:tiny', 3)\n"
        "import colorsys, graphlib\n"
        "assert sys.path == before, sys.path\n"
        "assert colorsys.__file__.startswith(sys.base_prefix), colorsys.__file__\n"
    )
    # -P: no working directory first on sys.path, as every job runs (PYTHONSAFEPATH)
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=user_dir, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(user_dir.glob("ran_*"))
    assert modelspec.sources("net.py:tiny") == [str(user_dir / "layers.py"), str(user_dir / "net.py")]


def test_a_module_factory_is_checked_before_its_module_runs(tmp_path, monkeypatch, capfd):
    (tmp_path / "noisy.py").write_text("print('the module ran')\n\ndef net(num_classes):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "a module of Python's standard library" in refusal("this:x")
    assert "has no function 'nothing'" in refusal("noisy:nothing")
    out = capfd.readouterr().out
    assert "Beautiful is better than ugly" not in out and "the module ran" not in out


def test_a_model_path_that_is_not_a_python_file_is_refused_naming_the_key():
    line = refusal("/etc/passwd:x")
    assert line.startswith("config key") or "train.model '/etc/passwd:x'" in line
    assert "/etc/passwd is not a .py file" in line


def test_a_model_path_holding_a_snakemake_path_variable_is_refused_before_any_job(tmp_path, monkeypatch):
    folder = tmp_path / "<i>"
    folder.mkdir()
    (folder / "net.py").write_text(NET)
    (folder / "layers.py").write_text(LAYERS)
    monkeypatch.chdir(tmp_path)
    line = refusal("<i>/net.py:tiny")
    assert "train.model" in line and "'<i>'" in line and "rename that file or folder" in line


def test_the_code_fingerprint_is_of_the_bytes_imported_not_of_the_file_as_edited_since(user_dir):
    from rectrain.train.run import code_fingerprint

    models.build("net.py:tiny", 3)
    imported = hashlib.sha256(NET.encode()).hexdigest()
    (user_dir / "net.py").write_text(NET + "\n# edited while the run goes on\n")
    assert code_fingerprint("net.py:tiny")[f"model:{user_dir / 'net.py'}"] == imported


def test_evaluate_refuses_weights_whose_model_file_changed_since_training_imported_it(user_dir):
    from rectrain import evaluate, weights

    net = models.build("net.py:tiny", 3)
    ckpt = {"model_name": "net.py:tiny", "num_classes": 3, "code": models.source_digests("net.py:tiny")}
    classes = [{"label": k, "wnid": f"n{k}", "name": str(k)} for k in range(3)]
    about = weights.describe(
        32, None, {"model": "net.py:tiny", "model_args": {}, "blurpool": False}, classes, epoch=1, recipe={}
    )
    weights.save(net.state_dict(), about, user_dir / "w.safetensors")
    assert evaluate.model_from_weights(str(user_dir / "w.safetensors"), ckpt) is not None
    # a sign flip appended, as mid-run: the same tensors fit, the logits are negated
    flip = "\n_trained = tiny\n\n\ndef tiny(num_classes, width=8):\n    net = _trained(num_classes, width)\n"
    flip += "    net.register_forward_hook(lambda module, args, out: -out)\n    return net\n"
    (user_dir / "net.py").write_text(NET + flip)
    with pytest.raises(evaluate.ModelEdited, match=r"net.py changed since training imported it, .* --forcerun train"):
        evaluate.model_from_weights(str(user_dir / "w.safetensors"), ckpt)
