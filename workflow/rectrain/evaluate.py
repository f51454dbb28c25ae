"""Evaluate the published weights on the val .rec: metrics.json and per_class.csv, and weights.json.

python -m rectrain.evaluate --config-json '<evaluate block>' --checkpoint results/<ds>/train/model.pt \
    --weights results/<ds>/train/weights.safetensors --weights-json results/<ds>/train/weights.json \
    --rec <fast>/<ds>/val.rec --idx <fast>/<ds>/val.idx --classes results/<ds>/index/classes.tsv \
    --out results/<ds>/eval

With --weights the network evaluated is the published weights file (rebuilt from it alone,
rectrain.model.load_weights), not the checkpoint's tensors, and --weights-json records the top-1 measured
on it beside the file's description (rectrain.weights); the checkpoint still gives the run's settings
(loader, precision, devices).  Without --weights the checkpoint's own tensors are evaluated.

Devices: the same plan as training (rectrain.distributed.plan_processes on the checkpoint's train config).
With several GPUs the command re-executes itself under torchrun, one process per GPU, each reading a
contiguous shard of the .rec with padding dropped (the loaders' eval mode), and the per-rank tallies
(confusion matrix, top-5 hits, loss sum) are summed with all_reduce - so the result equals one pass
over every record exactly once. On CPU it runs as one process: a second process on the same cores
adds start-up and gains nothing over torch's intra-op threads. It also runs correctly when started
under torchrun by hand (gloo on CPU).

Test resolutions: one pass over the .rec per entry of evaluate.resolutions (null = training's image
size, or evaluate.resize / evaluate.crop), optionally averaging each image's logits with its mirror
image's (evaluate.flip_tta).  metrics.json keeps the first entry's (the headline's) metrics at its top
level, naming its crop and resize, and lists every entry's in `resolutions`; per_class.csv is the
headline's.

Model shape (architecture, classes, image size) comes from the checkpoint, so the rule's params need
only the evaluate block; the checkpoint is loaded with weights_only=True (no pickled code runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from rectrain import chance, cli, distributed, modelcost, usage, watchdog, weights
from rectrain import model as models
from rectrain.atomic import write_json
from rectrain.data import pairowner
from rectrain.loaders import IMAGENET_PREPROCESS, LoaderSpec, Preprocess, build_loader, eval_resize_for, resolve_workers
from rectrain.log import CONSOLE_LINE
from rectrain.metrics import Tally, all_reduce, tally
from rectrain.progress import Progress
from rectrain.settings import EvaluateSettings
from rectrain.tables import read_classes, spreadsheet_safe
from rectrain.train import curves
from rectrain.train.lifecycle.checkpoint import load as load_checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trained:
    """What evaluation takes from the run that trained the weights: the network's class count and
    training resolution, and how that run computed and read images (the check stage, rectrain.check,
    gives the same for weights trained elsewhere)."""

    num_classes: int
    image_size: int
    precision: str = "fp32"
    loader: str = "dali"
    gpu_decode: bool = True
    decode: str = "auto"
    preprocess: Preprocess = IMAGENET_PREPROCESS  # what training fed the network (the check: the weights' own)


def trained(ckpt: dict) -> Trained:
    """A checkpoint's Trained: its model's shape and its train block's precision and decoding."""
    train_cfg = ckpt.get("config") or {}
    return Trained(
        num_classes=int(ckpt["num_classes"]),
        image_size=int(ckpt["image_size"]),
        precision=train_cfg.get("precision", "fp32"),
        loader=train_cfg.get("loader") or "dali",
        gpu_decode=bool(train_cfg.get("gpu_decode", True)),
        decode=train_cfg.get("decode", "auto"),
    )


@dataclass(frozen=True)
class Resolution:
    """One test resolution: images resized to `resize` on their shorter side, then centre-cropped to `crop`."""

    crop: int
    resize: int


# ---------------------------------------------------------------------------------------------
# Checkpoint -> model


def model_from_weights(path: str, ckpt: dict) -> torch.nn.Module:
    """The published weights file's network, checked to be the checkpoint's run (its class count),
    rebuilt through the run's own train.model (the checkpoint's; never a factory the file names) as
    training imported it (refuse_edited_model)."""
    about = weights.description(path)
    if about.get("num_classes") != int(ckpt["num_classes"]) or about.get("model") != ckpt["model_name"]:
        raise ValueError(
            f"{path} holds {about.get('model')} with {about.get('num_classes')} classes but the checkpoint is "
            f"{ckpt['model_name']} with {ckpt['num_classes']}: they are from different runs; rerun the train rule"
        )
    model = models.load_weights(path, model=ckpt["model_name"])
    refuse_edited_model(ckpt)
    return model


class ModelEdited(ValueError):
    """train.model's source changed since training imported it; names the files and the fix."""


def refuse_edited_model(ckpt: dict) -> None:
    """ModelEdited when the files defining train.model's network (your own) are not, as this process
    imported them, the bytes training imported (the checkpoint's code fingerprint): the number would
    be another network's, not the trained one's."""
    now = models.source_digests(ckpt["model_name"])
    then = {k: v for k, v in (ckpt.get("code") or {}).items() if k.startswith("model:")}
    if now == then:
        return
    changed = sorted(k.removeprefix("model:") for k in set(now) | set(then) if now.get(k) != then.get(k))
    raise ModelEdited(
        f"train.model {ckpt['model_name']!r}: {', '.join(changed)} changed since training imported it, so "
        "evaluating it would measure another network than the one trained: nothing is published. Restore the "
        "file as it was, or retrain with it as it is now (snakemake --forcerun train)"
    )


def model_from_checkpoint(ckpt: dict) -> torch.nn.Module:
    missing = [k for k in ("model", "model_name", "num_classes", "image_size") if k not in ckpt]
    if missing:
        raise KeyError(f"checkpoint lacks {missing}: it was not written by rectrain.train; rerun the train rule")
    model = models.build(
        ckpt["model_name"],
        int(ckpt["num_classes"]),
        blurpool=bool(ckpt.get("blurpool", False)),
        model_args=(ckpt.get("config") or {}).get("model_args"),
    )
    refuse_edited_model(ckpt)
    model.load_state_dict(ckpt["model"])
    return model.eval()


def loader_kind(evaluate: EvaluateSettings, run: Trained) -> str:
    """evaluate.loader, else the loader training used (null in the schema means: as trained)."""
    return evaluate.loader or run.loader


def resolutions(evaluate: EvaluateSettings, run: Trained) -> list[Resolution]:
    """evaluate.resolutions in order (the first is the headline), each once: null = evaluate.resize /
    evaluate.crop, by default training's image_size / 0.875 and image_size; a number r = a centre crop of
    r px from a shorter side of r / 0.875 (so the model can be tested above the size it trained at, as
    FFCV tests at 256 px what it trained at 160-192)."""
    crop = int(evaluate.crop or run.image_size)
    configured = Resolution(crop, int(evaluate.resize or eval_resize_for(crop)))
    out: list[Resolution] = []
    for r in evaluate.resolutions:
        res = configured if r is None else Resolution(int(r), eval_resize_for(int(r)))
        if res not in out:
            out.append(res)
    return out


def eval_spec(
    evaluate: EvaluateSettings, run: Trained, rec: str, idx: str, d: distributed.Dist, res: Resolution
) -> LoaderSpec:
    return LoaderSpec(
        rec=rec,
        idx=idx,
        batch_size=int(evaluate.batch_size),
        image_size=res.crop,
        train=False,
        rank=d.rank,
        world_size=d.world_size,
        workers=resolve_workers(evaluate.workers, d.local_world_size),
        device=str(d.device),
        gpu_decode=run.gpu_decode,
        decode=run.decode,  # 'cpu' keeps the decode off the GPU here too
        resize=res.resize,
        preprocess=run.preprocess,
    )


# ---------------------------------------------------------------------------------------------
# The pass over the data


@dataclass(frozen=True)
class Passes:
    """What every resolution's pass over the val .rec shares."""

    evaluate: EvaluateSettings
    run: Trained
    rec: str
    idx: str
    d: distributed.Dist
    model: torch.nn.Module
    kind: str  # the loader asked for
    channels_last: bool


def tally_at(p: Passes, res: Resolution, label: str) -> Tally:
    """The val .rec at one resolution, every rank's tally summed."""
    spec = eval_spec(p.evaluate, p.run, p.rec, p.idx, p.d, res)
    log.info(
        "rank %d/%d on %s: %s loader, resize %d + centre crop %d%s, batch %d",
        p.d.rank,
        p.d.world_size,
        p.d.device,
        p.kind,
        res.resize,
        res.crop,
        " + flip TTA" if p.evaluate.flip_tta else "",
        spec.batch_size,
    )
    loader = build_loader(p.kind, spec)
    batches = watchdog.watched(loader.epoch(0), label)
    progress = evaluation_progress(p.evaluate, p.d, loader.batches_per_epoch, label)
    t = tally(
        p.model,
        batches,
        p.run.num_classes,
        p.d.device,
        p.run.precision,
        channels_last=p.channels_last,
        progress=progress,
        flip_tta=bool(p.evaluate.flip_tta),
    )
    watchdog.beat("summing the ranks' tallies")
    return all_reduce(t, p.d.device)


def pass_label(res: Resolution, passes: int) -> str:
    """What the progress lines and the watchdog call a pass: one resolution is just 'evaluation'."""
    return "evaluation" if passes == 1 else f"evaluation at {res.crop} px"


# ---------------------------------------------------------------------------------------------
# Outputs


def row(t: Tally, res: Resolution) -> dict:
    """One resolution's line of metrics.json's `resolutions`."""
    return {
        **t.scores(),
        "images": t.images,
        "images_per_s": t.images / t.seconds if t.seconds > 0 else None,
        "crop": res.crop,
        "resize": res.resize,
    }


def metrics(rows: list[dict], loader: str, checkpoint: str, flip_tta: bool) -> dict:
    """metrics.json: the headline resolution's (the first) fields at the top level, as readers of a
    single evaluation expect them, and every resolution's row in `resolutions`."""
    return {**rows[0], "loader": loader, "checkpoint": str(checkpoint), "flip_tta": flip_tta, "resolutions": rows}


def per_class(confusion: torch.Tensor, classes: pd.DataFrame) -> pd.DataFrame:
    """One row per class: accuracy, the class its images were most often mistaken for, and how many
    val images (of any class) the model predicted as it (a model that predicts one class for all)."""
    conf = confusion.cpu().long()
    n = conf.shape[0]
    wnids = dict(zip(classes["label"].astype(int), classes["wnid"].astype(str), strict=True))
    names = dict(zip(classes["label"].astype(int), classes["name"].astype(str), strict=True))
    off = conf.clone()
    off.fill_diagonal_(-1)  # never "confused with itself"
    rows = []
    for label in range(n):
        images, correct = int(conf[label].sum()), int(conf[label, label])
        worst = int(off[label].argmax())
        count = int(off[label, worst])
        rows.append(
            {
                "label": label,
                "wnid": wnids.get(label, ""),
                "name": names.get(label, ""),
                "images": images,
                "correct": correct,
                "accuracy": correct / images if images else float("nan"),
                "most_confused_label": worst if count > 0 else "",
                "most_confused_wnid": wnids.get(worst, "") if count > 0 else "",
                "most_confused_count": max(count, 0),
                "predicted": int(conf[:, label].sum()),
            }
        )
    return pd.DataFrame(rows)


def class_table(path: str | os.PathLike, num_classes: int) -> pd.DataFrame:
    """classes.tsv (rectrain.tables.read_classes: label, wnid, name, as strings) as a table, checked
    against the checkpoint's class count."""
    classes = pd.DataFrame(read_classes(path), columns=["label", "wnid", "name"])
    if len(classes) != num_classes:
        raise ValueError(
            f"{path} lists {len(classes)} classes but the checkpoint's model has {num_classes}: "
            "the index changed after training; rerun train (snakemake reruns it when the index changes)"
        )
    return classes


def write_outputs(out: Path, m: dict, table: pd.DataFrame) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table.map(spreadsheet_safe).to_csv(out / "per_class.csv", index=False)  # class names from the dataset
    write_json(out / "metrics.json", m)  # last: its presence means the outputs are complete


# ---------------------------------------------------------------------------------------------
# Processes


def relaunch_command(devices, cpu_processes: int, argv: list[str], gpu_count: int) -> tuple[list[str], dict] | None:
    """(torchrun argv, env) that run this evaluation on every training GPU (devices, cpu_processes: as
    train.devices and train.cpu_processes were when the checkpoint was written), or None to run in-process."""
    plan = distributed.plan_processes(devices, cpu_processes, gpu_count)
    if plan.kind != "gpu" or plan.nproc < 2:
        return None
    return distributed.torchrun_command(plan, "rectrain.evaluate", argv)


def evaluation_progress(
    evaluate: EvaluateSettings, d: distributed.Dist, batches: int, label: str = "evaluation"
) -> Progress | None:
    """Rank 0's progress lines every evaluate.progress_s (the other ranks log none)."""
    if not d.master:
        return None
    progress = Progress(evaluate.progress_s, d.world_size)
    progress.begin(f"{label} batch", batches)
    return progress


def run(
    evaluate: EvaluateSettings,
    checkpoint: str,
    rec: str,
    idx: str,
    classes_path: str,
    out: str,
    *,
    weights_file: str | None = None,
    weights_json: str | None = None,
) -> dict | None:
    """Evaluate in this process (one rank of torchrun, or alone), once per evaluate.resolutions entry:
    the network of `weights_file` when given (and its top-1 recorded in `weights_json`), else the
    checkpoint's.  Returns the metrics on rank 0."""
    ckpt = load_checkpoint(checkpoint)
    train_cfg = ckpt.get("config") or {}
    # The same process group set-up and collective timeout as training.
    d = distributed.setup(train_cfg.get("devices") != "cpu", train_cfg.get("collective_timeout_s", 600))
    try:
        classes = class_table(classes_path, int(ckpt["num_classes"]))
        p = passes(evaluate, ckpt, rec, idx, d, weights_file)
        todo = resolutions(evaluate, p.run)
        # A rank stalled in reading leaves its peers in the all_reduce below, which the collective timeout
        # ends; but a single process, or every rank stalled at once (a hung filesystem), has no pending
        # collective: the watchdog ends those, with training's train.watchdog_s.
        with watchdog.Watchdog(train_cfg.get("watchdog_s", 900), d.rank, d.world_size, Path(out) / ".watchdog"):
            tallies = [tally_at(p, res, pass_label(res, len(todo))) for res in todo]
            other = weights.other_variant(weights_file) if weights_file else None
            other_rows = variant_rows(p, ckpt, todo, other) if other is not None else None
            used = usage.combined(distributed.all_gather(usage.own(), d))
        if not d.master:
            return None
        rows = [row(t, res) for t, res in zip(tallies, todo, strict=True)]
        m = metrics(rows, p.kind, checkpoint, bool(evaluate.flip_tta))
        if weights_file:
            m["weights"] = str(weights_file)
        if other is not None:  # train.ema: the raw and the averaged weights, each measured
            m["variants"] = variant_metrics(rows, other, other_rows)
        # num_classes: top-5 of 5 classes or fewer is 1.0 by construction; usage: this stage's own CPU and memory
        m.update(num_classes=int(tallies[0].confusion.shape[0]), usage=used)
        m["at_chance"] = at_chance(m["top1"], tallies[0].confusion, ckpt)
        # params and FLOPs at the headline test resolution: the report's and the comparison's first columns
        m["cost"] = model_cost(p.model, todo[0].crop)
        write_outputs(Path(out), m, per_class(tallies[0].confusion, classes))
        if weights_file and weights_json:
            weights.write_json(weights_file, weights_json, weights_evaluation(m), m.get("variants"))
        log_rows(rows, bool(evaluate.flip_tta), ("raw" if other[0] == "ema" else "ema") if other else "")
        if other is not None:
            log_rows(other_rows, bool(evaluate.flip_tta), other[0])
        if train_cfg.get("tensorboard", True):  # the checkpoint's train.tensorboard
            curves.evaluation(Path(checkpoint).parent, rows)
        return m
    finally:
        distributed.teardown()


def model_cost(model: torch.nn.Module, crop: int) -> dict | None:
    """Params and FLOPs at the headline crop (rectrain.modelcost); None, said in the log, when torch's
    FLOP counter cannot trace the network: a count must never cost the evaluation."""
    try:
        return modelcost.cost(model, crop)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        log.warning("params and FLOPs not counted (%s): the report and weights.json leave them out", exc)
        return None


def at_chance(top1: float, confusion: torch.Tensor, ckpt: dict) -> dict | None:
    """metrics.json's and weights.json's `at_chance` (rectrain.chance): the verdict on a run whose top-1 is
    within noise of chance after training long enough to learn, logged to the console too; else None.
    The checkpoint's LR schedule has counted its optimizer steps (LambdaLR's last_epoch)."""
    steps = int((ckpt.get("scheduler") or {}).get("last_epoch") or 0)
    verdict = chance.judge(top1, confusion.sum(dim=1).tolist(), int(ckpt.get("epoch", -1)) + 1, steps)
    if verdict is None:
        return None
    log.warning("%s", verdict.line(), extra=CONSOLE_LINE)
    return verdict.as_dict()


def variant_rows(p: Passes, ckpt: dict, todo: list[Resolution], other: tuple[str, Path]) -> list[dict]:
    """A train.ema run's other weights file (`other`: weights.other_variant) through the same passes:
    its row per test resolution."""
    name, path = other
    model = passes_of(p.evaluate, p.run, p.rec, p.idx, p.d, model_from_weights(str(path), ckpt)).model
    q = dataclasses.replace(p, model=model)
    return [row(tally_at(q, res, f"evaluation of the {name} weights at {res.crop} px"), res) for res in todo]


def variant_metrics(rows: list[dict], other: tuple[str, Path], other_rows: list[dict]) -> dict:
    """metrics.json's `variants` of a train.ema run: {raw: ..., ema: ...}, each with its file, whether it is
    weights.safetensors (the recipe's result), its headline top-1/top-5/loss and every resolution's row."""
    name = other[0]
    result = "raw" if name == "ema" else "ema"

    def entry(variant: str, rows_of: list[dict], is_result: bool) -> dict:
        head = {k: rows_of[0][k] for k in ("top1", "top5", "loss")}
        what = weights.VARIANT_WORDS[variant]
        return {
            "file": weights.VARIANT_FILES[variant],
            "what": what,
            "result": is_result,
            **head,
            "resolutions": rows_of,
        }

    return {result: entry(result, rows, True), name: entry(name, other_rows, False)}


def weights_evaluation(m: dict) -> dict:
    """What weights.json records of this evaluation: the headline top-1/top-5 and every test resolution's,
    and `at_chance` (null unless the run is at chance: rectrain.chance)."""
    return {
        "at_chance": m.get("at_chance"),
        "top1": m["top1"],
        "top5": m["top5"],
        "val_images": m["images"],
        "flip_tta": m["flip_tta"],
        "test_resolutions": [{k: r[k] for k in ("crop", "resize", "top1", "top5")} for r in m["resolutions"]],
        "cost": m.get("cost"),  # params and FLOPs (rectrain.modelcost), its unit stated
    }


def passes(
    evaluate: EvaluateSettings, ckpt: dict, rec: str, idx: str, d: distributed.Dist, weights_file: str | None = None
) -> Passes:
    """The model on this rank's device (channels_last on a GPU) and what each pass needs beside it."""
    model = model_from_weights(weights_file, ckpt) if weights_file else model_from_checkpoint(ckpt)
    return passes_of(evaluate, trained(ckpt), rec, idx, d, model)


def passes_of(
    evaluate: EvaluateSettings, run: Trained, rec: str, idx: str, d: distributed.Dist, model: torch.nn.Module
) -> Passes:
    """`model` on this rank's device (channels_last on a GPU) and what each pass needs beside it."""
    model = model.to(d.device)
    channels_last = d.device.type == "cuda"
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return Passes(evaluate, run, rec, idx, d, model, loader_kind(evaluate, run), channels_last)


def log_rows(rows: list[dict], flip_tta: bool, weights_of: str = "") -> None:
    """One line per test resolution; `weights_of`: which weights of a train.ema run the rows are of."""
    tta = ", flip TTA" if flip_tta else ""
    for k, r in enumerate(rows):
        log.info(
            "%s%s%d px (resize %d%s): top-1 %.2f %%, top-5 %.2f %%, loss %.4f on %d images (%.0f img/s)",
            f"the {weights_of} weights, " if weights_of else "",
            "headline, " if k == 0 and len(rows) > 1 else "",
            r["crop"],
            r["resize"],
            tta,
            100 * r["top1"],
            100 * r["top5"],
            r["loss"],
            r["images"],
            r["images_per_s"] or 0,
        )


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--rec", required=True)
    ap.add_argument("--idx", required=True)
    ap.add_argument("--classes", required=True, help="classes.tsv of the index (label, wnid, name)")
    ap.add_argument("--out", required=True, help="folder for metrics.json and per_class.csv")
    ap.add_argument("--weights", help="the published weights.safetensors to evaluate (else the checkpoint's tensors)")
    ap.add_argument("--weights-json", help="weights.json to write beside --weights, with the top-1 measured on it")
    ap.add_argument("--single-process", action="store_true", help="never relaunch under torchrun")


def _run(args: argparse.Namespace, evaluate: EvaluateSettings) -> None:
    if not distributed.launched() and not args.single_process:
        train_cfg = load_checkpoint(args.checkpoint).get("config") or {}  # the checkpoint's: data, not this stage's
        devices, cpu_processes = train_cfg["devices"], train_cfg["cpu_processes"]
        relaunch = relaunch_command(devices, cpu_processes, args.argv, distributed.visible_gpu_count())
        if relaunch:
            cmd, env = relaunch
            log.info("one process per training GPU: %s", " ".join(cmd))
            os.execve(cmd[0], cmd, env)
    run(
        evaluate,
        args.checkpoint,
        args.rec,
        args.idx,
        args.classes,
        args.out,
        weights_file=args.weights,
        weights_json=args.weights_json,
    )


def main(argv=None) -> int:
    errors = {pairowner.PairChanged: 1, ModelEdited: 1, models.WeightsRefused: 1}
    return cli.main("evaluate", "evaluate", _arguments, _run, argv, errors=errors)


if __name__ == "__main__":
    cli.end(main())
