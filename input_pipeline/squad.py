"""SQuAD v1.1 / v2.0 span extraction: the official JSON, long contexts in overlapping windows,
and the answer text of a window's start/end logits, as google-research/bert run_squad.py
(`read_squad_examples`, `convert_examples_to_features`, `write_predictions`) does them.

A context is split on whitespace into words (each keeps its character offsets in the context);
each word is tokenised on its own, so every sub-token knows its word. A question's answer is
read from its character offset, which must match its text. A window holds, in the bert layout,
`[CLS] question [SEP] context piece [SEP]` (question truncated to `max_query_length`
sub-tokens, pieces `doc_stride` apart); in the xlm layout `</s> question </s> piece </s>` (as
`input_pipeline.glue`'s xlm layout); in the roberta layout `<s> question </s></s> piece </s>`,
token types 0; in the xlnet layout `piece <sep> question <sep>
<cls>` (zihangdai/xlnet run_squad.py puts the context first and the <cls> last, token types 0,
1, then 2 for <cls> and 3 for padding, padded on the right). A sub-token that sits in several
windows is predicted only from the one where it has the most context on both sides
(`max_context`). In training an answer outside a window, and v2.0's unanswerable questions,
point at the window's [CLS] / <s> / <cls> / first </s> (`cls_index`), whose start + end logits are
also the null score. XLNet's beam head reads each window's `p_mask` (1 where no answer can start
or end: all but the context and the null position) and `cls_index`, and is predicted from its
beams (`predict_beam_answers`, zihangdai/xlnet run_squad.py `write_predictions`).
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.glue import LAYOUTS, SEG_ID_CLS, special_count, with_specials
from pretext_jax.input_pipeline.tokenizers import Tokenizer

# zihangdai/xlnet run_squad.py's segment id of padding (its classifier_utils.py uses 4).
SQUAD_SEG_ID_PAD = 3


@dataclasses.dataclass(frozen=True)
class SquadExample:
    """One question on one context: the context's whitespace `words` with each word's
    `[start, end)` character offsets (`word_spans`), the gold `answers` (texts; none for an
    unanswerable one) and the first answer's word span (`start_word`, `end_word`; -1 when
    unanswerable)."""

    qid: str
    question: str
    context: str
    words: tuple[str, ...]
    word_spans: tuple[tuple[int, int], ...]
    answers: tuple[str, ...]
    start_word: int = -1
    end_word: int = -1

    @property
    def is_impossible(self) -> bool:
        return not self.answers


def _is_whitespace(char: str) -> bool:
    """run_squad.py's `is_whitespace`: space, tab, newlines and the narrow no-break space."""
    return char in " \t\r\n" or ord(char) == 0x202F


def split_words(context: str) -> tuple[list[str], list[tuple[int, int]]]:
    """The context's whitespace-separated words and each one's [start, end) offsets."""
    words, spans, start = [], [], None
    for index, char in enumerate(context + " "):
        if _is_whitespace(char):
            if start is not None:
                words.append(context[start:index])
                spans.append((start, index))
                start = None
        elif start is None:
            start = index
    return words, spans


def _word_at(spans: Sequence[tuple[int, int]], char: int) -> int:
    """The word that holds character `char` (whitespace: the word before it)."""
    starts = [start for start, _ in spans]
    return max(0, int(np.searchsorted(starts, char, side="right")) - 1)


def read_squad(path: str | Path) -> list[SquadExample]:
    """The questions of a SQuAD v1.1 or v2.0 JSON file (`data` -> `paragraphs` -> `qas`). An
    answer whose `answer_start` does not point at its `text` is an error naming the question;
    v2.0's `is_impossible` questions have no answers (their `plausible_answers` are unused, as
    in run_squad.py)."""
    try:
        articles = json.loads(Path(path).read_text())["data"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{path} is not a SQuAD JSON file ({error}); give the official "
                        "train-v1.1.json / dev-v2.0.json format") from None
    examples = []
    for article in articles:
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            words, spans = split_words(context)
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible", False) else qa.get("answers", [])
                for answer in answers:
                    start, text = answer["answer_start"], answer["text"]
                    if not text.strip() or context[start:start + len(text)] != text:
                        raise UserError(
                            f"{path}: question {qa['id']}: answer {text!r} is not at its "
                            f"answer_start {start} (the context has "
                            f"{context[start:start + len(text)]!r} there); fix the file")
                first = answers[0] if answers else None
                start_word = end_word = -1
                if first is not None:
                    start_word = _word_at(spans, first["answer_start"])
                    end_word = _word_at(spans, first["answer_start"] + len(first["text"]) - 1)
                examples.append(SquadExample(
                    qid=str(qa["id"]), question=qa["question"], context=context,
                    words=tuple(words), word_spans=tuple(spans),
                    answers=tuple(a["text"] for a in answers),
                    start_word=start_word, end_word=end_word))
    return examples


@dataclasses.dataclass(frozen=True)
class Windows:
    """The encoded windows of a list of examples: int32 `arrays` (`input_ids`,
    `token_type_ids`, `attention_mask`, `p_mask`, `start_positions`, `end_positions`,
    `cls_index`, each [N, L]/[N], and `is_impossible` [N]: the window's question has no
    answer, wherever its answer lies), and for prediction each window's `example` index, its
    positions' context words (`token_words`: position -> word index, -1 outside the context)
    and whether the window is the position's max-context one (`max_context`, [N, L] bool);
    `cls_index` is the position of each window's no-answer token."""

    arrays: dict[str, np.ndarray]
    example: np.ndarray
    token_words: np.ndarray
    max_context: np.ndarray

    @property
    def cls_index(self) -> np.ndarray:
        return self.arrays["cls_index"]

    def __len__(self) -> int:
        return len(self.example)


def _improve_span(pieces: Sequence[int], start: int, end: int, answer: list[int]
                  ) -> tuple[int, int]:
    """run_squad.py `_improve_answer_span`: the sub-token span inside [start, end] (the
    answer's whole words) whose pieces are exactly the answer text's own (e.g. "1895" in the
    word "(1895-1943)."), else the whole words."""
    for new_start in range(start, end + 1):
        for new_end in range(end, new_start - 1, -1):
            if list(pieces[new_start:new_end + 1]) == answer:
                return new_start, new_end
    return start, end


def _max_context(spans: Sequence[tuple[int, int]], span_index: int, position: int) -> bool:
    """run_squad.py `_check_is_max_context`: whether window `span_index` (a (start, length)
    piece of the context's sub-tokens) gives `position` the most context, scored as the
    smaller of its left and right context plus 1% of the window's length."""
    best, best_index = None, None
    for index, (start, length) in enumerate(spans):
        end = start + length - 1
        if not start <= position <= end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best is None or score > best:
            best, best_index = score, index
    return best_index == span_index


def _window(query: list[int], piece: list[int], tokenizer: Tokenizer, layout: str
            ) -> tuple[list[int], list[int], int, int]:
    """(ids, token types, the piece's first position, the no-answer position) of one window:
    bert `[CLS] Q [SEP] P [SEP]` (types 0 up to the first [SEP], then 1), xlm the same
    opened by `eos_id` (</s>) as `glue._with_specials`, roberta `<s> Q </s></s> P </s>` (types
    0, the null at <s>; HF `RobertaTokenizer`'s pair, as its `run_qa.py` feeds
    `RobertaForQuestionAnswering`), xlnet `P <sep> Q <sep> <cls>` (types 0, 1, `SEG_ID_CLS`)."""
    if layout == "xlnet":
        ids = [*piece, tokenizer.sep_id, *query, tokenizer.sep_id, tokenizer.cls_id]
        types = [0] * (len(piece) + 1) + [1] * (len(query) + 1) + [SEG_ID_CLS]
        return ids, types, 0, len(ids) - 1
    if layout == "roberta":
        ids, types = with_specials(query, piece, tokenizer, layout)
        return ids, types, len(query) + 3, 0
    first, sep = ((tokenizer.cls_id, tokenizer.sep_id) if layout == "bert"
                  else (tokenizer.eos_id, tokenizer.sep_id))
    ids = [first, *query, sep, *piece, sep]
    types = [0] * (len(query) + 2) + [1] * (len(piece) + 1)
    return ids, types, len(query) + 2, 0


def encode_windows(examples: Sequence[SquadExample], tokenizer: Tokenizer, max_seq_length: int,
                   doc_stride: int, max_query_length: int, layout: str = "bert") -> Windows:
    """run_squad.py `convert_examples_to_features` (google-research/bert's; zihangdai/xlnet's
    for `layout="xlnet"`): every example's windows in the layout's order (`_window`), padded on
    the right with `pad_id` (xlnet: token type `SQUAD_SEG_ID_PAD`); start/end positions of the
    first answer where the window holds all of it, else the window's `cls_index`; `p_mask` 0
    at the context and `cls_index`, 1 elsewhere (run_squad.py's `p_mask`); `is_impossible`
    the question's (google-research/electra qa_tasks.py `featurize`)."""
    if layout not in LAYOUTS:
        raise UserError(f"examples.layout={layout!r} is unknown; use one of {LAYOUTS}")
    rows: dict[str, list] = {k: [] for k in ("input_ids", "token_type_ids", "attention_mask",
                                             "p_mask", "start_positions", "end_positions",
                                             "cls_index", "is_impossible")}
    example_of, token_words, max_context = [], [], []
    pad_type = SQUAD_SEG_ID_PAD if layout == "xlnet" else 0
    for number, example in enumerate(examples):
        query = tokenizer.encode(example.question)[:max_query_length]
        pieces, piece_word, word_first_piece = [], [], []
        for index, word in enumerate(example.words):
            word_first_piece.append(len(pieces))
            for piece in tokenizer.encode(word):
                pieces.append(piece)
                piece_word.append(index)
        answer_start = answer_end = -1
        if not example.is_impossible:
            answer_start = word_first_piece[example.start_word]
            answer_end = (word_first_piece[example.end_word + 1] - 1
                          if example.end_word + 1 < len(example.words) else len(pieces) - 1)
            answer_start, answer_end = _improve_span(
                pieces, answer_start, answer_end, tokenizer.encode(example.answers[0]))
        room = max_seq_length - len(query) - special_count(layout, pair=True)
        if room < 1:
            raise UserError(f"examples.max_seq_length={max_seq_length} leaves no room for the "
                            f"context after question {example.qid}'s {len(query)} sub-tokens; "
                            "raise it (SQuAD: 384) or lower examples.max_query_length")
        spans, offset = [], 0
        while offset < len(pieces) or not spans:
            length = min(len(pieces) - offset, room)
            spans.append((offset, length))
            if offset + length >= len(pieces):
                break
            offset += min(length, doc_stride)
        for span_index, (start, length) in enumerate(spans):
            ids, types, first, cls = _window(query, pieces[start:start + length], tokenizer,
                                             layout)
            pad = max_seq_length - len(ids)
            words = np.full(max_seq_length, -1, np.int32)
            words[first:first + length] = piece_word[start:start + length]
            best = np.zeros(max_seq_length, bool)
            best[first:first + length] = [_max_context(spans, span_index, start + i)
                                          for i in range(length)]
            start_position = end_position = cls
            if not example.is_impossible and start <= answer_start and answer_end < start + length:
                start_position = answer_start - start + first
                end_position = answer_end - start + first
            rows["input_ids"].append(ids + [tokenizer.pad_id] * pad)
            rows["token_type_ids"].append(types + [pad_type] * pad)
            rows["attention_mask"].append([1] * len(ids) + [0] * pad)
            p_mask = np.where(words >= 0, 0, 1)
            p_mask[cls] = 0
            rows["p_mask"].append(p_mask)
            rows["start_positions"].append(start_position)
            rows["end_positions"].append(end_position)
            rows["cls_index"].append(cls)
            rows["is_impossible"].append(int(example.is_impossible))
            example_of.append(number)
            token_words.append(words)
            max_context.append(best)
    arrays = {k: np.asarray(v, np.int32) for k, v in rows.items()}
    arrays["p_mask"] = arrays["p_mask"].reshape(len(example_of), max_seq_length)
    return Windows(arrays, np.asarray(example_of, np.int32),
                   np.asarray(token_words, np.int32).reshape(len(example_of), max_seq_length),
                   np.asarray(max_context, bool).reshape(len(example_of), max_seq_length))


def _strip_accents(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFD", text)
                   if unicodedata.category(c) != "Mn")


def final_text(predicted: str, original: str, lowercase: bool) -> str:
    """run_squad.py `get_final_text`: the piece of the original words `original` that the
    detokenised prediction `predicted` covers (the tokenizer lower-cased, stripped accents and
    split punctuation off, so the prediction may be shorter than its words, e.g. "steve" of
    "(Steve"), aligned character by character with whitespace ignored; `original` itself when
    they do not align."""
    normal, where = [], []
    for index, char in enumerate(original):
        if _is_whitespace(char) or char.isspace():
            continue
        for c in (_strip_accents(char.lower()) if lowercase else char):
            normal.append(c)
            where.append(index)
    target = "".join(c for c in (predicted.lower() if lowercase else predicted)
                     if not c.isspace())
    found = "".join(normal).find(target) if target else -1
    if found < 0:
        return original
    return original[where[found]:where[found + len(target) - 1] + 1]


@dataclasses.dataclass(frozen=True)
class Predictions:
    """Per question id: the answer `text` at the threshold used, the best non-null answer
    (`best_non_null`), v2.0's `score_diff` (the official evaluation's `na_prob`: null score
    minus the best non-null span's, or the beam head's null logit) and, from the beam head,
    the n-best answers with their probabilities (`nbest`)."""

    text: dict[str, str]
    best_non_null: dict[str, str]
    score_diff: dict[str, float]
    nbest: dict[str, list[tuple[str, float]]] = dataclasses.field(default_factory=dict)


def _by_example(windows: Windows) -> dict[int, list[int]]:
    """example index -> its window rows."""
    rows: dict[int, list[int]] = {}
    for row, number in enumerate(windows.example):
        rows.setdefault(int(number), []).append(row)
    return rows


def _answer_text(example: SquadExample, windows: Windows, row: int, start: int, end: int,
                 tokenizer: Tokenizer) -> str:
    """The context text of window `row`'s sub-tokens `start`..`end`: detokenised and mapped
    back onto the words they lie in (`final_text`)."""
    ids = windows.arrays["input_ids"][row, start:end + 1]
    first_word, last_word = windows.token_words[row, start], windows.token_words[row, end]
    original = example.context[example.word_spans[first_word][0]:
                               example.word_spans[last_word][1]]
    return final_text(tokenizer.decode([int(i) for i in ids]), original,
                      bool(getattr(tokenizer, "lowercase", False)))


def predict_answers(examples: Sequence[SquadExample], windows: Windows, start_logits: np.ndarray,
                    end_logits: np.ndarray, tokenizer: Tokenizer, *, with_null: bool,
                    n_best: int = 20, max_answer_length: int = 30,
                    null_score_diff_threshold: float = 0.0,
                    answerable_logits: np.ndarray | None = None) -> Predictions:
    """run_squad.py `write_predictions`: for every question, the `n_best` best starts and ends
    of each of its windows pair up into spans (inside the context, end >= start, at most
    `max_answer_length` sub-tokens, starting in the window where that sub-token has max
    context), scored start + end logit; the best span's sub-tokens are detokenised and mapped
    back to the context's characters (`final_text`). With `with_null` (v2.0), the null score
    is the lowest start + end at the windows' `cls_index`, and the answer is empty when it beats
    the best span by more than `null_score_diff_threshold`. Given `answerable_logits` [N] (the
    answerable head's, RoBERTa §5.2: spans are predicted only for questions classified
    answerable), the score difference is instead minus the highest answerability logit over
    the question's windows (a question is answerable where one of its windows holds the
    answer), so that at the threshold 0 the answer is empty unless some window's probability
    of holding it exceeds 0.5."""
    by_example = _by_example(windows)
    text, best_text, diffs = {}, {}, {}
    for number, example in enumerate(examples):
        candidates, null_score = [], None
        for row in by_example.get(number, []):
            starts, ends = start_logits[row], end_logits[row]
            cls = int(windows.cls_index[row])
            null = float(starts[cls] + ends[cls])
            null_score = null if null_score is None else min(null_score, null)
            words, best = windows.token_words[row], windows.max_context[row]
            top_starts = np.argsort(-starts, kind="stable")[:n_best]
            top_ends = np.argsort(-ends, kind="stable")[:n_best]
            for s in top_starts:
                for e in top_ends:
                    if words[s] < 0 or words[e] < 0 or not best[s] or e < s:
                        continue
                    if e - s + 1 > max_answer_length:
                        continue
                    candidates.append((float(starts[s] + ends[e]), row, int(s), int(e)))
        candidates.sort(key=lambda c: -c[0])
        answer, score = "", None
        if candidates:
            score, row, s, e = candidates[0]
            answer = _answer_text(example, windows, row, s, e, tokenizer)
        best_text[example.qid] = answer
        if with_null and null_score is not None:
            if answerable_logits is not None:
                diff = -max(float(answerable_logits[row]) for row in by_example[number])
            else:
                diff = null_score - (score if score is not None else -np.inf)
            diffs[example.qid] = float(diff)
            text[example.qid] = "" if diff > null_score_diff_threshold else answer
        else:
            text[example.qid] = answer
    return Predictions(text, best_text, diffs)


BEAM_RULES = ("xlnet", "albert", "electra")  # whose rules `predict_beam_answers` follows


def predict_beam_answers(examples: Sequence[SquadExample], windows: Windows,
                         beams: dict[str, np.ndarray], tokenizer: Tokenizer, *, with_null: bool,
                         n_best: int = 5, max_answer_length: int = 64,
                         null_score_diff_threshold: float = 0.0, rules: str = "xlnet"
                         ) -> Predictions:
    """zihangdai/xlnet run_squad.py `write_predictions` on the beam head's outputs
    (`models.span.BeamSpanExtractor.beam`: `start_top_log_probs` / `start_top_index` [N, S],
    `end_top_log_probs` / `end_top_index` [N, S, E], `cls_logits` [N]): every (start, end)
    beam pair of a question's windows is a candidate unless the start or end is outside the
    context or its last sub-token (run_squad.py's bound `index >= paragraph_len - 1`, kept),
    the window is not the start's max-context one, the end precedes the start or the span is
    longer than `max_answer_length`; candidates rank by start + end log-probability; the
    first `n_best` distinct answer texts, with the softmax of their scores, are `nbest`, and
    the first is the best non-null answer. The null score is the lowest `cls_logits` over the
    question's windows and is itself the `score_diff` (run_squad.py's null odds); with
    `with_null` the answer is empty when it exceeds `null_score_diff_threshold`.
    `rules="albert"`: google-research/albert squad_utils.py `accumulate_predictions_v2` /
    `write_predictions_v2` instead, which differ in two points: the window's last context
    sub-token may start or end a span, and the answer is empty when the null score reaches
    the threshold (kept only when below it). `rules="electra"`: google-research/electra
    finetune/qa/qa_metrics.py `write_predictions` on the joint head's outputs: the last
    context sub-token may start or end a span (as ALBERT's), the null score is the lowest
    answerability logit and empties the answer when above the threshold (as XLNet's), and a
    question without candidates is answered "empty" (its nonce prediction)."""
    if rules not in BEAM_RULES:
        raise ValueError(f"rules={rules!r} must be one of {BEAM_RULES}")
    xlnet, strict = rules == "xlnet", rules != "albert"
    by_example = _by_example(windows)
    text, best_text, diffs, nbest = {}, {}, {}, {}
    for number, example in enumerate(examples):
        candidates, null_score = [], None
        for row in by_example.get(number, []):
            null = float(beams["cls_logits"][row])
            null_score = null if null_score is None else min(null_score, null)
            context = np.flatnonzero(windows.token_words[row] >= 0)
            last = context[-1] if len(context) else -1
            for i, s in enumerate(beams["start_top_index"][row]):
                for j, e in enumerate(beams["end_top_index"][row, i]):
                    s, e = int(s), int(e)
                    if windows.token_words[row, s] < 0 or windows.token_words[row, e] < 0:
                        continue
                    if xlnet and (s >= last or e >= last):
                        continue
                    if not windows.max_context[row, s]:
                        continue
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    candidates.append((float(beams["start_top_log_probs"][row, i])
                                       + float(beams["end_top_log_probs"][row, i, j]),
                                       row, s, e))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep run_squad.py's order
        seen: dict[str, float] = {}
        for score, row, s, e in candidates:
            if len(seen) >= n_best:
                break
            seen.setdefault(_answer_text(example, windows, row, s, e, tokenizer), score)
        if not seen:  # run_squad.py's "nonce prediction" (qa_metrics.py's: "empty", 0)
            seen.update({"empty": 0.0} if rules == "electra" else {"": -2e6})
        scores = np.asarray(list(seen.values()))
        probabilities = np.exp(scores - scores.max())
        probabilities /= probabilities.sum()
        nbest[example.qid] = list(zip(seen, probabilities.tolist(), strict=True))
        answer = best_text[example.qid] = next(iter(seen))
        if with_null and null_score is not None:
            diffs[example.qid] = null_score
            empty = (null_score > null_score_diff_threshold if strict
                     else null_score >= null_score_diff_threshold)
            text[example.qid] = "" if empty else answer
        else:
            text[example.qid] = answer
    return Predictions(text, best_text, diffs, nbest)
