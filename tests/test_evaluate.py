"""Evaluation of a checkpoint on a val .rec agrees with an independent computation, across loaders
and across process counts, and writes the contracted metrics.json / per_class.csv."""

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torchvision
from PIL import Image

from rectrain import settings
from rectrain.config import stage_block
from rectrain.evaluate import main as evaluate_main
from rectrain.evaluate import per_class, relaunch_command, run
from rectrain.loaders import LoaderSpec
from rectrain.metrics import predict, tally
from rectrain.recordio import IndexedRecordReader, IRHeader, RecordWriter, pack_record, unpack_record

COLOURS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (220, 220, 30)]
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
CROP, RESIZE = 16, 19
N_RECORDS = 31  # not a multiple of the batch (8) nor of 2 ranks


def colour_image(rng, label, size=(40, 30)):
    colour = np.array(COLOURS[label], np.int16)
    return np.clip(colour + rng.integers(-25, 25, (size[1], size[0], 3)), 0, 255).astype(np.uint8)


def normalise(batch_uint8):
    return (batch_uint8.float() - MEAN) / STD


def train_colour_model(seed=0):
    """resnet18 taught to tell the four colours apart (a few seconds on CPU), so its predictions
    depend on image content and not on resize details that differ between DALI and torchvision."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = torchvision.models.get_model("resnet18", num_classes=len(COLOURS))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def batch():
        labels = rng.integers(0, len(COLOURS), 32)
        x = torch.stack([torch.from_numpy(colour_image(rng, int(y), (CROP, CROP))).permute(2, 0, 1) for y in labels])
        return normalise(x), torch.from_numpy(labels)

    model.train()
    for _ in range(12):
        x, y = batch()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # 12 steps are too few for BatchNorm's running averages: recompute them for the final weights
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    with torch.no_grad():
        for _ in range(4):
            model(batch()[0])
    return model.eval()


@pytest.fixture(scope="module")
def val_set(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(1)
    labels = [i % len(COLOURS) for i in range(N_RECORDS)]
    # a mislabelled record (label 1, red image) gives class 1 a known confusion with class 0
    images = [colour_image(rng, 0 if k == 5 else lab) for k, lab in enumerate(labels)]
    labels[5] = 1
    rec, idx = tmp / "val.rec", tmp / "val.idx"
    with RecordWriter(rec, idx) as w:
        for key in rng.permutation(N_RECORDS):
            buf = io.BytesIO()
            Image.fromarray(images[key]).save(buf, "JPEG", quality=95)
            w.write(int(key), pack_record(IRHeader(0, float(labels[key]), int(key), 0), buf.getvalue()))
    classes = pd.DataFrame(
        {
            "label": range(4),
            "wnid": [f"n0000000{i}" for i in range(4)],
            "name": ["red", "<script>alert(1)</script>", "blue", "NA"],
        }
    )
    classes.to_csv(tmp / "classes.tsv", sep="\t", index=False)
    model = train_colour_model()
    ckpt = tmp / "model.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "model_name": "resnet18",
            "num_classes": 4,
            "image_size": CROP,
            "epoch": 3,
            "config": {"loader": "dali", "devices": "cpu", "precision": "bf16", "gpu_decode": True, "cpu_processes": 2},
        },
        ckpt,
    )
    return {
        "dir": tmp,
        "rec": str(rec),
        "idx": str(idx),
        "classes": str(tmp / "classes.tsv"),
        "ckpt": str(ckpt),
        "labels": labels,
        "model": model,
    }


def cfg(loader, **kw):
    """The evaluate block's view, completed from the schema as the rule's is."""
    block = stage_block(
        "evaluate", json.dumps({"loader": loader, "batch_size": 8, "resize": RESIZE, "workers": 1, **kw})
    )
    return settings.view("evaluate", block)


def manual_logits(vs, resize=RESIZE, crop=CROP, mirror_too=False):
    """Independent of the loaders: read every record, decode with PIL, resize + centre crop with
    torchvision's functional API, run the model one image at a time (with mirror_too, also on the crop
    mirrored by reversing its columns, the two logits averaged). (labels, logits)."""
    import torchvision.transforms.functional as TF

    reader = IndexedRecordReader(vs["rec"], vs["idx"])
    truth, logits = [], []
    with torch.inference_mode():
        for key in reader.keys:
            header, data = unpack_record(reader.read(key))
            img = TF.center_crop(TF.resize(Image.open(io.BytesIO(data)).convert("RGB"), resize), crop)
            x = normalise(TF.pil_to_tensor(img)[None])
            out = vs["model"](x)
            if mirror_too:
                out = (out + vs["model"](x[..., torch.arange(crop - 1, -1, -1)])) / 2
            logits.append(out[0])
            truth.append(int(header.label))
    return np.array(truth), torch.stack(logits)


def manual_predictions(vs, resize=RESIZE, crop=CROP):
    truth, logits = manual_logits(vs, resize, crop)
    return truth, logits.argmax(1).numpy()


def evaluate(vs, loader, out, **kw):
    return run(cfg(loader, **kw), vs["ckpt"], vs["rec"], vs["idx"], vs["classes"], str(out))


def test_torch_loader_top1_matches_a_manual_pil_loop(val_set, tmp_path):
    m = evaluate(val_set, "torch", tmp_path)
    truth, pred = manual_predictions(val_set)
    assert m["images"] == N_RECORDS
    assert m["top1"] == pytest.approx((truth == pred).mean())
    assert 0.9 < m["top1"] < 1.0  # the mislabelled record is always wrong
    table = pd.read_csv(tmp_path / "per_class.csv", keep_default_na=False)
    for label in range(4):
        rows = truth == label
        assert table.loc[label, "images"] == rows.sum()
        assert table.loc[label, "correct"] == (pred[rows] == label).sum()


def test_dali_and_torch_loaders_agree_on_the_same_checkpoint(val_set, tmp_path):
    dali = evaluate(val_set, "dali", tmp_path / "dali")
    torch_m = evaluate(val_set, "torch", tmp_path / "torch")
    assert dali["images"] == torch_m["images"] == N_RECORDS
    assert dali["top1"] == torch_m["top1"] and dali["top5"] == torch_m["top5"]
    assert dali["loss"] == pytest.approx(torch_m["loss"], rel=0.2, abs=0.02)
    a = pd.read_csv(tmp_path / "dali" / "per_class.csv", keep_default_na=False)
    b = pd.read_csv(tmp_path / "torch" / "per_class.csv", keep_default_na=False)
    pd.testing.assert_frame_equal(a, b)


def test_evaluation_logs_a_progress_line_per_interval_with_batch_k_of_k_and_an_eta(val_set, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rectrain"):
        evaluate(val_set, "torch", tmp_path, progress_s=0.001)
    lines = [m for m in caplog.messages if m.startswith("evaluation batch")]
    # 31 images in batches of 8: 4 batches, a line after each but the first (the loader's start-up)
    assert [line.split(":")[0] for line in lines] == [f"evaluation batch {k}/4 ({25 * k:.1f} %)" for k in (2, 3, 4)]
    for line in lines:
        found = re.search(
            r": ([\d.]+) img/s \(all 1 rank\(s\), last 1 step\(s\)\), data wait (\d+) %, ETA (\d+) s$", line
        )
        assert found and float(found[1]) > 0 and 0 <= int(found[2]) <= 100, line


def test_outputs_follow_the_contract(val_set, tmp_path):
    evaluate(val_set, "torch", tmp_path)
    m = json.loads((tmp_path / "metrics.json").read_text())
    headline = {"top1", "top5", "loss", "images", "images_per_s", "crop", "resize"}
    assert set(m) == headline | {
        "loader",
        "checkpoint",
        "flip_tta",
        "resolutions",
        "num_classes",
        "usage",
        "at_chance",
        "cost",
    }
    assert m["cost"]["params"] > 0 and m["cost"]["image_size"] == CROP, "params and FLOPs at the headline crop"
    assert m["at_chance"] is None, "a one-epoch checkpoint trained too briefly for a verdict (rectrain.chance)"
    assert m["usage"]["cpu_s"] > 0 and m["usage"]["max_rss_mb"] > 100, "the evaluating process's own numbers"
    assert m["loader"] == "torch" and m["checkpoint"] == val_set["ckpt"] and m["images_per_s"] > 0
    assert (m["crop"], m["resize"], m["flip_tta"]) == (CROP, RESIZE, False)
    assert m["resolutions"] == [{k: m[k] for k in headline}]
    table = pd.read_csv(tmp_path / "per_class.csv", keep_default_na=False)
    assert list(table.columns) == [
        "label",
        "wnid",
        "name",
        "images",
        "correct",
        "accuracy",
        "most_confused_label",
        "most_confused_wnid",
        "most_confused_count",
        "predicted",
    ]
    assert table["predicted"].sum() == table["images"].sum() == m["images"]
    assert table.loc[3, "name"] == "NA" and table.loc[1, "name"] == "<script>alert(1)</script>"
    # the mislabelled red record: class 1's images were mistaken for class 0 once
    assert str(table.loc[1, "most_confused_label"]) == "0" and table.loc[1, "most_confused_wnid"] == "n00000000"
    assert table.loc[1, "most_confused_count"] >= 1


def test_per_class_most_confused_from_a_known_confusion_matrix():
    conf = torch.tensor([[5, 3, 1], [0, 4, 0], [2, 0, 0]])
    classes = pd.DataFrame({"label": [0, 1, 2], "wnid": ["a", "b", "c"], "name": ["A", "B", "C"]})
    t = per_class(conf, classes)
    assert t["images"].tolist() == [9, 4, 2] and t["correct"].tolist() == [5, 4, 0]
    assert t["most_confused_wnid"].tolist() == ["b", "", "a"]
    assert t["most_confused_count"].tolist() == [3, 0, 2]
    assert t["predicted"].tolist() == [7, 7, 1], "column sums: what the model said, whatever the truth"
    assert t["accuracy"].tolist() == pytest.approx([5 / 9, 1.0, 0.0])


def test_evaluate_resize_setting_overrides_the_default():
    spec = LoaderSpec("r", "i", batch_size=8, image_size=224, train=False)
    assert spec.eval_resize == 256
    assert LoaderSpec("r", "i", batch_size=8, image_size=224, train=False, resize=288).eval_resize == 288


@pytest.mark.parametrize("kind", ["torch", "dali"])
def test_a_resolution_sweep_writes_one_row_per_resolution_the_first_the_headline(val_set, tmp_path, kind):
    """[24, null, 24]: a 24 px crop from a 27 px shorter side (24 / 0.875), then the configured resize 19 +
    crop 16; the repeated 24 is evaluated once. Each row equals an evaluation at that resolution alone."""
    m = evaluate(val_set, kind, tmp_path / "sweep", resolutions=[24, None, 24])
    rows = m["resolutions"]
    assert [(r["crop"], r["resize"]) for r in rows] == [(24, 27), (CROP, RESIZE)]
    # TensorBoard beside the checkpoint (rectrain.train.curves): top-1 per test crop, read by tensorboard's reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(val_set["ckpt"]).parent / "tensorboard" / "evaluate"))
    acc.Reload()
    top1 = [(e.step, round(e.value, 5)) for e in acc.Scalars("evaluate/top1")]
    assert top1 == [(r["crop"], round(r["top1"], 5)) for r in sorted(rows, key=lambda r: r["crop"])]
    alone = [evaluate(val_set, kind, tmp_path / str(r), resolutions=[r]) for r in (24, None)]
    scores = ("top1", "top5", "loss", "images", "crop", "resize")
    for r, single in zip(rows, alone, strict=True):
        assert {k: r[k] for k in scores} == {k: single[k] for k in scores}
        assert r["images"] == N_RECORDS and r["images_per_s"] > 0
    assert rows[0]["loss"] != rows[1]["loss"], "two resolutions, two passes"
    assert json.loads((tmp_path / "sweep" / "metrics.json").read_text()) == m
    assert {k: m[k] for k in rows[0]} == rows[0], "the top-level fields are the headline's"
    pd.testing.assert_frame_equal(
        pd.read_csv(tmp_path / "sweep" / "per_class.csv"), pd.read_csv(tmp_path / "24" / "per_class.csv")
    )


def test_flip_tta_logits_are_the_mean_of_the_image_and_its_mirror_logits(val_set):
    model = val_set["model"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, CROP, CROP, generator=g)
    mirrored = x[..., torch.arange(CROP - 1, -1, -1)]
    with torch.inference_mode():
        plain, tta = predict(model, x), predict(model, x, flip_tta=True)
        each = [(model(x[i : i + 1]) + model(mirrored[i : i + 1])) / 2 for i in range(3)]
    torch.testing.assert_close(tta, torch.cat(each), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tta, plain, atol=1e-3), "the mirror image must change the logits of noise"


def test_the_tally_with_flip_tta_counts_the_averaged_logits(val_set):
    """fp32 on noise images (unlike colour patches, not mirror-symmetric to the model): loss, top-1 and
    top-5 from the mean of each image's and its mirror image's logits."""
    model = val_set["model"]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 3, CROP, CROP, generator=g), torch.randint(0, 4, (5,), generator=g)) for _ in range(2)]
    ce = torch.nn.functional.cross_entropy
    tallied = tally(model, batches, 4, torch.device("cpu"), flip_tta=True)
    plain = tally(model, batches, 4, torch.device("cpu"))
    with torch.inference_mode():
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        mean = (model(x) + model(x[..., torch.arange(CROP - 1, -1, -1)])) / 2
    assert tallied.loss_sum == pytest.approx(float(ce(mean, y, reduction="sum")), rel=1e-5)
    assert plain.loss_sum != pytest.approx(tallied.loss_sum, rel=1e-3)
    assert int(tallied.confusion.diagonal().sum()) == int((mean.argmax(1) == y).sum())


def test_evaluate_with_flip_tta_counts_the_averaged_logits(val_set, tmp_path):
    m = evaluate(val_set, "torch", tmp_path, flip_tta=True)
    truth, logits = manual_logits(val_set, mirror_too=True)
    assert m["flip_tta"] is True and m["images"] == N_RECORDS
    assert m["top1"] == pytest.approx((logits.argmax(1).numpy() == truth).mean())
    ce = torch.nn.functional.cross_entropy
    labels = torch.from_numpy(truth)
    # the checkpoint's precision is bf16 (autocast on the CPU), the manual loop's fp32: 3e-4 apart (measured)
    assert m["loss"] == pytest.approx(float(ce(logits, labels)), rel=0.01)


def test_evaluation_uses_one_process_per_training_gpu_and_one_process_on_cpu():
    args = ["--config-json", "{}", "--checkpoint", "m.pt"]

    def train_block(**kw):
        """train.devices and train.cpu_processes of a completed train block, as a checkpoint saves them."""
        block = stage_block("train", json.dumps(kw))
        return block["devices"], block["cpu_processes"]

    two_gpus = relaunch_command(*train_block(devices="auto"), args, gpu_count=2)
    cmd, env = two_gpus
    assert cmd[1:4] == ["-m", "rectrain._torchrun", "--standalone"]
    assert "--nproc_per_node=2" in cmd and cmd[-6:] == ["-m", "rectrain.evaluate", *args]
    picked = relaunch_command(*train_block(devices=[1, 3]), args, gpu_count=4)
    assert "--nproc_per_node=2" in picked[0] and picked[1]["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert relaunch_command(*train_block(devices="auto"), args, gpu_count=1) is None
    assert relaunch_command(*train_block(devices="auto", cpu_processes=2), args, gpu_count=0) is None
    assert relaunch_command(*train_block(devices="cpu"), args, gpu_count=2) is None


def test_class_count_mismatch_names_the_fix(val_set, tmp_path):
    bad = tmp_path / "classes.tsv"
    pd.read_csv(val_set["classes"], sep="\t").head(3).to_csv(bad, sep="\t", index=False)
    with pytest.raises(ValueError, match="rerun train"):
        run(cfg("torch"), val_set["ckpt"], val_set["rec"], val_set["idx"], str(bad), str(tmp_path / "o"))


def test_checkpoint_with_pickled_code_is_refused(val_set, tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"model": torch.nn.Linear(2, 2), "model_name": "resnet18"}, evil)  # a pickled module object
    with pytest.raises(Exception, match="[Ww]eights only load failed|weights_only"):
        run(cfg("torch"), str(evil), val_set["rec"], val_set["idx"], val_set["classes"], str(tmp_path / "o"))


@pytest.mark.slow
def test_two_ranks_under_torchrun_equal_one_pass(val_set, tmp_path):
    single = tmp_path / "single"
    evaluate_main(
        [
            "--config-json",
            json.dumps(cfg("torch").as_dict()),
            "--checkpoint",
            val_set["ckpt"],
            "--rec",
            val_set["rec"],
            "--idx",
            val_set["idx"],
            "--classes",
            val_set["classes"],
            "--out",
            str(single),
        ]
    )
    two = tmp_path / "two"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "rectrain.evaluate",
            "--config-json",
            json.dumps(cfg("torch", workers=0).as_dict()),
            "--checkpoint",
            val_set["ckpt"],
            "--rec",
            val_set["rec"],
            "--idx",
            val_set["idx"],
            "--classes",
            val_set["classes"],
            "--out",
            str(two),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1/2" in proc.stderr
    a, b = json.loads((single / "metrics.json").read_text()), json.loads((two / "metrics.json").read_text())
    assert a["images"] == b["images"] == N_RECORDS
    assert a["top1"] == b["top1"] and a["top5"] == b["top5"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    pd.testing.assert_frame_equal(pd.read_csv(single / "per_class.csv"), pd.read_csv(two / "per_class.csv"))


def test_a_tally_counted_under_inference_mode_is_summed_into_a_normal_tensor(tmp_path):
    """On the GPU, gloo's all_reduce of a CUDA tensor writes the sum back into it, which an inference
    tensor forbids (the first GPU run died there, in training's validation). The sum must be a copy."""
    import torch.distributed as dist

    from rectrain.metrics import Tally, all_reduce

    with torch.inference_mode():
        t = Tally(confusion=torch.eye(3, dtype=torch.int64) * 2, top5_hits=5, loss_sum=1.5, seconds=0.5)
    assert t.confusion.is_inference()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        summed = all_reduce(t, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert not summed.confusion.is_inference()
    assert summed.images == 6 and summed.top5_hits == 5 and summed.loss_sum == 1.5


def test_with_published_weights_it_evaluates_the_file_and_records_its_top1_in_weights_json(val_set, tmp_path):
    """The weights file, not the checkpoint's tensors, is what is evaluated: a file whose head swaps
    classes 0 and 2 scores what that network scores, and weights.json records that top-1."""
    from rectrain import weights

    state = {k: v.clone() for k, v in val_set["model"].state_dict().items()}
    for key in ("fc.weight", "fc.bias"):
        state[key] = state[key][[2, 1, 0, 3]]
    classes = pd.read_csv(val_set["classes"], sep="\t", keep_default_na=False).to_dict("records")
    about = weights.describe(CROP, None, {"model": "resnet18", "blurpool": False}, classes, epoch=3, recipe={})
    path = tmp_path / weights.FILE
    weights.save(state, about, path)
    from_ckpt = evaluate(val_set, "torch", tmp_path / "ckpt")
    m = run(cfg("torch"), val_set["ckpt"], val_set["rec"], val_set["idx"], val_set["classes"],
            str(tmp_path / "eval"), weights_file=str(path), weights_json=str(tmp_path / weights.JSON))  # fmt: skip
    assert from_ckpt["top1"] > 0.9 and m["top1"] < 0.6, (from_ckpt["top1"], m["top1"])
    published = json.loads((tmp_path / weights.JSON).read_text())
    assert published["top1"] == m["top1"] and published["top5"] == m["top5"] and m["weights"] == str(path)
    assert published["test_resolutions"] == [{"crop": CROP, "resize": RESIZE, "top1": m["top1"], "top5": m["top5"]}]
    assert published["classes"][1]["name"] == "<script>alert(1)</script>" and published["model"] == "resnet18"
