"""SQuAD's metrics as the official evaluation scripts define them (evaluate-v1.1.py,
evaluate-v2.0.py): exact match and token F1 of normalised answers (lower case, punctuation and
the articles a/an/the removed, whitespace collapsed), the best over a question's gold answers;
for v2.0 also the split into answerable (HasAns) and unanswerable (NoAns) questions and the
null-score threshold that maximises each metric on dev (`best_threshold`, the script's
`find_best_thresh`)."""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation removed, then the articles, then runs of whitespace as one."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """F1 of the normalised answers' word multisets; an empty answer on either side scores 1
    only when both are empty (v2.0's rule; v1.1 has no empty gold answers)."""
    predicted, wanted = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not predicted or not wanted:
        return float(predicted == wanted)
    shared = sum((collections.Counter(predicted) & collections.Counter(wanted)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(wanted)
    return 2 * precision * recall / (precision + recall)


def gold_answers(answers: Sequence[str]) -> list[str]:
    """The answers that normalise to something; [""] for an unanswerable question."""
    return [a for a in answers if normalize_answer(a)] or [""]


def per_question(predictions: Mapping[str, str], answers: Mapping[str, Sequence[str]]
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """Each question's exact match and F1, the maximum over its gold answers (a question
    without a prediction scores 0, as the scripts count it)."""
    exact, f1 = {}, {}
    for qid, golds in answers.items():
        golds = gold_answers(golds)
        predicted = predictions.get(qid)
        exact[qid] = 0.0 if predicted is None else max(exact_match(predicted, g) for g in golds)
        f1[qid] = 0.0 if predicted is None else max(token_f1(predicted, g) for g in golds)
    return exact, f1


def best_threshold(scores: Mapping[str, float], answered: Mapping[str, str],
                   score_diff: Mapping[str, float], has_answer: Mapping[str, bool]
                   ) -> tuple[float, float]:
    """evaluate-v2.0.py `find_best_thresh`: the (percentage, threshold) that maximise the
    metric when a question is answered with `answered` (its `scores`) iff its `score_diff`
    is at most the threshold, else left empty (right for unanswerable ones only). Starts
    from every question empty (threshold: 0), then answers them in increasing `score_diff`."""
    current = best = sum(not has for has in has_answer.values())
    threshold = 0.0
    for qid in sorted(score_diff, key=score_diff.get):
        if has_answer[qid]:
            current += scores[qid]
        elif answered[qid]:
            current -= 1
        if current > best:
            best, threshold = current, score_diff[qid]
    return 100.0 * best / len(has_answer), threshold


def squad_metrics(predictions: Mapping[str, str], answers: Mapping[str, Sequence[str]], *,
                  best_non_null: Mapping[str, str] | None = None,
                  score_diff: Mapping[str, float] | None = None) -> dict[str, float]:
    """`exact` and `f1` (percentages over all questions); with v2.0's `score_diff` (and the
    best non-null answers), also `HasAns_*`/`NoAns_*` and `best_exact`/`best_f1` with their
    thresholds (`best_threshold`)."""
    exact, f1 = per_question(predictions, answers)
    count = len(answers)
    result = {"exact": 100.0 * sum(exact.values()) / count, "f1": 100.0 * sum(f1.values()) / count}
    if score_diff is None:
        return result
    has_answer = {qid: bool(gold_answers(a)[0]) for qid, a in answers.items()}
    for name, wanted in (("HasAns", True), ("NoAns", False)):
        ids = [qid for qid, has in has_answer.items() if has == wanted]
        if ids:
            result[f"{name}_exact"] = 100.0 * sum(exact[q] for q in ids) / len(ids)
            result[f"{name}_f1"] = 100.0 * sum(f1[q] for q in ids) / len(ids)
    answered = best_non_null if best_non_null is not None else predictions
    answered_exact, answered_f1 = per_question(answered, answers)
    for name, scores in (("exact", answered_exact), ("f1", answered_f1)):
        result[f"best_{name}"], result[f"best_{name}_thresh"] = best_threshold(
            scores, answered, score_diff, has_answer)
    return result


def no_answer_baseline(answers: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """The trivial predictor's metrics: the empty answer everywhere (v2.0: the share of
    unanswerable questions, in %; v1.1: 0)."""
    return squad_metrics(dict.fromkeys(answers, ""), answers)
