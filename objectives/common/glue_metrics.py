"""The metrics GLUE reports (Wang et al. 2019, table 1), in numpy only.

Accuracy (SST-2, RTE, MRPC), binary F1 (MRPC), Matthews correlation (CoLA; the multi-class
R_K form of Gorodkin 2004, as scikit-learn's `matthews_corrcoef`), Pearson and Spearman
correlation (STS-B; Spearman on ranks with ties averaged, as `scipy.stats.spearmanr`).
"""

from __future__ import annotations

import numpy as np

from pretext_jax.input_pipeline.glue import GlueTask


def _pair(predictions: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    predictions, labels = np.ravel(predictions), np.ravel(labels)
    if predictions.shape != labels.shape:
        raise ValueError(f"{predictions.size} predictions for {labels.size} labels")
    return predictions, labels


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of predicted class ids equal to the labels."""
    predictions, labels = _pair(predictions, labels)
    return float(np.mean(predictions == labels))


def f1_score(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Binary F1 of class 1: 2TP / (2TP + FP + FN); 0 when there is no positive prediction or
    label (scikit-learn's `f1_score` with `zero_division=0`)."""
    predictions, labels = _pair(predictions, labels)
    predicted, actual = predictions == 1, labels == 1
    true_pos = np.sum(predicted & actual)
    denominator = 2 * true_pos + np.sum(predicted & ~actual) + np.sum(~predicted & actual)
    return float(2 * true_pos / denominator) if denominator else 0.0


def matthews_corrcoef(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Matthews correlation over any number of classes, from the confusion matrix C:
    (c·s - t·p) / sqrt((s² - p·p)(s² - t·t)) with c correct, s samples, t and p the per-class
    true and predicted counts; 0 when the denominator is 0 (constant labels or predictions)."""
    predictions, labels = _pair(predictions, labels)
    classes, index = np.unique(np.concatenate([labels, predictions]), return_inverse=True)
    true_index, pred_index = index[:labels.size], index[labels.size:]
    true_counts = np.bincount(true_index, minlength=classes.size).astype(np.float64)
    pred_counts = np.bincount(pred_index, minlength=classes.size).astype(np.float64)
    correct = float(np.sum(true_index == pred_index))
    samples = float(labels.size)
    covariance = correct * samples - true_counts @ pred_counts
    variance_pred = samples**2 - pred_counts @ pred_counts
    variance_true = samples**2 - true_counts @ true_counts
    if variance_pred * variance_true == 0:
        return 0.0
    return float(covariance / np.sqrt(variance_pred * variance_true))


def pearson(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Pearson's r; NaN when either side is constant or has fewer than 2 values (scipy's
    `pearsonr` warns and returns NaN for constant input)."""
    x, y = (a.astype(np.float64) for a in _pair(predictions, labels))
    if x.size < 2:
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    norm_x, norm_y = np.linalg.norm(x), np.linalg.norm(y)
    if norm_x == 0 or norm_y == 0:
        return float("nan")
    return float(np.clip((x / norm_x) @ (y / norm_y), -1.0, 1.0))


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing the mean of the ranks they span."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], values.size]
    ranks = np.empty(values.size, np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2, ends - starts)
    return ranks


def spearman(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Spearman's rho: Pearson's r of the average ranks; NaN when either side is constant."""
    predictions, labels = _pair(predictions, labels)
    return pearson(_average_ranks(predictions), _average_ranks(labels))


_METRICS = {"accuracy": accuracy, "f1": f1_score, "matthews_corrcoef": matthews_corrcoef,
            "pearson": pearson, "spearman": spearman}


def task_metrics(task: GlueTask, predictions: np.ndarray, labels: np.ndarray
                 ) -> dict[str, float]:
    """The task's GLUE metrics, plus `glue_score` (their unweighted mean, GLUE's per-task
    score). `predictions` are class ids, or scores for regression tasks."""
    results = {name: _METRICS[name](predictions, labels) for name in task.metrics}
    results["glue_score"] = float(np.mean(list(results.values())))
    return results


def constant_baseline(task: GlueTask, label_counts: dict[str, int], dev_labels: np.ndarray
                      ) -> dict[str, float]:
    """The task's metrics for the constant predictor a classifier can collapse to: the
    majority class of the training labels (`label_counts`: id -> rows). A constant has no
    correlation with STS-B's scores, so Pearson and Spearman count as 0 there (undefined)."""
    if task.is_regression:
        return {**{name: 0.0 for name in task.metrics}, "glue_score": 0.0}
    majority = int(max(label_counts, key=lambda label: (label_counts[label], -int(label))))
    return task_metrics(task, np.full(np.ravel(dev_labels).shape, majority), dev_labels)
