"""torchvision weights in torch.hub's cache without the network: a state dict of the test's own saved
under a published-style name (`<stem>-<sha256 prefix>.pth`) whose hash prefix is its own, and
rectrain's torchvision reader pointed at that name (rectrain.train.init_weights.weights_url)."""

import hashlib
import io

import torch

from rectrain.train import init_weights


def cache_as_published(torch_home, monkeypatch, state_dict: dict, stem: str = "resnet18") -> str:
    """Put `state_dict` in $TORCH_HOME/hub/checkpoints as torchvision publishes a file (its hash in its
    name) and make every enum's URL that name; returns the URL."""
    monkeypatch.setenv("TORCH_HOME", str(torch_home))
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    data = buffer.getvalue()
    name = f"{stem}-{hashlib.sha256(data).hexdigest()[:8]}.pth"
    cache = torch_home / "hub" / "checkpoints"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / name).write_bytes(data)
    url = f"https://download.pytorch.org/models/{name}"
    monkeypatch.setattr(init_weights, "weights_url", lambda enum: url)
    return url
