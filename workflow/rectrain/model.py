"""The network and its numerics, shared by training, evaluation, the memory preflight and the benches:
one model factory and one autocast context, so every pass computes the same way."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import torch
import torchvision

from rectrain import modelspec

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def build(
    name: str,
    num_classes: int,
    channels_last: bool = False,
    *,
    zero_init_residual: bool = False,
    blurpool: bool = False,
    model_args: dict | None = None,
) -> torch.nn.Module:
    """The network train.model names (rectrain.modelspec: a torchvision registry name, timm:<name>, or
    your own factory in a file or module), randomly initialised, with train.model_args.  zero_init_residual
    zeroes each residual branch's last norm weight, so every block starts as the identity (Goyal et al.
    2017): torchvision's ResNet family's constructor option, timm's zero_init_last, or a factory that takes
    zero_init_residual; blurpool anti-aliases the strided convolutions (add_blurpool).  Where either cannot
    apply to a timm model or your own, the run is refused naming the key."""
    spec = modelspec.parse(name)
    args = dict(model_args or {})
    if spec.kind == "torchvision":
        model = torchvision_model(name, num_classes, zero_init_residual, args)
    elif spec.kind == "timm":
        model = timm_model(spec.target, num_classes, zero_init_residual, args)
    else:
        model = factory_model(spec, name, num_classes, zero_init_residual, args)
    if blurpool:
        wrapped = sum(isinstance(m, BlurPoolConv2d) for m in add_blurpool(model).modules())
        if not wrapped and spec.kind != "torchvision":
            raise ValueError(
                f"train.blurpool: true but {name} has no strided Conv2d with >= 16 input channels to anti-alias; "
                "set train.blurpool: false"
            )
    return model.to(memory_format=torch.channels_last) if channels_last else model


def torchvision_model(name: str, num_classes: int, zero_init_residual: bool, args: dict) -> torch.nn.Module:
    kwargs = {"num_classes": num_classes, **args}
    if zero_init_residual and is_resnet(name):
        kwargs["zero_init_residual"] = True
    try:
        return torchvision.models.get_model(name, **kwargs)
    except ValueError as err:
        raise ValueError(
            f"model {name!r} is not a torchvision model ({err}); fix train.model (a torchvision name, "
            "timm:<name>, path/to/file.py:factory or package.module:factory)"
        ) from None


def timm_model(name: str, num_classes: int, zero_init_residual: bool, args: dict) -> torch.nn.Module:
    import timm  # only timm models need it

    if not timm.is_model(name):
        raise ValueError(f"train.model 'timm:{name}': timm has no model {name!r}; fix train.model (timm.list_models())")
    kwargs = {"pretrained": False, "num_classes": num_classes, **args}
    if zero_init_residual:
        kwargs["zero_init_last"] = True
    try:
        return timm.create_model(name, **kwargs)
    except TypeError as err:
        if zero_init_residual and "zero_init_last" in str(err):
            raise ValueError(
                f"train.zero_init_residual: true but timm's {name} has no zero_init_last option; "
                "set train.zero_init_residual: false"
            ) from None
        raise


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


def load_factory(spec, name: str):
    """The factory function train.model names, imported (a file: as a module, its folder importable)."""
    if spec.kind == "file":
        path = Path(spec.target)
        if not path.is_file():
            raise ValueError(
                f"train.model {name!r}: no such file {path}; fix the path (relative to the working directory, "
                "or absolute)"
            )
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))  # its local imports
        module_name = f"rectrain_user_model_{path.stem}"
        found = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(found)
        sys.modules[module_name] = module
        try:
            found.loader.exec_module(module)
        except Exception as err:
            raise ValueError(
                f"train.model {name!r}: importing {path} raised {type(err).__name__}: {err}; fix the file"
            ) from None
    else:
        try:
            module = importlib.import_module(spec.target)
        except ImportError as err:
            raise ValueError(
                f"train.model {name!r}: cannot import {spec.target} ({err}); install it or put it on PYTHONPATH"
            ) from None
    factory = getattr(module, spec.factory, None)
    if not callable(factory):
        raise ValueError(
            f"train.model {name!r}: {spec.target} has no function {spec.factory!r}; define it there "
            f"(def {spec.factory}(num_classes, **model_args) returning the network) or fix the name after ':'"
        )
    return factory


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


def load_weights(path, backbone: bool = False) -> torch.nn.Module:
    """The network of a published weights.safetensors (rectrain.weights), rebuilt from the file alone
    and in eval mode: the architecture its header names (BlurPool layers included), its tensors loaded
    strictly.  backbone=True: without its classifier head, returning features (see `backbone`)."""
    from rectrain import weights  # safetensors is needed only here, not by every stage importing this module

    about = weights.description(path)
    model = build(
        about["model"],
        int(about["num_classes"]),
        blurpool=bool(about.get("blurpool", False)),
        model_args=about.get("model_args"),
    )
    model.load_state_dict(weights.tensors(path), strict=True)
    return (as_backbone(model) if backbone else model).eval()


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


def add_blurpool(model: torch.nn.Module, min_channels: int = 16) -> torch.nn.Module:
    """Wrap every strided Conv2d with at least `min_channels` input channels in BlurPoolConv2d, in place
    (FFCV's rule: the RGB stem, 3 channels, is left alone)."""
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Conv2d) and max(child.stride) > 1 and child.in_channels >= min_channels:
            setattr(model, name, BlurPoolConv2d(child))
        else:
            add_blurpool(child, min_channels)
    return model


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
