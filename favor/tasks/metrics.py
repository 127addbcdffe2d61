"""Evaluation metrics, computed on the host over a whole eval split with scikit-learn and scipy
(well-kept reference implementations; padding rows are dropped first).

GLUE reports per task what the GLUE paper does: Matthews correlation for CoLA, F1 and accuracy for
MRPC and QQP, Pearson and Spearman correlation for STS-B, accuracy for the rest (MNLI matched and
mismatched are two eval splits, each with accuracy).
"""

from __future__ import annotations

import numpy as np

GLUE_METRICS = {
    "cola": ("matthews_corrcoef",),
    "sst2": ("accuracy",),
    "mrpc": ("f1", "accuracy"),
    "qqp": ("f1", "accuracy"),
    "stsb": ("pearson", "spearman"),
    "mnli": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
    "docorder": ("accuracy",),       # favor's local sentence-order task (favor.data.docorder)
}


def _valid(pred, label, valid):
    pred, label = np.asarray(pred), np.asarray(label)
    if valid is not None:
        keep = np.asarray(valid, bool)
        pred, label = pred[keep], label[keep]
    return pred, label


def compute(name: str, pred, label, valid=None) -> float:
    """One metric over the valid rows; `pred` are class ids (or scores for the correlations)."""
    from scipy import stats    # scipy's submodules load on use
    from sklearn import metrics as skm    # scikit-learn takes about a second to import: loaded on use
    pred, label = _valid(pred, label, valid)
    if name == "accuracy":
        return float(np.mean(pred == label))
    if name == "matthews_corrcoef":
        return float(skm.matthews_corrcoef(label, pred))
    if name == "f1":
        return float(skm.f1_score(label, pred))
    if name == "pearson":
        return float(stats.pearsonr(pred, label)[0])
    if name == "spearman":
        return float(stats.spearmanr(pred, label)[0])
    raise ValueError(f"unknown metric {name!r}; valid: accuracy, matthews_corrcoef, f1, pearson, spearman")


def glue(task: str, pred, label, valid=None) -> dict[str, float]:
    if task not in GLUE_METRICS:
        raise ValueError(f"unknown GLUE task {task!r}; valid: {', '.join(GLUE_METRICS)}")
    return {m: compute(m, pred, label, valid) for m in GLUE_METRICS[task]}
