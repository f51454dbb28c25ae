"""The network and its numerics, shared by training, evaluation, the memory preflight and the benches:
one model factory and one autocast context, so every pass computes the same way."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import importlib
import importlib.abc
import importlib.util
import inspect
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision

from rectrain import modelspec, safefs

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def build(name: str, num_classes: int, channels_last: bool = False, **mechanics) -> torch.nn.Module:
    """The network train.model names (rectrain.modelspec: a torchvision registry name, timm:<name>, or
    your own factory in a file or module), randomly initialised, with train.model_args and the model-
    dependent mechanics applied: `construct`'s network (`mechanics`: its keyword arguments), without the
    record of what each changed."""
    return construct(name, num_classes, channels_last, **mechanics)[0]


def construct(
    name: str,
    num_classes: int,
    channels_last: bool = False,
    *,
    zero_init_residual: bool = False,
    blurpool: bool = False,
    model_args: dict | None = None,
) -> tuple[torch.nn.Module, dict]:
    """(the network as `build` makes it, what each mechanic changed in it: {key: {asked, changed, what}}).

    Every model kind goes through the same two mechanics, and each is counted on the network itself, so
    a mechanic that changes nothing is refused naming the key instead of being recorded as on:
    zero_init_residual zeroes each residual branch's last norm weight, so every block starts as the
    identity (Goyal et al. 2017) - torchvision's ResNet constructors' option, timm's zero_init_last, or a
    factory's zero_init_residual argument; what it changed is what differs from the same network built
    with it off.  Off, it is off in timm too, whose default is on.  blurpool anti-aliases the strided
    convolutions (add_blurpool)."""
    spec = modelspec.parse(name)
    args = dict(model_args or {})
    model = constructed(spec, name, num_classes, zero_init_residual, args)
    zeroed = zero_weights(model)
    if zero_init_residual:
        with torch.random.fork_rng(devices=[]):  # the comparison build draws nothing from the run's stream
            zeroed = sorted(set(zeroed) - set(zero_weights(constructed(spec, name, num_classes, False, args))))
        if not zeroed:
            raise ValueError(
                f"train.zero_init_residual: true but {name} zeroes no weight with it (its blocks have no residual "
                "norm it applies to); set train.zero_init_residual: false"
            )
    layers = blurpool_layers(add_blurpool(model)) if blurpool else []
    if blurpool and not layers:
        raise ValueError(
            f"train.blurpool: true but {name} has no strided Conv2d with >= 16 input channels to anti-alias; "
            "set train.blurpool: false"
        )
    applied = {
        "zero_init_residual": {"asked": zero_init_residual, "changed": len(zeroed), "what": name_patterns(zeroed)},
        "blurpool": {"asked": blurpool, "changed": len(layers), "what": layers},
    }
    return (model.to(memory_format=torch.channels_last) if channels_last else model), applied


def mechanics_line(name: str, applied: dict) -> str:
    """The log's line of what each mechanic changed in `name` (construct's second value)."""
    zero, blur = applied["zero_init_residual"], applied["blurpool"]
    parts = [
        f"zero_init_residual {'zeroed ' + str(zero['changed']) + ' weight(s)' if zero['asked'] else 'off'}"
        + (f" ({', '.join(zero['what'])})" if zero["what"] else ""),
        f"blurpool {'wraps ' + str(blur['changed']) + ' strided convolution(s)' if blur['asked'] else 'off'}",
    ]
    return f"train.model {name}: " + "; ".join(parts)


def constructed(spec, name: str, num_classes: int, zero_init_residual: bool, args: dict) -> torch.nn.Module:
    """The network of `spec` with zero_init_residual handed to its constructor, before the mechanics count."""
    if spec.kind == "torchvision":
        return torchvision_model(name, num_classes, zero_init_residual, args)
    if spec.kind == "timm":
        return timm_model(spec.target, num_classes, zero_init_residual, args)
    return factory_model(spec, name, num_classes, zero_init_residual, args)


def zero_weights(model: torch.nn.Module) -> list[str]:
    """Names of the parameters, biases aside, that are all zero: what a zero-init leaves (a lazy module's
    parameters, not yet shaped, are none)."""
    return [
        n
        for n, p in model.named_parameters()
        if not n.endswith("bias") and not torch.nn.parameter.is_lazy(p) and not p.detach().any()
    ]


def name_patterns(names) -> dict[str, int]:
    """Parameter or module names grouped by their shape, each index replaced by * (layer1.0.bn2.weight and
    layer1.1.bn2.weight are layer1.*.bn2.weight), with counts: what run.json lists of long name lists."""
    counts: dict[str, int] = {}
    for name in names:
        pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
        counts[pattern] = counts.get(pattern, 0) + 1
    return counts


# The parameters the architectures' recipes exempt from weight decay, for torchvision's models (timm's
# name theirs in no_weight_decay(); timm's rule, rectrain.train.optim, exempts every 1-D tensor besides):
# ViT's class token and position embedding and Swin's relative-position bias tables (torchvision's
# references give them --transformer-embedding-decay 0; DeiT's and Swin's no_weight_decay() name them),
# ConvNeXt's layer-scale gammas (1-D in the authors' code and timm's, hence exempt there; C x 1 x 1 here).
TORCHVISION_NO_DECAY = ("class_token", "*pos_embedding", "*relative_position_bias_table", "*layer_scale")


def torchvision_model(name: str, num_classes: int, zero_init_residual: bool, args: dict) -> torch.nn.Module:
    kwargs = {"num_classes": num_classes, **args}
    if zero_init_residual:
        kwargs["zero_init_residual"] = True
    try:
        model = torchvision.models.get_model(name, **kwargs)
    except ValueError as err:
        raise ValueError(
            f"model {name!r} is not a torchvision model ({err}); fix train.model (a torchvision name, "
            "timm:<name>, path/to/file.py:factory or package.module:factory)"
        ) from None
    except TypeError as err:
        if zero_init_residual and "zero_init_residual" in str(err):
            raise ValueError(
                f"train.zero_init_residual: true but torchvision's {name} has no zero_init_residual option (only "
                "its ResNet family has); set train.zero_init_residual: false"
            ) from None
        raise
    exempt = {n for n, _ in model.named_parameters() if any(fnmatch.fnmatch(n, p) for p in TORCHVISION_NO_DECAY)}
    if exempt:
        model.no_weight_decay = lambda: set(exempt)  # what timm's models declare, read by timm's optimizer factory
    return model


def timm_model(name: str, num_classes: int, zero_init_residual: bool, args: dict) -> torch.nn.Module:
    """timm's network, pretrained=False; zero_init_last as train.zero_init_residual says, off included
    (timm's ResNet, RegNet and CSPNet families zero-init by default), where the model takes it."""
    import timm  # only timm models need it

    if not timm.is_model(name):
        raise ValueError(f"train.model 'timm:{name}': timm has no model {name!r}; fix train.model (timm.list_models())")
    kwargs = {"pretrained": False, "num_classes": num_classes, **args}
    try:
        return timm.create_model(name, zero_init_last=zero_init_residual, **kwargs)
    except TypeError as err:
        if "zero_init_last" not in str(err):
            raise
        if zero_init_residual:
            raise ValueError(
                f"train.zero_init_residual: true but timm's {name} has no zero_init_last option; "
                "set train.zero_init_residual: false"
            ) from None
    return timm.create_model(name, **kwargs)  # no such option: nothing of it to turn off


def factory_model(spec, name: str, num_classes: int, zero_init_residual: bool, args: dict) -> torch.nn.Module:
    """Your factory's network: factory(num_classes=K, **train.model_args), zero_init_residual=True
    added when the factory takes it."""
    factory = load_factory(spec, name)
    if zero_init_residual:
        if "zero_init_residual" not in inspect.signature(factory).parameters:
            raise ValueError(
                f"train.zero_init_residual: true but {name} takes no zero_init_residual argument; give the factory "
                "one, or set train.zero_init_residual: false"
            )
        args = {**args, "zero_init_residual": True}
    where = spec.target
    try:
        model = factory(num_classes=num_classes, **args)
    except Exception as err:
        raise ValueError(
            f"train.model {name!r}: {spec.factory}(num_classes={num_classes}, **train.model_args) in {where} raised "
            f"{type(err).__name__}: {err}; fix the factory or train.model_args"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"train.model {name!r}: {spec.factory} in {where} returned {type(model).__name__}, not a torch.nn.Module; "
            "return the network"
        )
    return model


class WeightsRefused(ValueError):
    """A weights file whose header rectrain will not act on (it names code to run, or arguments that
    fetch or read other files); the message names the file and the fix."""


@dataclass(frozen=True)
class Source:
    """The source of a model of your own, read once (rectrain.modelspec.read_sources): the factory's
    file (or module) first, then the local modules it imports, by absolute path.  These very bytes are
    executed (load_factory) and hashed (digests: the run's code fingerprint, checked by evaluate)."""

    files: dict[Path, bytes]

    @property
    def root(self) -> Path:
        return next(iter(self.files)).parent

    def digests(self) -> dict[str, str]:
        return {f"model:{p}": hashlib.sha256(b).hexdigest() for p, b in sorted(self.files.items())}


# The Source each model of your own was imported from in this process, by train.model's value.
_IMPORTED: dict[str, Source] = {}


def source_digests(name: str) -> dict[str, str]:
    """sha256 of each file defining train.model `name`'s network as this process imported it ({} for a
    torchvision or timm name); a name not imported here is read now."""
    if name in _IMPORTED:
        return _IMPORTED[name].digests()
    spec = modelspec.parse(name)
    origin = Path(spec.target) if spec.kind == "file" else modelspec.module_origin(spec.target) if spec.custom else None
    return Source(modelspec.read_sources(origin)).digests() if origin and origin.is_file() else {}


class _BytesLoader(importlib.abc.Loader):
    """Executes a module from the bytes read into a Source (never from the file again, nor from a
    cached .pyc beside it, which could be another file's)."""

    def __init__(self, data: bytes, path: Path):
        self.data, self.path = data, path

    def exec_module(self, module) -> None:
        exec(compile(self.data, str(self.path), "exec"), module.__dict__)


class _LocalModules(importlib.abc.MetaPathFinder):
    """The modules beside a model file, served from its Source.  Asked after every other finder (the
    standard library and the installed packages come first) and never for a standard-library name, and
    only while the factory's module runs and its factory is called (`importable`): a file planted beside
    the model under a name Python or Snakemake imports later is never imported (issue 47)."""

    def __init__(self, source: Source):
        self.source = source

    def find_spec(self, fullname, path=None, target=None):
        if modelspec.standard_library(fullname):
            return None
        stem = self.source.root.joinpath(*fullname.split("."))
        for file, package in ((stem.with_suffix(".py"), False), (stem / "__init__.py", True)):
            if file in self.source.files:
                where = [str(stem)] if package else None
                loader = _BytesLoader(self.source.files[file], file)
                return importlib.util.spec_from_file_location(
                    fullname, file, loader=loader, submodule_search_locations=where
                )
        return None


@contextlib.contextmanager
def importable(source: Source):
    """The model's local modules importable (from `source`) inside the block only."""
    finder = _LocalModules(source)
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def _refuse(name: str, words: str) -> ValueError:
    return ValueError(f"train.model {name!r}: {words}")


def _factory_source(spec, name: str) -> Source:
    """The factory's file (or module) and its local modules, read once, after the checks that need no
    import: a .py file, regular (a FIFO is refused, not waited on), not the standard library's."""
    if spec.kind == "module":
        if modelspec.standard_library(spec.target):
            raise _refuse(name, f"{spec.target} is a module of Python's standard library, not a model; name your own")
        origin = modelspec.module_origin(spec.target)
        if origin is None:
            raise _refuse(
                name, f"cannot find {spec.target} as a .py module; install it or put its folder on PYTHONPATH"
            )
    else:
        origin = Path(spec.target)
        if not origin.exists():
            raise _refuse(name, f"no such file {origin}; fix the path (relative to the working directory, or absolute)")
        if origin.suffix != ".py":
            raise _refuse(name, f"{origin} is not a .py file; name the Python file that defines the factory")
    mode = origin.stat().st_mode
    if not stat.S_ISREG(mode):
        raise _refuse(name, f"{origin} is {safefs.special_file(mode)}, not a regular file; name the .py file itself")
    files = modelspec.read_sources(origin)  # the factory's file first
    if origin.resolve() not in files:
        raise _refuse(name, f"{origin} could not be read (replaced while it was read?); run again")
    return Source(files)


def load_factory(spec, name: str):
    """The factory function train.model names.  Its source is read once (Source) and checked to define
    the factory before anything runs (no import for its side effects); then the module is executed from
    those bytes - a file as a module of its own, its local modules importable only meanwhile and after
    the standard library and installed packages (never ahead of them: a scoped finder, not a folder
    first on sys.path) - and the factory, called, sees them too."""
    source = _factory_source(spec, name)
    origin, data = next(iter(source.files.items()))
    try:
        defined = modelspec.defines(data, str(origin), spec.factory)
    except (SyntaxError, ValueError) as err:
        raise _refuse(name, f"{origin} does not parse ({type(err).__name__}: {err}); fix the file") from None
    if not defined:
        raise _refuse(
            name,
            f"{spec.target} has no function {spec.factory!r}; define it there (def {spec.factory}(num_classes, "
            "**model_args) returning the network) or fix the name after ':'",
        )
    module = _execute(spec, name, source)
    factory = getattr(module, spec.factory, None)
    if not callable(factory):
        raise _refuse(name, f"{spec.target}'s {spec.factory!r} is not a function; define it as one")
    _IMPORTED[name] = source

    @functools.wraps(factory)  # its signature is still the factory's (inspect follows __wrapped__)
    def call(*args, **kwargs):
        with importable(source):
            return factory(*args, **kwargs)

    return call


def _execute(spec, name: str, source: Source):
    """The factory's module, executed from the Source's bytes (a module's parent packages imported first)."""
    origin, data = next(iter(source.files.items()))
    if spec.kind == "file":
        module_name, where = f"rectrain_user_model_{origin.stem}", None
    else:
        module_name = spec.target
        where = [str(origin.parent)] if origin.name == "__init__.py" else None
    loader = _BytesLoader(data, origin)
    found = importlib.util.spec_from_file_location(module_name, origin, loader=loader, submodule_search_locations=where)
    module = importlib.util.module_from_spec(found)
    try:
        with importable(source) if spec.kind == "file" else contextlib.nullcontext():
            if spec.kind == "module" and "." in module_name:
                importlib.import_module(module_name.rpartition(".")[0])
            sys.modules[module_name] = module
            loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise _refuse(name, f"importing {origin} raised {type(err).__name__}: {err}; fix the file") from None
    return module


def check_logits(model: torch.nn.Module, name: str, num_classes: int, image_size: int) -> None:
    """Refuse a network that does not map N x 3 x H x W images to N x K logits, naming train.model."""
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, 3, image_size, image_size))
    except Exception as err:
        raise ValueError(
            f"train.model {name!r}: its forward pass on 2 images of 3 x {image_size} x {image_size} raised "
            f"{type(err).__name__}: {err}; fix the network (or train.image_size)"
        ) from None
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if shape != (2, num_classes):
        raise ValueError(
            f"train.model {name!r}: 2 images of 3 x {image_size} x {image_size} gave {shape}, not (2, {num_classes}) "
            "logits; make the network return N x num_classes logits (its head sized by num_classes)"
        )


# Constructor arguments of torchvision's and timm's models that download or read weights (a hub name,
# a URL, a path): a weights file's header never makes the loader fetch or unpickle another file.
FETCHING_ARGS = frozenset(
    {
        "weights",
        "weights_backbone",
        "progress",
        "pretrained",
        "pretrained_cfg",
        "pretrained_cfg_overlay",
        "pretrained_strict",
        "checkpoint_path",
        "cache_dir",
    }
)


def load_weights(path, backbone: bool = False, *, model: str | None = None) -> torch.nn.Module:
    """The network of a published weights.safetensors (rectrain.weights), in eval mode, its tensors
    loaded strictly.  The architecture its header names is rebuilt only from a closed set - a
    torchvision name, timm:<name>, either with rectrain's BlurPool layers - and nothing the file says is
    imported or run: a model of your own is rebuilt through the factory you name, `model` (train.model's
    forms: path/to/file.py:factory or package.module:factory), never one the file names.  The tensors are
    the plain architecture's; BlurPool goes back on the convolutions the header lists (`blurpool_layers`).
    backbone=True: without its classifier head, returning features (see `backbone`)."""
    from rectrain import weights  # safetensors is needed only here, not by every stage importing this module

    about = weights.description(path)
    name = architecture(about, path, model)
    classes = about.get("num_classes")
    if not isinstance(classes, int) or isinstance(classes, bool) or classes < 1:
        raise WeightsRefused(f"{path}: its header's num_classes {classes!r} is not a class count; republish the file")
    blurpool = about.get("blurpool", False)
    if not isinstance(blurpool, bool):
        raise WeightsRefused(f"{path}: its header's blurpool {blurpool!r} is not true or false; republish the file")
    args = header_args(about, path, custom=model is not None)
    layers = about.get("blurpool_layers")  # absent in a file written before the plain architecture's names
    if layers is not None and not (isinstance(layers, list) and all(isinstance(n, str) for n in layers)):
        raise WeightsRefused(
            f"{path}: its header's blurpool_layers {layers!r} is not a list of names; republish the file"
        )
    try:
        net = build(name, classes, blurpool=blurpool and layers is None, model_args=args)
    except (TypeError, ValueError) as err:
        raise WeightsRefused(f"{path}: {name} cannot be built with the header's model_args {args} ({err})") from None
    net.load_state_dict(weights.tensors(path), strict=True)
    if layers:
        try:
            add_blurpool(net, layers=layers)  # the filter has no parameters: put back where it ran
        except (AttributeError, TypeError) as err:
            raise WeightsRefused(
                f"{path}: its header's blurpool_layers do not fit {name} ({err}); republish the file"
            ) from None
    return (as_backbone(net) if backbone else net).eval()


def architecture(about: dict, path, model: str | None) -> str:
    """The train.model to rebuild `path`'s network with: `model` when the caller names one, else the
    header's, if it is a torchvision or timm name; a header naming a factory is refused."""
    named = about.get("model")
    if model is not None:
        return model
    if not isinstance(named, str) or not named:
        raise WeightsRefused(f"{path}: its header names no architecture (model: {named!r}); republish the file")
    if modelspec.parse(named).custom:
        raise WeightsRefused(
            f"{path} was trained with a model of its own ({named!r}), and a weights file never makes rectrain "
            "import code: name the factory yourself - load_weights(path, model='path/to/file.py:factory'), or "
            "check.model for the check stage - after reading that code"
        )
    return named


def header_args(about: dict, path, custom: bool) -> dict:
    """The header's model_args, for a torchvision or timm constructor only without the arguments that
    fetch or read weights (FETCHING_ARGS); your own factory (`custom`) gets them as the run configured."""
    args = about.get("model_args") or {}
    if not isinstance(args, dict):
        raise WeightsRefused(f"{path}: its header's model_args {args!r} is not a mapping; republish the file")
    fetching = sorted(set(args) & FETCHING_ARGS)
    if fetching and not custom:
        raise WeightsRefused(
            f"{path}: its header's model_args {', '.join(fetching)} would make the constructor download or read "
            "other weights; load only files whose model_args build the network (republish it without them)"
        )
    return args


def as_backbone(model: torch.nn.Module) -> torch.nn.Module:
    """`model` without its classifier head, in place: the last Linear layer (torchvision's `fc`,
    `classifier[-1]`, `heads.head`) becomes the identity, so the network returns the features it fed."""
    heads = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if not heads:
        raise ValueError(f"{type(model).__name__} has no Linear classifier head to remove")
    parent_name, _, child = heads[-1].rpartition(".")
    setattr(model.get_submodule(parent_name), child, torch.nn.Identity())
    return model


def is_resnet(name: str) -> bool:
    """torchvision's ResNet family (resnet*, resnext*, wide_resnet*): the constructors that take
    zero_init_residual."""
    return name.startswith(("resnet", "resnext", "wide_resnet"))


class BlurPoolConv2d(torch.nn.Module):
    """A strided convolution that first low-pass filters its input with a fixed 3x3 binomial kernel
    ([1, 2, 1] outer [1, 2, 1] / 16, depthwise, stride 1), so the stride no longer aliases (Zhang 2019,
    "Making convolutional networks shift-invariant again"; FFCV applies it to torchvision ResNets).
    The kernel is a non-persistent buffer: the state dict keeps the conv's weights under `conv.`."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        self.conv = conv
        taps = torch.tensor([1.0, 2.0, 1.0])
        kernel = torch.outer(taps, taps) / 16.0
        self.register_buffer("blur", kernel.expand(conv.in_channels, 1, 3, 3).clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blurred = torch.nn.functional.conv2d(x, self.blur.to(x.dtype), padding=1, groups=self.conv.in_channels)
        return self.conv(blurred)


def add_blurpool(model: torch.nn.Module, min_channels: int = 16, *, layers=None) -> torch.nn.Module:
    """Wrap every strided Conv2d with at least `min_channels` input channels in BlurPoolConv2d, in place
    (FFCV's rule: the RGB stem, 3 channels, is left alone); or, given `layers` (blurpool_layers of a
    trained network, as weights.json lists them), exactly those convolutions."""
    if layers is not None:
        for name in layers:
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent)
            conv = getattr(owner, child)
            if not isinstance(conv, torch.nn.Conv2d):
                raise TypeError(f"{name} is a {type(conv).__name__}, not a Conv2d")
            setattr(owner, child, BlurPoolConv2d(conv))
        return model
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Conv2d) and max(child.stride) > 1 and child.in_channels >= min_channels:
            setattr(model, name, BlurPoolConv2d(child))
        else:
            add_blurpool(child, min_channels)
    return model


def blurpool_layers(model: torch.nn.Module) -> list[str]:
    """The convolutions BlurPool wraps in `model`, by their names in the plain architecture."""
    return [name for name, m in model.named_modules() if isinstance(m, BlurPoolConv2d)]


def plain_state_dict(state: dict, layers) -> dict:
    """A BlurPool network's state dict under the plain architecture's names: `<layer>.conv.weight` of each
    wrapped convolution in `layers` becomes `<layer>.weight` (the filter itself has no parameters), so the
    architecture's own library or factory loads it strictly."""
    prefixes = {f"{layer}.conv.": f"{layer}." for layer in layers}
    out = {}
    for key, value in state.items():
        head = next((p for p in prefixes if key.startswith(p)), None)
        out[prefixes[head] + key[len(head) :] if head else key] = value
    return out


def resolve_precision(setting: str, device: torch.device) -> str:
    """train.precision as it runs on `device`: `auto` is bf16 on a GPU that has it (compute capability 8.0
    and later), fp16 on an older one (the reference box's Turing), and fp32 on a CPU.  Not bf16 on a CPU:
    torch 2.14.1's CPU bf16 convolution computes its weight gradient from uninitialised memory for a 3x3
    stride-2 convolution over a 1 x 1 map (a ResNet's layer4 at 16 px and below), which turned short runs
    to NaN at random (bench/bf16_cpu_conv.py, bench/RESULTS.md "bf16 on the CPU").  An explicit value runs
    as given."""
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return "fp32"
    try:
        return "bf16" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp16"
    except (RuntimeError, AssertionError):  # no driver to ask (a plan made for a GPU not here): today's GPUs'
        return "bf16"


def amp_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of train.precision (None for fp32)."""
    return AMP_DTYPES[precision]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision as train.precision asks, on the device's own autocast (CPU bf16 included)."""
    dtype = amp_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def check_gradients(model: torch.nn.Module, name: str, image_size: int) -> None:
    """Refuse a network with trainable parameters that get no gradient from its logits: DDP all-reduces
    every parameter's gradient each step and stops (or, with a static graph, trains them never) when one
    has none.  One backward pass in train mode on 2 random images."""
    model.train()
    model.zero_grad(set_to_none=True)
    model(torch.randn(2, 3, image_size, image_size)).float().sum().backward()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ValueError(
            f"train.model {name!r}: parameters {shown} get no gradient from the logits, which DDP cannot "
            "train across processes; use them in forward, delete them, or set requires_grad=False on them"
        )
