"""train.model checked while the Snakefile is parsed, before any job runs: a timm name or your own
factory is built and fed two images, so a missing file, an absent or raising factory, a return that is
not a module, or logits of the wrong shape stop Snakemake in one line naming the key, the file and the
fix (a torchvision name is checked by the train job, as before)."""

from __future__ import annotations

import hashlib
import json
import re
from importlib.metadata import version
from pathlib import Path

from rectrain import atomic, modelspec
from rectrain.config import ConfigError
from rectrain.modelspec import TORCHVISION_WEIGHTS as TORCHVISION
from rectrain.safefs import not_a_file
from rectrain.settings import TrainNetwork
from rectrain.tables import read_classes

# The class count tried before the index stage has counted the dataset's: any K tells a head sized by
# num_classes from one that is not.
PROBE_CLASSES = 7


# What Snakemake reads in an input path as a path variable (<name>) or a wildcard ({name}): a file of
# yours whose path holds one cannot be an input of the train rule (its edits would rerun nothing).
SNAKEMAKE_PATTERN = re.compile(r"<[a-z][a-z0-9_]*>|[{}]")


def refuse_snakemake_patterns(key: str, value: str, paths: list[str]) -> None:
    """ConfigError naming `key` when a path among `paths` (the inputs `value` makes) holds a Snakemake pattern."""
    odd = [p for p in paths if SNAKEMAKE_PATTERN.search(str(p))]
    if odd:
        raise ConfigError(
            f"config key '{key}' = {value!r}: {odd[0]} holds {SNAKEMAKE_PATTERN.search(str(odd[0]))[0]!r}, which "
            "Snakemake reads in a path as a path variable or a wildcard; rename that file or folder"
        )


def check_model(network: TrainNetwork, image_size: int, classes_tsv: str | Path, passed: Path | None = None) -> None:
    """Build train.model (`network`: the train block's network part) as the train job will, with the
    dataset's class count when the index has written it, and check its logits' shape at train.image_size;
    a problem raises ConfigError.  train.init_weights, when a path, must be a file.  `passed`: a file
    remembering the checks that passed (the Snakefile's, PASSED), so that a parse repeating one skips it."""
    init = network.init_weights
    if init is not None and not init.startswith(TORCHVISION) and (why := not_a_file(init)):
        raise ConfigError(
            f"config key 'train.init_weights' = {init!r}: {why}; give a weights.safetensors, a model.pt "
            "or a state dict saved by torch (or torchvision:<Enum>.<NAME>), or null for a random init"
        )
    if init is not None and not init.startswith(TORCHVISION):
        refuse_snakemake_patterns("train.init_weights", init, [init])
    if modelspec.parse(network.model).kind == "torchvision":
        return
    refuse_snakemake_patterns("train.model", network.model, modelspec.sources(network.model))
    k = len(read_classes(classes_tsv)) if Path(classes_tsv).is_file() else PROBE_CLASSES
    if passed is None:
        _build_and_check(network, int(image_size), k)
        return
    key, known = check_key(network, int(image_size), k), _read_passed(passed)
    if key not in known:
        _build_and_check(network, int(image_size), k)
        atomic.write_json(passed, sorted(known | {key}))


# Where the Snakefile keeps the checks that passed: a dry-run of a sweep or of your own model would
# otherwise import torch and build each network at every parse (3 of a sweep's 4 CPU-s, bench/RESULTS.md,
# "The test suite's wall time for issue 48").
PASSED = Path(".snakemake") / "rectrain" / "model-checks.json"


def check_key(network: TrainNetwork, image_size: int, classes: int) -> str:
    """Everything the check's answer depends on, hashed: the model and its arguments, the image size, the
    class count, the bytes of your own model's files and the torch and timm releases that build it."""
    files = {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in modelspec.sources(network.model)}
    given = [network.model, network.model_args, network.zero_init_residual, network.blurpool, image_size, classes]
    text = json.dumps([given, files, version("torch"), version("timm")], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_passed(path: Path) -> set[str]:
    try:
        return set(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):  # none yet, or torn by a crash: the checks run again
        return set()


def _build_and_check(network: TrainNetwork, image_size: int, k: int) -> None:
    from rectrain import model as models  # torch: only for a model that is not torchvision's

    try:
        net = models.build(
            network.model,
            k,
            zero_init_residual=bool(network.zero_init_residual),
            blurpool=bool(network.blurpool),
            model_args=network.model_args,
        )
        models.check_logits(net, network.model, k, int(image_size))
        models.check_gradients(net, network.model, int(image_size))
    except ValueError as err:
        raise ConfigError(str(err)) from None
