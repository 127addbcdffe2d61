"""The ImageNet pipeline: augmentations (statistics with fixed seeds, tolerances of Z = 5 standard
errors), the TFDS source on mock data, soft-label classification, and the ViT ImageNet config end to end."""

import math
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from favor import data, job
from favor.data import augment
from favor.data.imagenet import ImageNet
from favor.tasks.classification import Classification

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import vit_imagenet  # noqa: E402

Z = 5.0


def mock(n=24):
    return tfds.testing.mock_data(num_examples=n, policy=tfds.testing.MockPolicy.USE_CODE)


def picture(h=40, w=56, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# -- RandomResizedCrop -------------------------------------------------------------------------------
def ratio_bounds(h, r_lo, r_hi):
    """w/h range reachable after rounding w* = √(a·r) and h* = √(a/r) (each to within 0.5 pixel)."""
    return (r_lo * (h - 0.5) - 0.5) / h, (r_hi * (h - 0.5) + 0.5) / np.maximum(h - 1, 0.5)


def test_crop_area_and_aspect_ratio_follow_their_distributions():
    rng, n, side = np.random.default_rng(0), 4000, 1000
    # scale ≤ 0.2 of a square: every first draw fits, so area ~ U(0.08, 0.2) and log(w/h) ~ U(±log 4/3)
    boxes = np.array([augment.sample_crop_box(rng, side, side, (0.08, 0.2)) for _ in range(n)])
    top, left, h, w = boxes.T
    assert np.all((top >= 0) & (left >= 0) & (top + h <= side) & (left + w <= side))
    frac = h * w / side ** 2
    slack = (0.5 * (h + w) + 0.25) / side ** 2                  # rounding each side by ≤ 0.5 pixel
    assert np.all((frac >= 0.08 - slack) & (frac <= 0.2 + slack))
    lo, hi = ratio_bounds(h, 3 / 4, 4 / 3)
    assert np.all((w / h >= lo) & (w / h <= hi))
    se_area = (0.12 / math.sqrt(12)) / math.sqrt(n)
    assert abs(frac.mean() - 0.14) < Z * se_area
    log_r = np.log(w / h)
    se_log = (2 * math.log(4 / 3) / math.sqrt(12)) / math.sqrt(n)
    assert abs(log_r.mean()) < Z * se_log
    assert log_r.max() > 0.9 * math.log(4 / 3) and log_r.min() < -0.9 * math.log(4 / 3)   # the whole range

    # the default scale on a non-square image: boxes stay inside, in range
    boxes = np.array([augment.sample_crop_box(rng, 300, 400) for _ in range(2000)])
    top, left, h, w = boxes.T
    assert np.all((top >= 0) & (left >= 0) & (top + h <= 300) & (left + w <= 400))
    frac = h * w / (300 * 400)
    assert np.all(frac >= 0.08 - (0.5 * (h + w) + 0.25) / (300 * 400)) and np.all(frac <= 1.0)
    lo, hi = ratio_bounds(h, 3 / 4, 4 / 3)
    fits = (w / h >= lo) & (w / h <= hi)
    fallback = (h == 300) & (w == 400)                      # 400/300 = 4/3: the fallback is the whole image
    assert np.all(fits | fallback)


def test_crop_falls_back_to_a_ratio_clamped_center_crop():
    rng = np.random.default_rng(1)
    # half the area of a 10 × 1000 strip never fits in 10 rows: all 10 draws fail
    assert augment.sample_crop_box(rng, 10, 1000, (0.5, 1.0)) == (0, (1000 - 13) // 2, 10, 13)
    assert augment.sample_crop_box(rng, 1000, 10, (0.5, 1.0)) == ((1000 - 13) // 2, 0, 13, 10)
    out = augment.random_resized_crop(picture(), rng, 24)
    assert out.shape == (24, 24, 3) and out.dtype == np.uint8
    with pytest.raises(ValueError, match=r"crop scale must be \(min, max\).*got \(0.5, 0.1\)"):
        augment.sample_crop_box(rng, 10, 10, (0.5, 0.1))


def test_flip_rate_is_one_half():
    rng, n, image = np.random.default_rng(2), 4000, picture(4, 6)
    flipped = [not np.array_equal(augment.random_flip(image, rng), image) for _ in range(n)]
    assert abs(np.mean(flipped) - 0.5) < Z * math.sqrt(0.25 / n)
    rng = np.random.default_rng(3)
    while not np.array_equal(out := augment.random_flip(image, rng), image[:, ::-1]):
        assert np.array_equal(out, image)


# -- RandAugment ---------------------------------------------------------------------------------------
def test_rand_augment_keeps_shape_and_dtype_and_is_deterministic_in_the_rng():
    image = picture()
    a = augment.rand_augment(image, np.random.default_rng(7), 2, 9, 0.5)
    b = augment.rand_augment(image, np.random.default_rng(7), 2, 9, 0.5)
    assert a.shape == image.shape and a.dtype == np.uint8 and np.array_equal(a, b)
    outs = [augment.rand_augment(image, np.random.default_rng(s), 2, 9, 0.5) for s in range(8)]
    assert len({o.tobytes() for o in outs}) > 4                  # the seed matters
    for name, op in augment.RAND_AUGMENT_OPS.items():
        for m in (0.0, 5.0, 10.0):
            out = np.asarray(op(Image.fromarray(image), m, np.random.default_rng(0)))
            assert out.shape == image.shape and out.dtype == np.uint8, name
    assert len(augment.OP_NAMES) == 14
    with pytest.raises(ValueError, match=r"magnitude \(M\) must be in \[0, 10\]; got 11"):
        augment.rand_augment(image, np.random.default_rng(0), 2, 11)


def test_rand_augment_magnitude_scale():
    """M = 0 leaves every magnitude-dependent op the identity; M = 10 is the edge of the ranges."""
    image, img = picture(), Image.fromarray(picture())
    run = lambda name, m: np.asarray(augment.RAND_AUGMENT_OPS[name](img, m, np.random.default_rng(0)))
    for name in ("rotate", "solarize", "color", "posterize", "contrast", "brightness", "sharpness",
                 "shear_x", "shear_y", "translate_x", "translate_y"):
        assert np.array_equal(run(name, 0.0), image), name
    assert np.array_equal(run("solarize", 10.0), 255 - image)            # threshold 0: all inverted
    assert np.array_equal(run("posterize", 10.0), image & 0xF0)          # 4 bits
    moved = run("translate_x", 10.0)                                      # 45 % of 56 = 25 columns of fill
    assert np.sum(np.all(moved == augment.FILL, axis=(0, 2))) == round(0.45 * 56)


# -- eval view and normalization -----------------------------------------------------------------------
def test_eval_transform_resizes_the_shorter_side_then_center_crops():
    assert augment.eval_transform(picture(300, 400), 224).shape == (224, 224, 3)
    assert augment.eval_transform(picture(400, 30), 32).shape == (32, 32, 3)
    image = picture(256, 512)                     # shorter side already 224 / 0.875: only the crop
    np.testing.assert_array_equal(augment.eval_transform(image, 224), image[16:240, 144:368])
    x = augment.normalize(np.full((1, 2, 2, 3), 255, np.uint8))
    np.testing.assert_allclose(x[0, 0, 0], (1 - np.array(augment.IMAGENET_MEAN)) / augment.IMAGENET_STD, rtol=1e-6)


# -- mixup and CutMix ----------------------------------------------------------------------------------
def rngs(n, seed):
    return [np.random.default_rng([seed, i]) for i in range(n)]


def test_mixup_is_the_convex_combination_of_each_pair():
    n, k, alpha = 2000, 4, 0.8
    images = np.random.default_rng(0).standard_normal((n, 3, 3, 2)).astype(np.float32)
    labels = np.tile([0, 1], n // 2)
    out, soft = augment.mix_pairs(images, labels, k, rngs(n, 0), mixup_alpha=alpha)
    np.testing.assert_allclose(soft.sum(1), 1.0, rtol=1e-6)
    lam = soft[np.arange(n), labels]                          # the weight of the row's own class
    partner = images[np.arange(n) ^ 1]
    np.testing.assert_allclose(out, lam[:, None, None, None] * images + (1 - lam[:, None, None, None]) * partner,
                               rtol=1e-5, atol=1e-6)
    se = math.sqrt(1 / (4 * (2 * alpha + 1)) / n)             # λ ~ Beta(α, α): mean 1/2
    assert abs(lam.mean() - 0.5) < Z * se
    assert np.all(soft[:, 2:] == 0)


def test_cutmix_label_weight_is_the_pasted_area():
    n, h, w = 400, 12, 20
    images = np.zeros((n, h, w, 1), np.float32)
    images[1::2] = 1.0                                        # rows 2k are 0, rows 2k + 1 are 1
    labels = np.tile([0, 1], n // 2)
    out, soft = augment.mix_pairs(images, labels, 2, rngs(n, 1), cutmix_alpha=1.0)
    pasted = np.abs(out - images).reshape(n, -1).mean(1)      # fraction of pixels taken from the partner
    np.testing.assert_allclose(soft[np.arange(n), labels ^ 1], pasted, atol=1e-6)
    assert np.all(np.isin(out, (0.0, 1.0)))                   # pasted, not blended
    rng = np.random.default_rng(4)                            # λ = 3/4: sides h/2 × w/2, less where clipped
    boxes = np.array([augment.cutmix_box(rng, h, w, 0.75) for _ in range(200)])
    heights, widths = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert heights.max() == h // 2 and widths.max() == w // 2 and heights.min() >= 0 and widths.min() >= 0
    assert np.all((boxes[:, :2] >= 0) & (boxes[:, 2:] <= (h, w)))


def test_mix_switch_probability_and_bad_input():
    n, p = 2000, 0.3
    images = np.zeros((n, 4, 4, 1), np.float32)
    images[1::2] = 1.0
    out, _ = augment.mix_pairs(images, np.tile([0, 1], n // 2), 2, rngs(n, 2), 0.8, 1.0, switch_prob=p)
    is_cutmix = np.all(np.isin(out.reshape(n, -1), (0.0, 1.0)), axis=1)   # mixup λ ∈ (0, 1) blends
    assert abs(is_cutmix.mean() - p) < Z * math.sqrt(p * (1 - p) / n)
    with pytest.raises(ValueError, match="must be even; got 3 rows"):
        augment.mix_pairs(images[:3], np.zeros(3, int), 2, rngs(3, 0), mixup_alpha=0.8)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 2\)"):
        augment.mix_pairs(images[:2], np.array([0, 2]), 2, rngs(2, 0), mixup_alpha=0.8)


# -- the classification task with soft labels ------------------------------------------------------
def test_classification_soft_labels_and_top5():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((6, 7)), jnp.float32)
    model = lambda x, deterministic: {"logits": logits}
    soft = np.zeros((6, 7), np.float32)
    soft[np.arange(6), [0, 1, 2, 3, 4, 5]] = 0.7
    soft[np.arange(6), [1, 2, 3, 4, 5, 6]] += 0.3
    task = Classification(label_smoothing=0.1)
    loss, metrics = task.loss(model, {"image": None, "label": jnp.asarray(soft)})
    target = 0.9 * soft + 0.1 / 7
    np.testing.assert_allclose(loss, np.mean(optax.softmax_cross_entropy(logits, target)), rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], np.mean(np.argmax(logits, -1) == np.arange(6)))
    labels = np.array([0, 1, 2, 3, 4, 5])
    out = task.eval_outputs(model, {"image": None, "label": jnp.asarray(labels), "valid": jnp.ones(6, bool)})
    ranks = np.argsort(-np.asarray(logits), axis=1)[:, :5]
    assert float(out["correct_top5"]) == sum(labels[i] in ranks[i] for i in range(6))
    got = task.finalize([out])
    assert got["top5_accuracy"] >= got["accuracy"]
    with pytest.raises(ValueError, match="soft labels have 3 classes but the model's logits have 7"):
        task.loss(model, {"image": None, "label": jnp.ones((6, 3)) / 3})


# -- the TFDS source and the config end to end -----------------------------------------------------
def test_source_on_mock_imagenet_is_deterministic_and_shaped():
    config = vit_imagenet.get_config("runlocal")
    with mock():
        source = data.get(config.data)
        assert isinstance(source, ImageNet) and source.num_classes == 1000 and source.num_train == 24
        stream = source.train_batches(8, 0, seed=3)
        next(stream)
        first, second = next(stream), next(source.train_batches(8, 1, seed=3))   # resumed at step 1
        np.testing.assert_array_equal(first["image"], second["image"])
        assert first["image"].shape == (8, 32, 32, 3) and first["image"].dtype == np.float32
        assert first["label"].shape == (8, 1000)
        np.testing.assert_allclose(first["label"].sum(1), 1.0, rtol=1e-6)
        batches = list(source.eval_batches(16))
        assert [b["valid"].sum() for b in batches] == [16, 8] and batches[0]["label"].dtype == np.int32
    with mock(), pytest.raises(ValueError, match="mix_switch_prob must be in"):
        ImageNet(mix_switch_prob=2)


def test_vit_imagenet_runlocal_trains_and_reports_top1_and_top5(tmp_path):
    config = vit_imagenet.get_config("runlocal")
    with mock(24):
        summary = job.run(config, tmp_path)
    assert summary["step"] == 4 and np.isfinite(summary["train_loss"])
    assert 0.0 <= summary["accuracy"] <= summary["top5_accuracy"] <= 1.0


def test_config_variants_follow_the_crt_tables():
    scratch, finetune = vit_imagenet.get_config("variant=scratch"), vit_imagenet.get_config("variant=finetune,init=/x")
    assert scratch.batch_size == 4096 and scratch.optim.lr == pytest.approx(1.6e-3)
    assert scratch.total_steps == int(200 * 1_281_167 / 4096) and scratch.optim.weight_decay == 0.3
    assert finetune.optim.lr == pytest.approx(4e-3) and finetune.model.init_from == "hf:/x"
    assert finetune.model.preset == "large" and finetune.task.label_smoothing == 0.1
    tiny = vit_imagenet.get_config("grid=40")
    assert (tiny.model.preset, tiny.model.image_size, tiny.model.patch_size) == ("mini", 240, 6)
    assert tiny.data.image_size == 240
    assert vit_imagenet.get_config("data=local").data.name == "digits"
    with pytest.raises(ValueError, match="unknown variant 'pretrain'; valid: scratch, finetune"):
        vit_imagenet.get_config("variant=pretrain")
    with pytest.raises(ValueError, match="unknown arg"):
        vit_imagenet.get_config("epochs=3")


def test_unprepared_imagenet_says_where_the_archives_go(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        ImageNet(data_dir=str(tmp_path))
    msg = str(e.value)
    manual = tmp_path / "downloads" / "manual"
    assert f"{manual / 'ILSVRC2012_img_train.tar'} and {manual / 'ILSVRC2012_img_val.tar'}" in msg
    assert f"tfds build imagenet2012 --data_dir {tmp_path} --file_format=array_record" in msg
