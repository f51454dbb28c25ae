"""Tiny packed datasets for the training tests: class k is an image of colour PALETTE[k] plus noise,
so a label can be checked against its image after decoding and augmentation, and a model can learn."""

import csv
import io
import json

import numpy as np
import torch
from PIL import Image

from rectrain.loaders import IMAGENET_MEAN, IMAGENET_STD
from rectrain.recordio import IRHeader, RecordWriter, pack_record

PALETTE = [(230, 25, 25), (25, 230, 25), (25, 25, 230), (230, 230, 25), (25, 230, 230)]


def write_rec(path, labels, size=(40, 30), seed=0, name="data"):
    """A .rec/.idx whose record k holds a JPEG of colour PALETTE[labels[k] % 5] (with noise) and label
    labels[k]; records are written in a shuffled order, as the packer does."""
    rng = np.random.default_rng(seed)
    rec, idx = path / f"{name}.rec", path / f"{name}.idx"
    with RecordWriter(rec, idx) as w:
        for key in rng.permutation(len(labels)):
            colour = np.array(PALETTE[labels[key] % len(PALETTE)], np.int16)
            pixels = np.clip(colour + rng.integers(-40, 40, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, "JPEG", quality=90)
            w.write(int(key), pack_record(IRHeader(0, float(labels[key]), int(key), 0), buf.getvalue()))
    return str(rec), str(idx)


def colour_class(images):
    """Nearest PALETTE entry of each normalised image's mean colour."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3)
    std = torch.tensor(IMAGENET_STD).view(1, 3)
    rgb = images.float().mean(dim=(2, 3)) * std + mean
    return torch.cdist(rgb, torch.tensor(PALETTE, dtype=torch.float)).argmin(dim=1)


def packed_dataset(path, n_train=45, n_val=15, classes=5, image_size=(40, 30)):
    """train/val .rec + classes.tsv under path (JPEGs of image_size = (width, height)); returns the
    train CLI's data arguments."""
    path.mkdir(parents=True, exist_ok=True)
    rec, idx = write_rec(path, [i % classes for i in range(n_train)], size=image_size, seed=1, name="train")
    vrec, vidx = write_rec(path, [i % classes for i in range(n_val)], size=image_size, seed=2, name="val")
    tsv = path / "classes.tsv"
    tsv.write_text("label\twnid\tname\n" + "".join(f"{k}\tn{k:08d}\tcolour {k}\n" for k in range(classes)))
    return ["--rec", rec, "--idx", idx, "--val-rec", vrec, "--val-idx", vidx, "--classes", str(tsv)]


# What differs from the schema's train defaults to make a run take seconds on a CPU.  The CLI gets
# only these (a partial block, completed from config/schema.yaml as a block typed by hand is).
TINY_TRAIN = {
    "devices": "cpu",
    "cpu_processes": 2,
    "image_size": 32,
    "epochs": 2,
    "batch_size": 8,
    "workers": 1,
    "sample_interval_s": 0.2,
    # A rank that hangs (a CI run once saw one never reach validation's all-reduce, and ignore torchrun's
    # SIGTERM) is ended by its watchdog, which prints every thread's stack (failure_text keeps them), before
    # its peer's collective timeout, which would only say the peer timed out.  Both under the tests' 300 s
    # subprocess limits; 150 s leaves a compiled run's first step its time on a loaded box.
    "watchdog_s": 150,
    "collective_timeout_s": 240,
    "calibration_steps": 3,
    "calibration_warmup_steps": 1,
}


def tiny_train_config(**overrides):
    """The whole train block (schema defaults filled) of a tiny CPU run."""
    from rectrain.config import stage_block

    return stage_block("train", config_json(**overrides))


def tiny_train_settings(**overrides):
    """tiny_train_config's block as the typed view the train stage reads (rectrain.settings)."""
    from rectrain import settings

    return settings.train(tiny_train_config(**overrides))


def train_settings(given: dict):
    """The train block `given` (partial, as typed), completed from the schema, as its typed view."""
    from rectrain import settings
    from rectrain.config import stage_block

    return settings.train(stage_block("train", json.dumps(given)))


def train_loader_spec(s, d, rec="", idx="", workers=None):
    """run.loader_spec of the train block's view `s`, handed its parts as train.run.prepare_rank
    does; `workers`: train.workers resolved for `d` unless given."""
    from rectrain.loaders import resolve_workers
    from rectrain.train.run import loader_spec

    workers = resolve_workers(s.loaders.workers, d.local_world_size) if workers is None else workers
    return loader_spec(
        s.loaders, s.resolution, s.network, d, rec, idx, workers=workers, seed=s.launch.seed, epochs=s.optim.epochs
    )


def rank_parts(s, model, loss_fn, d, spec=None, num_classes=5, validated=True):
    """The batchplan.RankParts run.prepare_rank builds from the view `s`: the model and its loss,
    `num_classes` classes, the train loader's `spec` - by default one without data (train_loader_spec) -
    and, when `validated`, the validation loader's; the loader train.loader runs as here."""
    from rectrain.loaders import resolve_loader
    from rectrain.train.batchplan import RankParts

    spec = train_loader_spec(s, d) if spec is None else spec
    val_spec = spec.validation(spec.rec, spec.idx, s.resolution.val_resolution) if validated else None
    classes = [{"label": k} for k in range(num_classes)]
    choice = resolve_loader(s.loaders.loader, spec)
    return RankParts(d, classes, model, loss_fn, 1, spec.workers, spec, choice, {}, val_spec=val_spec)


def plan_batch_of(s, d, parts, previous=None):
    """batchplan.plan_batch for the view `s` as train.trainer calls it."""
    from rectrain.train.batchplan import plan_batch

    return plan_batch(s.batch, d, parts, optim=s.optim, network=s.network, previous=previous)


def config_json(**overrides):
    """The partial train block of a tiny CPU run, as the --config-json a user would type."""
    return json.dumps({**TINY_TRAIN, **overrides})


def rows(path):
    """A telemetry CSV as a list of dicts (column name -> string)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run_identity(**changes):
    """A checkpoint's RunIdentity for the resume tests: a fixed sample, with `changes` applied."""
    from rectrain.train.lifecycle.identity import RunIdentity

    base = dict(
        config={"lr": 0.1, "epochs": 4},
        batch_size=32,
        grad_accum=1,
        world_size=2,
        data={"rec_bytes": 1, "idx_sha256": "a", "headers_sha256": "h"},
        code={"train.py": "aa", "loaders/dali.py": "bb"},
    )
    return RunIdentity(**{**base, **changes})


def first_difference(state, ident):
    """The first item in which the checkpoint `state` differs from the run `ident`, in words (None: the same run)."""
    from rectrain.train.lifecycle.identity import differences

    found = differences(state, ident)
    return found[0].text if found else None
