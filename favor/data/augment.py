"""Image augmentation on the host, in numpy and PIL: every random choice comes from an explicit
`np.random.Generator`, so an example's augmentation is a pure function of its generator (favor.data.source
seeds one per (seed, step, position): resumable and the same on any number of hosts).

Single images are uint8 arrays [H, W, 3]; batches are float32 [B, H, W, 3] after `normalize`.

    random_resized_crop(image, rng, size, scale, ratio)   Inception crop (Szegedy et al. 2015)
    random_flip(image, rng)                              horizontal, p = 0.5
    rand_augment(image, rng, num_ops, magnitude, std)    RandAugment (Cubuk et al. 2020)
    eval_transform(image, size, crop_fraction)           resize the shorter side to size / 0.875, center crop
    normalize(images)                                    (x / 255 − ImageNet mean) / std
    mix_pairs(images, labels, num_classes, rngs, ...)    mixup (Zhang et al. 2018) / CutMix (Yun et al. 2019)
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Geometric RandAugment ops fill the uncovered corners with the mean colour: after `normalize` it is ≈ 0,
# so the filled area carries no signal (a black fill would be a strong, artificial edge).
FILL = tuple(int(round(255 * m)) for m in IMAGENET_MEAN)
RESAMPLE = Image.Resampling.BICUBIC      # the MAE / DeiT ImageNet recipes resize with bicubic


def _check_image(image) -> np.ndarray:
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8 or min(image.shape[:2]) < 1:
        raise ValueError(f"expected a uint8 RGB image [height, width, 3]; got dtype {image.dtype}, "
                         f"shape {image.shape}")
    return image


def check_range(name, pair, low, high):
    try:
        a, b = (float(v) for v in pair)
    except (TypeError, ValueError):
        a, b = math.nan, math.nan
    if not low <= a <= b <= high:
        raise ValueError(f"{name} must be (min, max) with {low} <= min <= max <= {high}; got {tuple(pair)}")
    return a, b


# -- crops and flips -----------------------------------------------------------------------------------
def sample_crop_box(rng: np.random.Generator, height: int, width: int, scale=(0.08, 1.0),
                    ratio=(3 / 4, 4 / 3), attempts: int = 10) -> tuple[int, int, int, int]:
    """(top, left, h, w) of an Inception-style random crop: area a fraction ~ U(scale) of the image,
    aspect ratio w/h log-uniform in `ratio`; the first of `attempts` draws that fits inside the image,
    else the largest center crop whose aspect ratio is clamped into `ratio`."""
    lo, hi = check_range("crop scale", scale, 0.0, 1.0)
    if lo <= 0:
        raise ValueError(f"crop scale must have min > 0; got {tuple(scale)}")
    r_lo, r_hi = check_range("crop ratio", ratio, 1e-3, 1e3)
    area = height * width
    log_lo, log_hi = math.log(r_lo), math.log(r_hi)
    for _ in range(attempts):
        target = area * rng.uniform(lo, hi)
        r = math.exp(rng.uniform(log_lo, log_hi))    # log-uniform: w/h and h/w equally likely
        w, h = int(round(math.sqrt(target * r))), int(round(math.sqrt(target / r)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    aspect = width / height
    if aspect < r_lo:                                 # too tall: full width, cut the height
        w, h = width, min(height, max(1, int(round(width / r_lo))))
    elif aspect > r_hi:                               # too wide: full height, cut the width
        w, h = min(width, max(1, int(round(height * r_hi)))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop(image, rng: np.random.Generator, size: int, scale=(0.08, 1.0),
                        ratio=(3 / 4, 4 / 3)) -> np.ndarray:
    """A `sample_crop_box` crop resized to [size, size, 3] (one PIL resize of the box, bicubic)."""
    image = _check_image(image)
    top, left, h, w = sample_crop_box(rng, image.shape[0], image.shape[1], scale, ratio)
    out = Image.fromarray(image).resize((size, size), RESAMPLE, box=(left, top, left + w, top + h))
    return np.asarray(out)


def random_flip(image, rng: np.random.Generator, p: float = 0.5) -> np.ndarray:
    """Mirror left-right with probability p."""
    return np.ascontiguousarray(image[:, ::-1]) if rng.random() < p else image


def eval_transform(image, size: int, crop_fraction: float = 0.875) -> np.ndarray:
    """The standard ImageNet eval view: resize the shorter side to size / crop_fraction (256 for 224),
    keeping the aspect ratio, then the central size × size crop."""
    image = _check_image(image)
    if not 0 < crop_fraction <= 1:
        raise ValueError(f"eval crop_fraction must be in (0, 1]; got {crop_fraction!r}")
    short = max(size, int(size / crop_fraction + 1e-6))
    h, w = image.shape[:2]
    if h <= w:
        new_h, new_w = short, max(short, int(round(w * short / h)))
    else:
        new_h, new_w = max(short, int(round(h * short / w))), short
    top, left = (new_h - size) // 2, (new_w - size) // 2
    resized = Image.fromarray(image).resize((new_w, new_h), RESAMPLE)
    return np.asarray(resized.crop((left, top, left + size, top + size)))


def normalize(images) -> np.ndarray:
    """uint8 [..., 3] -> float32 (x / 255 − mean) / std with ImageNet's channel statistics."""
    x = np.asarray(images, np.float32) / 255.0
    return (x - np.asarray(IMAGENET_MEAN, np.float32)) / np.asarray(IMAGENET_STD, np.float32)


# -- RandAugment -----------------------------------------------------------------------------------
# Cubuk et al. 2020: N ops drawn uniformly (with replacement) from 14, all at one magnitude M on a
# 0-10 scale; M = 10 is the edge of AutoAugment's search ranges (rotate 30°, shear 0.3, translate
# 150/331 of the image, enhance factors 0.1-1.9, posterize 4 bits, solarize threshold 0). Every op's
# strength grows with M (the "increasing" form MAE's RandAug(9, 0.5) uses): enhance factors
# 1 ± 0.9·M/10, posterize to 8 − 4·M/10 bits, solarize above 256 − 256·M/10. Signed ops pick a random sign.
def _signed(rng, value):
    return -value if rng.random() < 0.5 else value


def _affine(img, coeffs):
    return img.transform(img.size, Image.Transform.AFFINE, coeffs, resample=Image.Resampling.BILINEAR,
                         fillcolor=FILL)


def _enhance(kind):
    def op(img, m, rng):
        return kind(img).enhance(1.0 + _signed(rng, 0.9 * m / 10))
    return op


RAND_AUGMENT_OPS = {
    "identity": lambda img, m, rng: img,
    "auto_contrast": lambda img, m, rng: ImageOps.autocontrast(img),
    "equalize": lambda img, m, rng: ImageOps.equalize(img),
    "rotate": lambda img, m, rng: img.rotate(_signed(rng, 30.0 * m / 10), resample=Image.Resampling.BILINEAR,
                                             fillcolor=FILL),
    "solarize": lambda img, m, rng: ImageOps.solarize(img, int(round(256 - 256 * m / 10))),
    "color": _enhance(ImageEnhance.Color),
    "posterize": lambda img, m, rng: ImageOps.posterize(img, 8 - int(4 * m / 10)),
    "contrast": _enhance(ImageEnhance.Contrast),
    "brightness": _enhance(ImageEnhance.Brightness),
    "sharpness": _enhance(ImageEnhance.Sharpness),
    "shear_x": lambda img, m, rng: _affine(img, (1, _signed(rng, 0.3 * m / 10), 0, 0, 1, 0)),
    "shear_y": lambda img, m, rng: _affine(img, (1, 0, 0, _signed(rng, 0.3 * m / 10), 1, 0)),
    "translate_x": lambda img, m, rng: _affine(img, (1, 0, _signed(rng, 0.45 * m / 10 * img.size[0]), 0, 1, 0)),
    "translate_y": lambda img, m, rng: _affine(img, (1, 0, 0, 0, 1, _signed(rng, 0.45 * m / 10 * img.size[1]))),
}
OP_NAMES = tuple(RAND_AUGMENT_OPS)


def check_rand_augment(num_ops, magnitude, magnitude_std=0.0):
    if int(num_ops) != num_ops or num_ops < 0:
        raise ValueError(f"RandAugment num_ops (N) must be an integer >= 0; got {num_ops!r}")
    if not 0 <= magnitude <= 10:
        raise ValueError(f"RandAugment magnitude (M) must be in [0, 10]; got {magnitude!r}")
    if magnitude_std < 0:
        raise ValueError(f"RandAugment magnitude_std must be >= 0; got {magnitude_std!r}")


def rand_augment(image, rng: np.random.Generator, num_ops: int = 2, magnitude: float = 9.0,
                 magnitude_std: float = 0.0) -> np.ndarray:
    """`num_ops` ops drawn uniformly with replacement from the 14, each at magnitude M (or, with
    magnitude_std > 0, at M + N(0, std²) clipped to [0, 10], drawn per op as in MAE's RandAug(9, 0.5))."""
    check_rand_augment(num_ops, magnitude, magnitude_std)
    image = _check_image(image)
    img = Image.fromarray(image)
    for _ in range(int(num_ops)):
        name = OP_NAMES[int(rng.integers(len(OP_NAMES)))]
        m = magnitude
        if magnitude_std > 0:
            m = float(np.clip(rng.normal(magnitude, magnitude_std), 0.0, 10.0))
        img = RAND_AUGMENT_OPS[name](img, m, rng)
    return np.asarray(img)


# -- mixup and CutMix ------------------------------------------------------------------------------
def one_hot(labels, num_classes: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}); got values in [{labels.min()}, {labels.max()}]")
    return np.eye(num_classes, dtype=np.float32)[labels]


def cutmix_box(rng: np.random.Generator, height: int, width: int, lam: float) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of Yun et al.'s box: sides H·√(1−λ) × W·√(1−λ) around a uniform
    center, clipped to the image (so its area may be less than (1−λ)·H·W)."""
    cut = math.sqrt(1.0 - lam)
    ch, cw = int(height * cut), int(width * cut)
    cy, cx = int(rng.integers(height)), int(rng.integers(width))
    top, bottom = np.clip([cy - ch // 2, cy + ch // 2], 0, height)
    left, right = np.clip([cx - cw // 2, cx + cw // 2], 0, width)
    return int(top), int(left), int(bottom), int(right)


def mix_pairs(images, labels, num_classes: int, rngs, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
              switch_prob: float = 0.5):
    """Mixup / CutMix over pairs: example i is mixed with i XOR 1 (rows 2k and 2k+1 of the batch), with
    its own λ and its own mixup-or-CutMix choice drawn from rngs[i].

    Pairing fixed rows (the rows are already a random draw of the epoch's permutation) keeps every
    partner on the same host whenever each host's batch is even, so the result does not depend on the
    number of hosts. images: float [B, H, W, C]; labels: int [B]. Returns (images, soft labels
    [B, num_classes] float32 summing to 1).

    mixup: x = λ x_i + (1 − λ) x_j, λ ~ Beta(α, α). CutMix: a box of x_j pasted into x_i, λ ~ Beta(α, α)
    sets its size and is then recomputed as 1 − (clipped box area) / (H·W). With both on, CutMix is
    used with probability `switch_prob` (timm's convention, used by DeiT and MAE)."""
    images = np.asarray(images)
    b = len(images)
    if mixup_alpha < 0 or cutmix_alpha < 0:
        raise ValueError(f"mixup_alpha and cutmix_alpha must be >= 0 (0 = off); got {mixup_alpha!r}, {cutmix_alpha!r}")
    if not 0 <= switch_prob <= 1:
        raise ValueError(f"mix switch_prob must be in [0, 1]; got {switch_prob!r}")
    if b % 2:
        raise ValueError(f"mixup/CutMix mix rows 2k and 2k+1 of each host's batch, so it must be even; got {b} rows")
    if len(rngs) != b:
        raise ValueError(f"mix_pairs: {len(rngs)} generators for {b} images")
    targets = one_hot(labels, num_classes)
    out, soft = images.astype(np.float32, copy=True), targets.copy()
    if not (mixup_alpha or cutmix_alpha):
        return out, soft
    h, w = images.shape[1:3]
    for i, rng in enumerate(rngs):
        j = i ^ 1
        use_cutmix = bool(cutmix_alpha) and (not mixup_alpha or rng.random() < switch_prob)
        lam = float(rng.beta(cutmix_alpha, cutmix_alpha) if use_cutmix else rng.beta(mixup_alpha, mixup_alpha))
        if use_cutmix:
            top, left, bottom, right = cutmix_box(rng, h, w, lam)
            out[i, top:bottom, left:right] = images[j, top:bottom, left:right]
            lam = 1.0 - (bottom - top) * (right - left) / (h * w)
        else:
            out[i] = lam * images[i] + (1.0 - lam) * images[j]
        soft[i] = lam * targets[i] + (1.0 - lam) * targets[j]
    return out, soft
