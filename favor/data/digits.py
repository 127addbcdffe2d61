"""scikit-learn's handwritten digits (1,797 8×8 grey images of 0-9; shipped inside the package, so
no download): the embedded default job's data. A fixed stratified split: 1,437 train / 360 test."""

from __future__ import annotations

import numpy as np

from favor.data.source import ArraySource


class Digits(ArraySource):
    OPTIONS = {"test_fraction": 0.2, "split_seed": 0}

    def __init__(self, test_fraction=0.2, split_seed=0):
        try:
            from sklearn.datasets import load_digits    # scikit-learn takes about a second to import: loaded on use
            from sklearn.model_selection import train_test_split
        except ImportError as e:   # pragma: no cover - scikit-learn is a dependency
            raise RuntimeError("the digits dataset ships with scikit-learn: pip install scikit-learn") from e
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"digits: test_fraction must be in (0, 1); got {test_fraction!r}")
        d = load_digits()
        images = (d.images / 16.0).astype(np.float32)[..., None]       # [N, 8, 8, 1] in [0, 1]
        labels = d.target.astype(np.int32)
        tr_x, te_x, tr_y, te_y = train_test_split(images, labels, test_size=test_fraction,
                                                  random_state=split_seed, stratify=labels)
        self.train = {"image": tr_x, "label": tr_y}
        self.eval = {"image": te_x, "label": te_y}

