"""The check stage's parts (rectrain.check): classes matched by wnid, what a gap means in plain words,
the likely cause of misaligned labels for each val layout, torchvision's weights read from torch's cache,
and the refusals. The stage end to end on the demo's finished run: tests/test_pipeline_e2e.py."""

import pytest
import torch
import torchvision
from helpers.torchhub import cache_as_published
from helpers.users import as_other_user, needs_root, shared_folder

from rectrain import check
from rectrain.data.subset import IMAGENET_1K, read_names
from rectrain.settings import CheckSettings

LAYOUT = "LAYOUT"


def settings(**keys) -> CheckSettings:
    base = dict(weights=None, model=None, crop=None, resize=None, precision=None, loader=None, batch_size=8)
    return CheckSettings(**{**base, "progress_s": 30, "workers": 1, **keys})


def test_the_dataset_classes_come_first_in_label_order_and_the_weights_other_classes_after():
    order = check.column_order(["a", "b", "c", "d"], ["c", "a"], "w")
    assert order == [2, 0, 1, 3]
    net = check.Reordered(torch.nn.Identity(), order)
    assert net(torch.tensor([[10.0, 11.0, 12.0, 13.0]])).tolist() == [[12.0, 10.0, 11.0, 13.0]]


def test_a_dataset_class_the_weights_do_not_know_is_refused_naming_it():
    with pytest.raises(check.CheckError, match=r"does not know 1 of this dataset's 2 classes \(n99999999, by wnid"):
        check.column_order(["n01440764"], ["n01440764", "n99999999"], "w")


def reading(top1, published, classes=10, weight_classes=10, images=50000):
    used = {"resize": 256, "centre crop": 224}
    return check.Reading(top1, images, classes, weight_classes, published, used)


def test_within_three_tenths_of_a_point_is_sound():
    kind, words = check.verdict(reading(0.7590, 0.7613, 1000, 1000), LAYOUT)
    assert kind == "sound" and "against the published 76.13 % (+0.23 points)" in words and "sound" in words


def test_near_chance_reads_as_misaligned_labels_naming_the_layouts_likely_cause():
    kind, words = check.verdict(reading(0.0011, 0.7613, 1000, 1000), LAYOUT)
    assert kind == "misaligned" and "the labels are misaligned" in words and words.endswith(f"Likely cause: {LAYOUT}")


def test_in_between_reads_as_other_preprocessing_naming_the_settings_used():
    kind, words = check.verdict(reading(0.70, 0.7613, 1000, 1000), LAYOUT)
    assert kind == "preprocessing" and "the preprocessing differs" in words
    assert "Used: resize 256, centre crop 224" in words


def test_on_a_subset_the_tolerance_widens_by_sampling_alone():
    subset = reading(0.752, 0.7613, classes=100, weight_classes=1000, images=5000)
    assert subset.tolerance() == pytest.approx(2 * (0.7613 * 0.2387 / 5000) ** 0.5)
    kind, words = check.verdict(subset, LAYOUT)
    assert kind == "sound" and "over the weights' 1000 classes" in words


def test_without_a_published_top1_only_near_chance_is_judged():
    assert check.verdict(reading(0.05, None), LAYOUT)[0] == "misaligned"
    kind, words = check.verdict(reading(0.5, None), LAYOUT)
    assert kind == "unknown" and "publish no top-1" in words


@pytest.mark.parametrize(
    ("source", "cause"),
    [
        ("val/n01440764/ILSVRC2012_val_00000001.JPEG", "class folders"),
        ("val_flat/ILSVRC2012_val_00000001.JPEG", "ground-truth file"),
        (None, "your own .rec"),
    ],
)
def test_the_likely_cause_follows_the_val_layout(tmp_path, source, cause):
    val = None
    if source:
        val = tmp_path / "val.tsv"
        val.write_text(f"id\tsource\tlabel\twnid\n0\t{source}\t0\tn01440764\n")
    assert cause in check.likely_cause(val and str(val))


def test_torchvision_weights_come_from_torchs_cache_with_their_published_top1_and_transforms(tmp_path, monkeypatch):
    torch.manual_seed(0)
    source = torchvision.models.resnet18()
    cache_as_published(tmp_path, monkeypatch, source.state_dict())
    known = check.known_weights(settings(weights="torchvision:ResNet18_Weights.IMAGENET1K_V1"))
    assert (known.published_top1, known.crop, known.resize) == (0.69758, 224, 256)
    assert known.wnids == read_names(IMAGENET_1K) and known.wnids[0] == "n01440764"
    assert torch.equal(known.model.fc.weight, source.fc.weight)


def test_unset_weights_and_a_plain_state_dict_without_its_architecture_are_refused(tmp_path):
    with pytest.raises(check.CheckError, match="check.weights is null: nothing to check; set it"):
        check.known_weights(settings())
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "sd.pt")
    with pytest.raises(check.CheckError, match="does not say its architecture: set check.model"):
        check.known_weights(settings(weights=str(tmp_path / "sd.pt")))
    with pytest.raises(check.CheckError, match="does not fit check.model 'resnet34'"):
        check.known_weights(settings(weights=str(tmp_path / "sd.pt"), model="resnet34"))
    from safetensors.torch import save_file

    save_file(torchvision.models.resnet18().state_dict(), str(tmp_path / "other.safetensors"))
    with pytest.raises(check.CheckError, match="a safetensors file rectrain did not publish: set check.model"):
        check.known_weights(settings(weights=str(tmp_path / "other.safetensors")))
    known = check.known_weights(settings(weights=str(tmp_path / "sd.pt"), model="resnet18"))
    assert known.published_top1 is None and len(known.wnids) == 1000


def test_the_weights_own_resolution_unless_the_block_sets_one_and_a_resize_below_the_crop_is_refused():
    known = check.Known(torch.nn.Identity(), ["n01440764"], "w", 0.7, "meta", crop=224, resize=256, precision="bf16")
    assert check.preprocessing(settings(), known) == (check.evaluate.Resolution(224, 256), "bf16", "dali")
    assert check.preprocessing(settings(crop=160, precision="fp32"), known)[:2] == (
        check.evaluate.Resolution(160, 183),
        "fp32",
    )
    with pytest.raises(
        check.CheckError, match=r"check.resize = 200 is smaller than the centre crop 224 .* set check.resize >= 224"
    ):
        check.preprocessing(settings(resize=200), known)


def test_a_timm_models_weights_are_checked_with_its_own_pretrained_cfg_preprocessing(tmp_path):
    """Issue 46 item 7: timm weights trained at mean/std 0.5, bicubic, crop_pct 0.9 were read with ImageNet's
    constants, bilinear and rectrain's 0.875."""
    import timm

    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    torch.save(timm.create_model(name, num_classes=1000).state_dict(), tmp_path / "vit.pt")
    known = check.known_weights(settings(weights=str(tmp_path / "vit.pt"), model=f"timm:{name}"))
    assert (known.crop, known.resize) == (224, 248)  # floor(224 / 0.9), timm's eval resize
    assert known.preprocess == check.Preprocess(mean=(127.5,) * 3, std=(127.5,) * 3, interpolation="bicubic")
    assert name in known.preprocess_from


@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_the_evaluation_loaders_normalise_and_interpolate_as_the_weights_preprocessing_says(tmp_path, kind):
    """What the check hands on reaches the pixels: (p - mean) / std per channel, and the resize's interpolation."""
    from helpers.train_data import write_rec

    from rectrain.loaders import IMAGENET_PREPROCESS, LoaderSpec, Preprocess, build_loader

    rec, idx = write_rec(tmp_path, [0, 1, 2, 3], size=(64, 48))
    half = Preprocess(mean=(127.5,) * 3, std=(127.5,) * 3, interpolation="bilinear")

    def images(pre):
        spec = LoaderSpec(rec, idx, batch_size=4, image_size=24, train=False, workers=1, resize=30, preprocess=pre)
        return torch.cat([x for x, _ in build_loader(kind, spec).epoch(0)]).float()

    imagenet, halves = images(IMAGENET_PREPROCESS), images(half)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (IMAGENET_PREPROCESS.mean, IMAGENET_PREPROCESS.std))
    pixels = imagenet * std + mean
    assert torch.allclose(halves, (pixels - 127.5) / 127.5, atol=2e-3)
    bicubic = images(Preprocess(mean=half.mean, std=half.std, interpolation="bicubic"))
    assert 0 < (bicubic - halves).abs().mean() < 0.1, "bicubic is another resize of the same image"


# ---- issue 47 items 2 and 10: torchvision's weights are hash-checked, and offline says what to fetch ----

RESNET18 = "torchvision:ResNet18_Weights.IMAGENET1K_V1"
# Run as the other user (argv: the shared TORCH_HOME, the marker): a pickle that creates the marker when
# unpickled, planted in the shared cache under the name torchvision publishes ResNet-18's weights as.
PLANT_PICKLE = """
import os, pickle, sys
class Planted:
    def __reduce__(self):
        return (os.mkdir, (sys.argv[2],))
cache = sys.argv[1] + "/hub/checkpoints"
os.makedirs(cache)
for folder in (sys.argv[1], sys.argv[1] + "/hub", cache):
    os.chmod(folder, 0o777)
with open(cache + "/resnet18-f37072fd.pth", "wb") as f:
    pickle.dump({"fc.weight": Planted()}, f)
"""


@needs_root
@pytest.mark.parametrize("stage", ["check", "init_weights"])
def test_a_pickle_planted_in_a_shared_torch_home_is_refused_by_its_hash_and_never_unpickled(monkeypatch, stage):
    from rectrain import model as models
    from rectrain.train import init_weights

    with shared_folder() as base:
        base.chmod(0o1777)
        marker = base / "ran"
        planted = as_other_user(PLANT_PICKLE, base / "torch", marker)
        assert planted.returncode == 0, planted.stderr
        monkeypatch.setenv("TORCH_HOME", str(base / "torch"))
        with pytest.raises(ValueError, match=r"resnet18-f37072fd.pth is not the file torchvision published"):
            if stage == "check":
                check.known_weights(settings(weights=RESNET18))
            else:
                init_weights.apply(models.build("resnet18", 3), RESNET18)
        assert not marker.exists()


def test_offline_the_check_says_the_weights_need_a_download_from_where_into_where(tmp_path, monkeypatch):
    from urllib.error import URLError

    def offline(*args, **kwargs):
        raise URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(torch.hub, "urlopen", offline)
    url = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url
    with pytest.raises(ValueError) as err:
        check.known_weights(settings(weights=RESNET18))
    line = str(err.value)
    assert f"the weights need a download from {url} into {tmp_path}/hub/checkpoints/resnet18-f37072fd.pth" in line
    assert "Temporary failure in name resolution" in line and "TORCH_HOME" in line and "\n" not in line
