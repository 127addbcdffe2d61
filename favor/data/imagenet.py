"""ImageNet (or any TFDS image-classification builder with `image` and `label` features) with random
access from the prepared array_record files, decoded and augmented on the host.

    train:  decode -> RandomResizedCrop(image_size, crop_scale, crop_ratio) -> horizontal flip
            -> RandAugment(N = randaugment, M = randaugment_magnitude ± randaugment_magnitude_std)
            -> normalize -> mixup / CutMix on pairs of rows (when mixup_alpha or cutmix_alpha > 0)
    eval:   decode -> resize the shorter side to image_size / eval_crop -> center crop -> normalize

Batches: "image" float32 [B, image_size, image_size, 3] (ImageNet mean/std normalized); "label" int32
[B], or on train with mixing on float32 [B, num_classes] soft targets summing to 1 (the classification
task takes either). Grey and RGBA images become RGB. Every random choice comes from the per-example
generator the base class passes (seeded by (seed, step, position)), so a resumed run augments exactly
as the first did. Decoding and augmentation run on a thread pool of `workers` threads (PIL releases the
GIL), overlapping the device step that JAX dispatches asynchronously.

imagenet2012 needs the archives from image-net.org (see `manual_download_help`); e.g. imagenette,
cifar10 or oxford_flowers102 download themselves with `tfds build <name> --file_format=array_record`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from favor import extras
from favor.data import augment
from favor.data.source import IndexedSource, open_tfds

# What TFDS's imagenet2012 builder reads from its manual_dir (its MANUAL_DOWNLOAD_INSTRUCTIONS).
MANUAL_FILES = {"imagenet2012": ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")}


def default_data_dir() -> str:
    """Where TFDS looks when data_dir is not given ($TFDS_DATA_DIR, else ~/tensorflow_datasets)."""
    return os.environ.get("TFDS_DATA_DIR") or str(Path("~/tensorflow_datasets").expanduser())


def manual_download_help(name: str, data_dir) -> str:
    """For builders that need a manual download (imagenet2012): where the files go and the command that
    prepares them; "" for builders that download themselves."""
    tfds = extras.tfds(f"the TFDS dataset {name!r}")    # TensorFlow loads only when data is read
    base = name.split("/")[0].split(":")[0]          # "imagenet2012:5.1.0", "imagenet2012_subset/1pct"
    try:
        instructions = tfds.builder_cls(base).MANUAL_DOWNLOAD_INSTRUCTIONS
    except Exception:                     # unknown builder: open_tfds's error already says so
        return ""
    if not instructions:
        return ""
    root = str(Path(data_dir).expanduser()) if data_dir else default_data_dir()
    manual = Path(root) / "downloads" / "manual"
    files = MANUAL_FILES.get(base)
    what = " and ".join(str(manual / f) for f in files) if files else f"the files below into {manual}/"
    return (f"TFDS dataset {name} needs a manual download: put {what} (TFDS's manual_dir; register at the "
            f"dataset's site for the links), then run `tfds build {name} --data_dir {root} "
            f"--file_format=array_record` (or pass --manual_dir DIR to point at the archives elsewhere). "
            f"TFDS's instructions: {' '.join(instructions.split())}")


def _rgb(image: np.ndarray) -> np.ndarray:
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[..., None]
    if image.dtype != np.uint8:
        raise ValueError(f"expected uint8 images from TFDS; got {image.dtype} (shape {image.shape})")
    if image.shape[-1] == 1:
        return np.repeat(image, 3, axis=-1)
    if image.shape[-1] == 4:             # RGBA: drop alpha
        return image[..., :3]
    if image.shape[-1] != 3:
        raise ValueError(f"expected images with 1, 3 or 4 channels; got shape {image.shape}")
    return image


class ImageNet(IndexedSource):
    OPTIONS = {"dataset": "imagenet2012", "data_dir": None, "train_split": "train", "eval_split": "validation",
               "image_size": 224, "crop_scale": (0.08, 1.0), "crop_ratio": (3 / 4, 4 / 3), "flip": True,
               "randaugment": 0, "randaugment_magnitude": 9.0, "randaugment_magnitude_std": 0.0,
               "mixup_alpha": 0.0, "cutmix_alpha": 0.0, "mix_switch_prob": 0.5, "eval_crop": 0.875,
               "image_key": "image", "label_key": "label", "workers": 0}

    def __init__(self, dataset="imagenet2012", data_dir=None, train_split="train", eval_split="validation",
                 image_size=224, crop_scale=(0.08, 1.0), crop_ratio=(3 / 4, 4 / 3), flip=True, randaugment=0,
                 randaugment_magnitude=9.0, randaugment_magnitude_std=0.0, mixup_alpha=0.0, cutmix_alpha=0.0,
                 mix_switch_prob=0.5, eval_crop=0.875, image_key="image", label_key="label", workers=0):
        if int(image_size) != image_size or image_size < 1:
            raise ValueError(f"imagenet: image_size must be a positive integer; got {image_size!r}")
        self.image_size = int(image_size)
        # check every option before touching the disk: a typo fails in a second, not after opening TFDS
        augment.check_range("imagenet: crop_scale", crop_scale, 1e-6, 1.0)
        augment.check_range("imagenet: crop_ratio", crop_ratio, 1e-3, 1e3)
        self.crop_scale, self.crop_ratio = tuple(map(float, crop_scale)), tuple(map(float, crop_ratio))
        self.flip = bool(flip)
        self.randaugment = int(randaugment or 0)          # "" / None / 0: off
        self.magnitude, self.magnitude_std = float(randaugment_magnitude), float(randaugment_magnitude_std)
        augment.check_rand_augment(self.randaugment, self.magnitude, self.magnitude_std)
        if mixup_alpha < 0 or cutmix_alpha < 0:
            raise ValueError(f"imagenet: mixup_alpha and cutmix_alpha must be >= 0 (0 = off); "
                             f"got {mixup_alpha!r}, {cutmix_alpha!r}")
        if not 0 <= mix_switch_prob <= 1:
            raise ValueError(f"imagenet: mix_switch_prob must be in [0, 1]; got {mix_switch_prob!r}")
        self.mixup_alpha, self.cutmix_alpha = float(mixup_alpha), float(cutmix_alpha)
        self.switch_prob = float(mix_switch_prob)
        if not 0 < eval_crop <= 1:
            raise ValueError(f"imagenet: eval_crop must be in (0, 1] (0.875: resize to 256, crop 224); "
                             f"got {eval_crop!r}")
        self.eval_crop = float(eval_crop)
        self.image_key, self.label_key = image_key, label_key
        self.workers = int(workers) or min(32, os.cpu_count() or 1)

        self.dataset = dataset
        self._sources = {"train": self._open(dataset, train_split, data_dir),
                         "eval": self._open(dataset, eval_split, data_dir)}
        self.num_classes = self._num_classes(self._sources["train"])
        # made here, not on first use: the prefetch thread and the eval loop both read
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="favor-imagenet") if self.workers > 1 else None

    # -- opening the splits ----------------------------------------------------------------------------
    @staticmethod
    def _open(name, split, data_dir):
        try:
            return open_tfds(name, split, data_dir)
        except FileNotFoundError as e:
            hint = manual_download_help(name, data_dir)
            if not hint:
                raise
            raise FileNotFoundError(f"{hint}\n({e})") from e

    def _num_classes(self, source) -> int:
        features = source.dataset_info.features
        missing = [k for k in (self.image_key, self.label_key) if k not in features]
        if missing:
            raise ValueError(f"TFDS dataset {self.dataset} has no feature(s) {', '.join(map(repr, missing))}; "
                             f"its features: {', '.join(features.keys())} (set data.image_key / data.label_key)")
        n = getattr(features[self.label_key], "num_classes", None)
        if not n:
            raise ValueError(f"TFDS dataset {self.dataset}: feature {self.label_key!r} is not a ClassLabel "
                             f"(no num_classes); an image-classification builder is needed")
        return int(n)

    def num_examples(self, split):
        return len(self._sources[split])

    # -- reading ---------------------------------------------------------------------------------------
    def _map(self, fn, items):
        if self._pool is None or len(items) == 1:
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    def _example(self, split, index):
        ex = self._sources[split][int(index)]
        return _rgb(ex[self.image_key]), int(ex[self.label_key])

    def train_view(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One training view, uint8 [image_size, image_size, 3]."""
        x = augment.random_resized_crop(image, rng, self.image_size, self.crop_scale, self.crop_ratio)
        if self.flip:
            x = augment.random_flip(x, rng)
        if self.randaugment:
            x = augment.rand_augment(x, rng, self.randaugment, self.magnitude, self.magnitude_std)
        return x

    def read(self, split, global_rows, local_rows, rngs):
        if split == "train":
            def one(item):
                image, label = self._example("train", item[0])
                return self.train_view(image, item[1]), label
            views = self._map(one, list(zip(local_rows, rngs)))
        else:
            def one(index):
                image, label = self._example("eval", index)
                return augment.eval_transform(image, self.image_size, self.eval_crop), label
            views = self._map(one, list(local_rows))
        images = augment.normalize(np.stack([v[0] for v in views]))
        labels = np.asarray([v[1] for v in views], np.int32)
        if split == "train" and (self.mixup_alpha or self.cutmix_alpha):
            # the same generators drew the crops; they go on from where the crop left them
            images, labels = augment.mix_pairs(images, labels, self.num_classes, rngs, self.mixup_alpha,
                                               self.cutmix_alpha, self.switch_prob)
        return {"image": images, "label": labels}

    def __del__(self):
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False)
