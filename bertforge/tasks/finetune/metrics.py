"""GLUE's metrics in numpy: the same numbers as scikit-learn and scipy, without either at run time.

Each function is proven equal (to 1e-12) to its oracle in ``tests/tasks/test_glue_data.py``:

* :func:`accuracy` -- ``sklearn.metrics.accuracy_score``
* :func:`matthews_corrcoef` -- ``sklearn.metrics.matthews_corrcoef`` (multiclass too); 0.0
  where it is undefined (one class in the labels or in the predictions), as sklearn returns
* :func:`f1_binary` -- ``sklearn.metrics.f1_score`` (binary, positive class 1); 0.0 when
  there is no positive label and no positive prediction, as sklearn returns by default
* :func:`pearson` -- ``scipy.stats.pearsonr(...)[0]``
* :func:`spearman` -- ``scipy.stats.spearmanr(...)[0]``: Pearson of the ranks, tied values
  sharing their average rank

Pearson and Spearman of a constant input are NaN, as in scipy and in GLUE's own
scorer (which calls scipy): a model that predicts one score for every pair has
no correlation, and reporting 0 would rank it above a negatively correlated one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import FinetuneError

# Each task's metrics, in the order the GLUE leaderboard shows them.
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "CoLA": ("mcc",),
    "SST-2": ("accuracy",),
    "MRPC": ("f1", "accuracy"),
    "STS-B": ("pearson", "spearman"),
    "QQP": ("f1", "accuracy"),
    "MNLI": ("accuracy",),
    "QNLI": ("accuracy",),
    "RTE": ("accuracy",),
    "WNLI": ("accuracy",),
    "AX": ("mcc",),  # the diagnostic set is scored with R3, the three-class Matthews correlation
}


def _pair(predictions: Sequence | np.ndarray, labels: Sequence | np.ndarray,
          dtype: type | None = None) -> tuple[np.ndarray, np.ndarray]:
    p, y = np.asarray(predictions, dtype=dtype), np.asarray(labels, dtype=dtype)
    if p.ndim != 1 or y.ndim != 1 or len(p) != len(y):
        raise FinetuneError(f"predictions {p.shape} and labels {y.shape} are not two vectors of one length")
    if len(p) == 0:
        raise FinetuneError("no predictions to score")
    return p, y


def accuracy(predictions: Sequence | np.ndarray, labels: Sequence | np.ndarray) -> float:
    """The fraction of predictions equal to their label."""
    p, y = _pair(predictions, labels)
    return float(np.mean(p == y))


def matthews_corrcoef(predictions: Sequence | np.ndarray, labels: Sequence | np.ndarray) -> float:
    """Matthews correlation of class predictions (any number of classes), sklearn's formula:
    from the confusion matrix C, (c·s − t·p) / √((s² − p·p)(s² − t·t)), with c correct, s samples,
    t and p the true and predicted counts per class."""
    p, y = _pair(predictions, labels)
    classes, codes = np.unique(np.concatenate([y, p]), return_inverse=True)
    k = len(classes)
    t_sum = np.bincount(codes[:len(y)], minlength=k).astype(np.float64)
    p_sum = np.bincount(codes[len(y):], minlength=k).astype(np.float64)
    n_correct = float(np.sum(p == y))
    n_samples = float(len(y))
    cov_ytyp = n_correct * n_samples - np.dot(t_sum, p_sum)
    cov_ypyp = n_samples ** 2 - np.dot(p_sum, p_sum)
    cov_ytyt = n_samples ** 2 - np.dot(t_sum, t_sum)
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(cov_ytyt * cov_ypyp))


def f1_binary(predictions: Sequence | np.ndarray, labels: Sequence | np.ndarray) -> float:
    """F1 of the positive class 1: 2·tp / (2·tp + fp + fn); 0.0 when that is 0/0."""
    p, y = _pair(predictions, labels)
    for name, values in (("predictions", p), ("labels", y)):
        if not np.isin(values, (0, 1)).all():
            raise FinetuneError(f"binary F1 needs classes 0 and 1; the {name} hold "
                                f"{sorted(set(np.unique(values).tolist()) - {0, 1})[:5]}")
    tp = float(np.sum((p == 1) & (y == 1)))
    fp = float(np.sum((p == 1) & (y == 0)))
    fn = float(np.sum((p == 0) & (y == 1)))
    denominator = 2 * tp + fp + fn
    return 2 * tp / denominator if denominator else 0.0


def pearson(predictions: Sequence | np.ndarray, labels: Sequence | np.ndarray) -> float:
    """Pearson correlation; NaN when either input is constant (see the module's docstring)."""
    p, y = _pair(predictions, labels, np.float64)
    if len(p) < 2:
        raise FinetuneError("a correlation needs at least 2 pairs")
    pm, ym = p - p.mean(), y - y.mean()
    # Constant inputs: mean() of equal floats can differ from them by an ulp, so test the values.
    if (p == p[0]).all() or (y == y[0]).all():
        return float("nan")
    # Normalise each vector first, as scipy does, so that the product cannot overflow.
    r = np.dot(pm / np.linalg.norm(pm), ym / np.linalg.norm(ym))
    return float(np.clip(r, -1.0, 1.0))


def rank_average(values: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing the average of their ranks (scipy's rankdata 'average')."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    # Start of each run of equal values, in sorted order.
    new = np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]])
    starts = np.flatnonzero(new)
    ends = np.concatenate([starts[1:], [len(values)]])
    average = (starts + 1 + ends) / 2.0  # mean of the ranks starts+1 .. ends
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat(average, ends - starts)
    return ranks


def spearman(predictions: Sequence | np.ndarray, labels: Sequence | np.ndarray) -> float:
    """Spearman rank correlation: Pearson of the average ranks; NaN when either input is constant."""
    p, y = _pair(predictions, labels, np.float64)
    if np.isnan(p).any() or np.isnan(y).any():
        raise FinetuneError("cannot rank NaN scores")
    return pearson(rank_average(p), rank_average(y))


_METRIC_FUNCTIONS = {"mcc": matthews_corrcoef, "accuracy": accuracy, "f1": f1_binary,
                     "pearson": pearson, "spearman": spearman}


def glue_metrics(task: str, predictions: Sequence | np.ndarray, labels: Sequence | np.ndarray) -> dict[str, float]:
    """The task's metrics (:data:`TASK_METRICS`) as fractions (the leaderboard shows them × 100),
    plus ``"score"``: their mean, the task's GLUE score.

    ``predictions`` and ``labels`` are class ids, or for STS-B real-valued scores.
    ``task`` is a GLUE task name, any case, with or without the hyphen (``"sts-b"``, ``"SST2"``).
    """
    name = _task_name(task)
    result = {metric: _METRIC_FUNCTIONS[metric](predictions, labels) for metric in TASK_METRICS[name]}
    result["score"] = float(np.mean(list(result.values())))
    return result


def _task_name(task: str) -> str:
    key = task.lower().replace("-", "").replace("_", "")
    for name in TASK_METRICS:
        if name.lower().replace("-", "") == key:
            return name
    if key in ("diagnostic", "mnlim", "mnlimm"):
        return "AX" if key == "diagnostic" else "MNLI"
    raise FinetuneError(f"unknown GLUE task {task!r}; expected one of {', '.join(TASK_METRICS)}")
