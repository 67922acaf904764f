"""Our samplers against the REFERENCE's definition (issue 34), not against our own.

Each reference algorithm is re-stated here in plain Python / numpy from reading the authors'
code (re-stated, never copied), both it and our sampler are drawn a few thousand times, and their
distributions are compared. The other test files check our samplers against our own
definitions; this one checks that those definitions are the references'.

References read:
- google-research/bert `create_pretraining_data.py` (eedf571): `create_instances_from_document`,
  `truncate_seq_pair`, `create_masked_lm_predictions` (with and without whole-word masking).
- zihangdai/xlnet `data_utils.py` (bbaa3a6): `_sample_mask`, and `create_tfrecords`' split of
  `num_predict` between the two halves.
- google-research/text-to-text-transfer-transformer `t5/data/preprocessors.py` (e081111):
  `random_spans_noise_mask` (as `span_corruption` calls it: no random roll).
- microsoft/MASS `MASS-unsupNMT/src/trainer.py` (779f22f): `restricted_mask_sent`,
  `get_segments`, `shuffle_segments`, `unfold_segments`, `mask_word`; `src/data/dataset.py`
  `batch_sentences` (a sentence is `</s> words </s>`).
- facebookresearch/fairseq `fairseq/data/data_utils.py` (3d262bb2): `compute_mask_indices` as
  `models/wav2vec/wav2vec2.py` calls it (static spans of 10, mask_prob 0.65, min_masks 2,
  overlapping; one utterance, and a batch with `require_same_masks`).
- facebookresearch/fairseq `fairseq/models/wav2vec/wav2vec.py` (f8a7c934):
  `Wav2VecPredictionsModel.sample_negatives` (wav2vec 1.0's same-utterance negatives).
- PaddlePaddle/ERNIE `batching.py` `mask` (ERNIE 1.0's release d8afc4d, unchanged in
  release/r2.0), the knowledge-masking branch (`mask_word`).

How distributions are compared: every statistic is ONE value per independent draw (a count, or
one span / one masked position picked uniformly from the draw), so the values of a sampler are
i.i.d. and the tests are exact in their assumptions: Pearson's chi-square homogeneity test on
the two histograms (values seen fewer than 10 times pooled), Welch's t-test on the means and
the Brown-Forsythe test on the spreads. Agreement needs every p-value above `ALPHA` (1e-6);
each sampler has a negative control, a deliberately altered re-statement, which the same
comparison must reject (a p-value below `ALPHA`). Everything is seeded.

Where ours departs from the reference on purpose (ERNIE's budget, XLNet's punctuation pieces,
wav2vec's exclusion of the target from its negatives),
the agreeing parts are compared and the stated departure's direction is asserted by name.
Disagreements that no document states are `xfail(strict=True)` with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import numpy as np
import pytest
from scipy import stats

from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.examples import ernie as ernie_examples
from pretext_jax.input_pipeline.examples import mass as mass_examples
from pretext_jax.input_pipeline.examples import seq2seq as seq2seq_examples
from pretext_jax.input_pipeline.examples import xlnet as xlnet_examples
from pretext_jax.objectives.wav2vec2 import MaskingSettings, span_mask

ALPHA = 1e-6
"""A comparison rejects "same distribution" below this p-value. With about 50 comparisons of up
to three p-values each in the file, a false rejection has odds near 1e-4 for any seed; the
negative controls' p-values stayed below 1e-10 in every seed tried."""

VOCAB_SIZE = 1000
PAD, CLS, SEP, MASK = 0, 2, 3, 4  # 1 is [UNK]; ids 5.. are text
FIRST_TEXT_ID = 5
CONTINUATION = np.zeros(VOCAB_SIZE, bool)
CONTINUATION[700:] = True  # ids 700-999 continue a word (WordPiece `##x`, no `▁`)
VOCAB = bert_examples.MaskingVocab(VOCAB_SIZE, PAD, CLS, SEP, MASK, CONTINUATION)
MASKED, KEPT, REPLACED = 0, 1, 2  # what happened to a chosen token


# --- Comparisons ------------------------------------------------------------------------------


def histogram_p(ours, reference, min_count: int = 10) -> float:
    """Chi-square homogeneity p-value of two samples of discrete values; values seen fewer than
    `min_count` times in both samples together are pooled into one bin (dropped if that bin is
    still that rare)."""
    ours, reference = np.asarray(ours), np.asarray(reference)
    values, index = np.unique(np.concatenate([ours, reference]), return_inverse=True)
    counts = np.zeros((2, len(values)), np.int64)
    np.add.at(counts, (np.repeat([0, 1], [len(ours), len(reference)]), index), 1)
    rare = counts.sum(0) < min_count
    pooled = counts[:, rare].sum(1, keepdims=True)
    counts = counts[:, ~rare]
    if pooled.sum() >= min_count:
        counts = np.concatenate([counts, pooled], axis=1)
    if counts.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(counts, correction=False).pvalue)


def _constant_p(ours: np.ndarray, reference: np.ndarray) -> float | None:
    if ours.std() == 0 and reference.std() == 0:
        return float(ours.mean() == reference.mean())
    return None


def mean_p(ours, reference) -> float:
    ours, reference = np.asarray(ours, float), np.asarray(reference, float)
    constant = _constant_p(ours, reference)
    if constant is not None:
        return constant
    return float(stats.ttest_ind(ours, reference, equal_var=False).pvalue)


def spread_p(ours, reference) -> float:
    ours, reference = np.asarray(ours, float), np.asarray(reference, float)
    constant = _constant_p(ours, reference)
    if constant is not None:
        return constant
    return float(stats.levene(ours, reference, center="median").pvalue)


def p_values(ours, reference, numeric: bool = True) -> dict[str, float]:
    """The comparison's p-values: histogram, and for numbers also mean and spread."""
    result = {"histogram": histogram_p(ours, reference)}
    if numeric:
        result.update(mean=mean_p(ours, reference), spread=spread_p(ours, reference))
    return result


def describe(name: str, ours, reference, values: dict[str, float]) -> str:
    ours, reference = np.asarray(ours, float), np.asarray(reference, float)
    return (f"{name}: ours mean {ours.mean():.4f} sd {ours.std():.4f} (n {len(ours)}), "
            f"reference mean {reference.mean():.4f} sd {reference.std():.4f} "
            f"(n {len(reference)}); p-values {values}")


def assert_agree(name: str, ours, reference, numeric: bool = True) -> None:
    values = p_values(ours, reference, numeric)
    assert min(values.values()) > ALPHA, describe(name, ours, reference, values)


def assert_rejected(name: str, ours, reference, numeric: bool = True) -> None:
    """A negative control: the same comparison must tell the two apart."""
    values = p_values(ours, reference, numeric)
    assert min(values.values()) < ALPHA, "not rejected: " + describe(name, ours, reference,
                                                                     values)


def runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the maximal runs of True in a bool vector."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


def pick(values, rng: np.random.Generator):
    """One of `values`, uniformly: a draw's single contribution to a statistic."""
    return values[int(rng.integers(len(values)))]


def corruption(output, original) -> np.ndarray:
    """MASKED / KEPT / REPLACED per chosen token (a random id equal to the original counts as
    kept, for both samplers alike)."""
    output, original = np.asarray(output), np.asarray(original)
    return np.where(output == MASK, MASKED, np.where(output == original, KEPT, REPLACED))


# --- BERT: create_pretraining_data.py ----------------------------------------------------------


def reference_bert_pairs(documents, index: int, rng: random.Random, max_seq_length: int,
                         short_seq_prob: float) -> list[tuple[list[int], list[int], bool]]:
    """`create_instances_from_document`'s (A, B, is_random_next), re-stated. The target length
    is max_seq_length - 3, or with short_seq_prob a uniform integer in [2, that]. Sentences
    gather into a chunk until it reaches the target (or the document ends); A is its first
    a_end sentences, a_end uniform in [1, sentences - 1] (1 for one sentence). B is a random
    document's sentences from a random start until target - len(A) tokens (always for a
    one-sentence chunk, else with probability 0.5; the chunk's unused sentences go back), or
    the chunk's remaining sentences. Then the longer side (B on ties) loses its first or last
    token, 50/50, until the pair fits."""
    limit = max_seq_length - 3
    target = rng.randint(2, limit) if rng.random() < short_seq_prob else limit
    document = documents[index]
    pairs, chunk, i = [], [], 0
    while i < len(document):
        chunk.append(document[i])
        if i == len(document) - 1 or sum(map(len, chunk)) >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) > 1 else 1
            a = [token for sentence in chunk[:a_end] for token in sentence]
            random_next = len(chunk) == 1 or rng.random() < 0.5
            if random_next:
                other = index
                for _ in range(10):  # ten tries at another document
                    other = rng.randint(0, len(documents) - 1)
                    if other != index:
                        break
                sentences = documents[other]
                b = []
                for sentence in sentences[rng.randint(0, len(sentences) - 1):]:
                    b += sentence
                    if len(b) >= target - len(a):
                        break
                i -= len(chunk) - a_end
            else:
                b = [token for sentence in chunk[a_end:] for token in sentence]
            while len(a) + len(b) > limit:
                longer = a if len(a) > len(b) else b
                del longer[0 if rng.random() < 0.5 else -1]
            pairs.append((a, b, random_next))
            chunk = []
        i += 1
    return pairs


def reference_bert_groups(tokens, whole_word: bool) -> list[list[int]]:
    """`create_masked_lm_predictions`' candidates: every position but [CLS] / [SEP]; with
    whole-word masking a `##` piece joins the LAST candidate group so far (whatever lies
    between)."""
    groups: list[list[int]] = []
    for position, token in enumerate(tokens):
        if token in (CLS, SEP):
            continue
        if whole_word and groups and CONTINUATION[token]:
            groups[-1].append(position)
        else:
            groups.append([position])
    return groups


def reference_bert_mask(tokens, rng: random.Random, masked_lm_prob: float,
                        max_predictions: int, whole_word: bool) -> tuple[list[int], list[int]]:
    """`create_masked_lm_predictions`, re-stated: the groups shuffled; the budget is
    min(max_predictions, max(1, round(len(tokens) x prob))) with the specials counted; groups
    are taken in order while the total stays within it (one that would pass it is skipped,
    the loop stops once it is reached); each taken token is [MASK] with probability 0.8, else
    kept or a uniform vocabulary id, 50/50. Returns (output, sorted positions)."""
    groups = reference_bert_groups(tokens, whole_word)
    rng.shuffle(groups)
    budget = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    output, chosen = list(tokens), []
    for group in groups:
        if len(chosen) >= budget:
            break
        if len(chosen) + len(group) > budget:
            continue
        for position in group:
            if rng.random() < 0.8:
                output[position] = MASK
            elif rng.random() >= 0.5:
                output[position] = rng.randint(0, VOCAB_SIZE - 1)
            chosen.append(position)
    return output, sorted(chosen)


BERT_DOCUMENTS = 200
BERT_PASSES = 8
BERT_SETTINGS = {"max_seq_length": 64, "max_predictions_per_seq": 7, "masked_lm_prob": 0.15,
                 "short_seq_prob": 0.1}
"""Short pairs, so that chunking, truncation and the prediction cap (7 < 0.15 x 64) all act."""


@functools.cache
def bert_corpus() -> list[list[list[int]]]:
    rng = np.random.default_rng(11)
    return [[rng.integers(FIRST_TEXT_ID, VOCAB_SIZE, rng.integers(3, 41)).tolist()
             for _ in range(rng.integers(1, 12))] for _ in range(BERT_DOCUMENTS)]


def bert_statistics(instances_of, seed: int) -> dict[str, list]:
    """One value per (document, pass) for each statistic: the number of pairs the document
    gave, and of one pair picked uniformly: its length, A's length, is_random_next, its
    masked count, one masked position; and what happened to each of its masked tokens.
    `instances_of(index)` -> [(tokens, len(A), is_random_next, output, positions)]."""
    picker = np.random.default_rng(seed)
    out: dict[str, list] = {key: [] for key in (
        "pairs per document", "tokens", "A tokens", "random next", "masked",
        "masked position", "corruption")}
    for _ in range(BERT_PASSES):
        for index in range(BERT_DOCUMENTS):
            instances = instances_of(index)
            out["pairs per document"].append(len(instances))
            tokens, a_length, random_next, output, positions = pick(instances, picker)
            out["tokens"].append(len(tokens) // 4)
            out["A tokens"].append(a_length // 4)
            out["random next"].append(int(random_next))
            out["masked"].append(len(positions))
            out["masked position"].append(int(pick(positions, picker)) // 4 if len(positions)
                                          else -1)
            out["corruption"].extend(corruption(np.asarray(output)[positions],
                                                np.asarray(tokens)[positions]))
    return out


@functools.cache
def ours_bert(whole_word: bool) -> dict[str, list]:
    config = bert_examples.BertExampleConfig(**BERT_SETTINGS, dupe_factor=1,
                                             whole_word_mask=whole_word)
    documents, rng = bert_corpus(), np.random.default_rng(21)

    def instances_of(index):
        made = []
        for instance in bert_examples.create_instances_from_document(documents, index, config,
                                                                     VOCAB, rng):
            output, positions, _ = bert_examples.mask_tokens(instance.tokens, VOCAB, config, rng)
            made.append((instance.tokens, int((instance.segment_ids == 0).sum()) - 2,
                         bool(instance.is_random_next), output, positions))
        return made

    return bert_statistics(instances_of, seed=31)


@functools.cache
def reference_bert(whole_word: bool, masked_lm_prob: float = 0.15,
                   short_seq_prob: float = 0.1) -> dict[str, list]:
    documents, rng = bert_corpus(), random.Random(22)

    def instances_of(index):
        made = []
        for a, b, random_next in reference_bert_pairs(documents, index, rng,
                                                      BERT_SETTINGS["max_seq_length"],
                                                      short_seq_prob):
            tokens = [CLS, *a, SEP, *b, SEP]
            output, positions = reference_bert_mask(
                tokens, rng, masked_lm_prob, BERT_SETTINGS["max_predictions_per_seq"],
                whole_word)
            made.append((tokens, len(a), random_next, output, positions))
        return made

    return bert_statistics(instances_of, seed=32)


@pytest.mark.parametrize("whole_word", [False, True], ids=["pieces", "whole_words"])
def test_bert_pairs_and_masks_follow_create_pretraining_data(whole_word):
    """Pairs per document, pair length, A's length, the random-next share, masked counts (mean,
    spread, histogram), masked positions and the 80/10/10 split, ours vs the re-statement."""
    ours, reference = ours_bert(whole_word), reference_bert(whole_word)
    for name in ("pairs per document", "tokens", "A tokens", "random next", "masked",
                 "masked position"):
        assert_agree(name, ours[name], reference[name])
    assert_agree("corruption", ours["corruption"], reference["corruption"], numeric=False)
    if not whole_word:  # the cap of 7 predictions binds at 47 tokens and more
        assert max(ours["masked"]) == 7 and np.mean(np.asarray(ours["tokens"]) >= 12) > 0.5


def test_bert_negative_controls():
    """A masking rate of 0.25 instead of 0.15, and short pairs half the time instead of 10 %,
    are told apart by the masked-count and length comparisons."""
    ours = ours_bert(False)
    assert_rejected("masked", ours["masked"],
                    reference_bert(False, masked_lm_prob=0.25)["masked"])
    assert_rejected("tokens", ours["tokens"],
                    reference_bert(False, short_seq_prob=0.5)["tokens"])


def test_bert_whole_word_groups_across_sep_as_the_reference():
    """create_pretraining_data.py appends a `##` piece to the last candidate group even across
    [SEP]: a B whose front was truncated to a continuation piece joins A's last word. Without
    whole-word masking every piece is its own group (the control)."""
    word, piece = 10, 710
    tokens = np.asarray([CLS, word, piece, SEP, piece, word, SEP])
    assert reference_bert_groups(tokens.tolist(), True) == [[1, 2, 4], [5]]
    assert bert_examples.masking_candidates(tokens, VOCAB, True) == [[1, 2, 4], [5]]
    assert bert_examples.masking_candidates(tokens, VOCAB, False) == [[1], [2], [4], [5]]


# --- XLNet: data_utils.py _sample_mask ---------------------------------------------------------

XLNET_CONFIG = xlnet_examples.XLNetExampleConfig()  # alpha 6, beta 1, spans <= 5, 85 targets
XLNET_DRAWS = 1500
PUNCTUATION = np.zeros(VOCAB_SIZE, bool)
PUNCTUATION[600:650] = True  # single punctuation pieces (sentencepiece: no `▁`)
OURS_WORD_START = ~CONTINUATION & ~PUNCTUATION  # our tokenizers: a piece without `▁` continues
REFERENCE_START_PIECE = OURS_WORD_START | PUNCTUATION  # `▁x`, `<...>` and punctuation pieces


def reference_sample_mask(segment, is_start_piece, goal: int, rng: np.random.Generator,
                          reverse: bool = False, span_weights=None) -> np.ndarray:
    """`_sample_mask`, re-stated. While the cursor is inside the segment and fewer than `goal`
    are chosen: n in 1..5 with P(n) ~ 1/n (capped at what is left of the goal), a context of
    n x alpha // beta tokens and a left offset uniform in [0, context); the span begins at
    the first start piece from cursor + offset. Its end loop tests the span's FIRST piece
    (`seg[beg]`, a start) at every step, so each following piece counts as a gram: the span
    is n pieces, and sampling stops where begin + n reaches the segment's end. The cursor
    moves to the span's end plus the right context. Then uniform single positions until the
    goal. With `reverse` it works on the reversed segment. `span_weights` replaces 1/n (the
    negative control)."""
    starts = np.asarray(is_start_piece)[np.asarray(segment)]
    if reverse:
        starts = starts[::-1]
    length = len(starts)
    weights = 1.0 / np.arange(1, 6) if span_weights is None else np.asarray(span_weights)
    weights = weights / weights.sum()
    mask = np.zeros(length, bool)
    chosen = cursor = 0
    while cursor < length and chosen < goal:
        n = min(int(rng.choice(5, p=weights)) + 1, goal - chosen)
        context = n * XLNET_CONFIG.mask_alpha // XLNET_CONFIG.mask_beta
        left = int(rng.integers(context))
        begin = cursor + left
        while begin < length and not starts[begin]:
            begin += 1
        if begin + n >= length:
            break
        mask[begin:begin + n] = True
        chosen += n
        cursor = begin + n + (context - left)
    while chosen < goal:
        position = int(rng.integers(length))
        if not mask[position]:
            mask[position] = True
            chosen += 1
    return mask[::-1] if reverse else mask


@functools.cache
def xlnet_segments(with_punctuation: bool) -> tuple[np.ndarray, ...]:
    """30 segments of 256 pieces: words of a start piece and 0-2 continuation pieces, and with
    `with_punctuation` a punctuation piece after 30 % of the words."""
    rng = np.random.default_rng(41)
    segments = []
    for _ in range(30):
        pieces: list[int] = []
        while len(pieces) < 256:
            pieces.append(int(rng.integers(FIRST_TEXT_ID, 600)))
            pieces += rng.integers(700, VOCAB_SIZE, rng.integers(0, 3)).tolist()
            if with_punctuation and rng.random() < 0.3:
                pieces.append(int(rng.integers(600, 650)))
        segments.append(np.asarray(pieces[:256], np.int32))
    return tuple(segments)


def xlnet_statistics(sampler, segments, goal: int, seed: int) -> dict[str, list]:
    """Per draw: chosen count, number of runs, one run's length, one masked position (16 bins),
    whether that run starts at a word start / at a punctuation piece."""
    picker = np.random.default_rng(seed)
    out: dict[str, list] = {key: [] for key in (
        "chosen", "runs", "run length", "masked position", "run at word start",
        "run at punctuation")}
    for draw in range(XLNET_DRAWS):
        segment = segments[draw % len(segments)]
        mask = sampler(segment)
        starts, lengths = runs(mask)
        run = int(picker.integers(len(starts)))
        out["chosen"].append(int(mask.sum()))
        out["runs"].append(len(starts))
        out["run length"].append(int(lengths[run]))
        out["masked position"].append(int(pick(np.flatnonzero(mask), picker)) // 16)
        out["run at word start"].append(int(OURS_WORD_START[segment[starts[run]]]))
        out["run at punctuation"].append(int(PUNCTUATION[segment[starts[run]]]))
    return out


def xlnet_ours(goal: int, reverse: bool, with_punctuation: bool = False) -> dict[str, list]:
    rng = np.random.default_rng(42)
    return xlnet_statistics(
        lambda segment: xlnet_examples.sample_span_mask(OURS_WORD_START[segment], goal,
                                                        XLNET_CONFIG, rng, reverse),
        xlnet_segments(with_punctuation), goal, seed=51)


def xlnet_reference(goal: int, reverse: bool, with_punctuation: bool = False,
                    span_weights=None) -> dict[str, list]:
    rng = np.random.default_rng(43)
    return xlnet_statistics(
        lambda segment: reference_sample_mask(segment, REFERENCE_START_PIECE, goal, rng,
                                              reverse, span_weights),
        xlnet_segments(with_punctuation), goal, seed=52)


@pytest.mark.parametrize("goal, reverse", [(43, False), (42, True)],
                         ids=["reuse_half", "new_half_reversed"])
def test_xlnet_span_sampling_follows_sample_mask(goal, reverse):
    """85 targets split 43 / 42 between the halves as create_tfrecords splits them; per draw the
    chosen count, the runs, one run's length and start, one masked position agree."""
    assert XLNET_CONFIG.predict_per_half == (43, 42)
    ours, reference = xlnet_ours(goal, reverse), xlnet_reference(goal, reverse)
    assert set(ours["chosen"]) == set(reference["chosen"]) == {goal}
    for name in ("runs", "run length", "masked position", "run at word start"):
        assert_agree(name, ours[name], reference[name])


def test_xlnet_negative_control():
    """Span lengths uniform over 1..5 instead of P(n) ~ 1/n: the run-length comparison tells."""
    ours = xlnet_ours(43, False)
    altered = xlnet_reference(43, False, span_weights=np.ones(5))
    assert_rejected("run length", ours["run length"], altered["run length"])


def test_xlnet_stated_departure_punctuation_pieces_start_no_span():
    """Stated in docs/methods/autoregressive.md: the reference's `_is_start_piece` also counts
    punctuation pieces (no `▁`) as word starts, ours only non-continuation pieces. Direction:
    the reference starts runs at punctuation, ours almost never (only a random top-up single
    can land there); elsewhere they agree."""
    ours = xlnet_ours(43, False, with_punctuation=True)
    reference = xlnet_reference(43, False, with_punctuation=True)
    ours_share = np.mean(ours["run at punctuation"])
    reference_share = np.mean(reference["run at punctuation"])
    assert reference_share > 0.1 and ours_share < reference_share / 2, (ours_share,
                                                                         reference_share)
    assert histogram_p(ours["run at punctuation"], reference["run at punctuation"]) < ALPHA
    assert_agree("chosen", ours["chosen"], reference["chosen"])


# --- T5: preprocessors.py random_spans_noise_mask ----------------------------------------------

T5_DRAWS = 3000


def reference_noise_mask(length: int, rng: np.random.Generator, noise_density: float = 0.15,
                         mean_noise_span_length: float = 3.0, even: bool = False) -> np.ndarray:
    """`random_spans_noise_mask`, re-stated: on max(length, 2) tokens, round(length x density)
    noise tokens (at least 1, at most length - 1) in max(1, round(noise / mean)) spans; the
    noise and the non-noise tokens are each cut into that many positive spans, every cut
    equally likely (the reference shuffles a 0/1 vector; here: distinct cut points, another
    way to the same law), and the spans alternate non-noise, noise, ... from the start.
    `even` cuts the noise into near-equal spans (the negative control)."""
    padded = max(length, 2)
    noise = min(max(int(round(padded * noise_density)), 1), padded - 1)
    spans = max(int(round(noise / mean_noise_span_length)), 1)

    def cut(items: int) -> np.ndarray:
        points = np.sort(rng.choice(items - 1, spans - 1, replace=False)) + 1
        return np.diff(np.concatenate([[0], points, [items]]))

    noisy = (np.full(spans, noise // spans) + (np.arange(spans) < noise % spans) if even
             else cut(noise))
    plain = cut(padded - noise)
    mask = np.zeros(padded, bool)
    position = 0
    for plain_length, noise_length in zip(plain, noisy, strict=True):
        position += plain_length
        mask[position:position + noise_length] = True
        position += noise_length
    return mask[:length]


def t5_statistics(sampler, length: int, seed: int) -> dict[str, list]:
    """Per draw: noise count, noise spans, one noise span's length, one non-noise span's length,
    the first noise position and one noise position (16 bins each)."""
    picker = np.random.default_rng(seed)
    out: dict[str, list] = {key: [] for key in (
        "noise", "noise spans", "noise span length", "non-noise span length",
        "first noise position", "noise position")}
    bins = -(-length // 16)
    for _ in range(T5_DRAWS):
        mask = sampler(length)
        noise_starts, noise_lengths = runs(mask)
        _, plain_lengths = runs(~mask)
        out["noise"].append(int(mask.sum()))
        out["noise spans"].append(len(noise_starts))
        out["noise span length"].append(int(pick(noise_lengths, picker)))
        out["non-noise span length"].append(int(pick(plain_lengths, picker)))
        out["first noise position"].append(int(noise_starts[0]) // bins)
        out["noise position"].append(int(pick(np.flatnonzero(mask), picker)) // bins)
    return out


@functools.cache
def t5_ours(length: int) -> dict[str, list]:
    rng = np.random.default_rng(61)
    return t5_statistics(lambda n: seq2seq_examples.random_spans_noise_mask(n, 0.15, 3.0, rng),
                         length, seed=71)


def t5_reference(length: int, even: bool = False) -> dict[str, list]:
    rng = np.random.default_rng(62)
    return t5_statistics(lambda n: reference_noise_mask(n, rng, even=even), length, seed=72)


@pytest.mark.parametrize("length", [568, 100])
def test_t5_noise_mask_follows_random_spans_noise_mask(length):
    """568 raw tokens (T5's, 85 noise in 28 spans) and 100 (15 in 5): counts equal in every
    draw, span lengths and positions agree."""
    ours, reference = t5_ours(length), t5_reference(length)
    for name in ("noise", "noise spans", "noise span length", "non-noise span length",
                 "first noise position", "noise position"):
        assert_agree(name, ours[name], reference[name])


def test_t5_negative_control():
    """Noise cut into near-equal spans instead of a uniformly random segmentation: same counts,
    but the span-length comparison tells."""
    ours, altered = t5_ours(568), t5_reference(568, even=True)
    assert_agree("noise", ours["noise"], altered["noise"])
    assert_rejected("noise span length", ours["noise span length"],
                    altered["noise span length"])


# --- MASS: trainer.py restricted_mask_sent ------------------------------------------------------

MASS_DRAWS = 3000
MASS_CONFIG = mass_examples.MassExampleConfig()  # fraction 0.5, 20 % start, 20 % end, 80/10/10


def reference_mass_fragment(words: int, rng: random.Random, at_ends: bool = True
                            ) -> tuple[int, int]:
    """`restricted_mask_sent` for one sentence of `words` words, re-stated: XLM batches it as
    `</s> words </s>`, l = words + 2 positions; the fragment is k = round(0.5 x l) tokens (one
    segment: `lambda_span` 10000) among positions 1 .. l - 1 (the words and the final `</s>`,
    never the first), placed among l - 1 - k unmasked ones: with p uniform, p >= 0.8 puts it
    first, 0.6 <= p < 0.8 last, otherwise it is shuffled among them (uniform place). Returns
    (start, k) with start counted from the first word, as our segment (words + EOS) counts.
    `at_ends=False` drops the first/last rule (the negative control)."""
    length = words + 2
    size = round(length * 0.5)
    unmasked = length - 1 - size
    draw = rng.random() if at_ends else 0.0
    if draw >= 0.8:
        return 0, size
    if draw >= 0.6:
        return unmasked, size
    order = [size] + [0] * unmasked
    rng.shuffle(order)
    return order.index(size), size


def reference_mass_corruption(size: int, rng: np.random.Generator) -> np.ndarray:
    """`mask_word`: per fragment token [MASK] / itself / a uniform id of the vocabulary with
    `pred_probs` 0.8 / 0.1 / 0.1 (a random id equal to the original counts as kept)."""
    kind = rng.choice(3, size, p=[0.8, 0.1, 0.1])
    same = rng.integers(0, VOCAB_SIZE, size) == 0  # the original's odds, 1 / VOCAB_SIZE
    return np.where((kind == 2) & same, KEPT, np.asarray([MASKED, KEPT, REPLACED])[kind])


def mass_ours(lengths, config: mass_examples.MassExampleConfig = MASS_CONFIG,
              xlm_layout: bool = False) -> dict[str, list]:
    """Per draw (segment lengths m = words + EOS, cycled): start, k, and what happened to the
    fragment's tokens (pooled). `xlm_layout`: `XLMMassMasking` (method mass_xlm), whose
    encoder input starts with EOS and whose decoder positions are the fragment's."""
    rng = np.random.default_rng(81)
    masking = (mass_examples.XLMMassMasking if xlm_layout else mass_examples.MassMasking)(
        VOCAB, config)
    out: dict[str, list] = {"start": [], "size": [], "corruption": []}
    for draw in range(MASS_DRAWS):
        length = lengths[draw % len(lengths)]
        tokens = np.zeros(MASS_CONFIG.max_seq_length, np.int32)
        tokens[:length - 1] = rng.integers(FIRST_TEXT_ID, VOCAB_SIZE, length - 1)
        tokens[length - 1] = SEP
        example = masking.random_map({"tokens": tokens}, rng)
        if xlm_layout:
            fragment = example["decoder_positions"][example["decoder_mask"] == 1]
            inputs = example["inputs"][1:]  # after the leading EOS
        else:
            fragment, inputs = np.flatnonzero(example["targets"]), example["inputs"]
        out["start"].append(int(fragment[0]))
        out["size"].append(len(fragment))
        out["corruption"].extend(corruption(inputs[fragment], tokens[fragment]))
    return out


def mass_reference(lengths, at_ends: bool = True) -> dict[str, list]:
    rng, numpy_rng = random.Random(82), np.random.default_rng(83)
    out: dict[str, list] = {"start": [], "size": [], "corruption": []}
    for draw in range(MASS_DRAWS):
        start, size = reference_mass_fragment(lengths[draw % len(lengths)] - 1, rng, at_ends)
        out["start"].append(start)
        out["size"].append(size)
        out["corruption"].extend(reference_mass_corruption(size, numpy_rng))
    return out


@pytest.mark.parametrize("length", [20, 23])
def test_mass_fragment_start_and_80_10_10_follow_restricted_mask_sent(length):
    """At segment lengths where both fragment sizes agree (20: 10, 23: 12), the start's
    distribution (20 % first, 20 % last, else uniform) and the encoder-side 80/10/10 agree."""
    ours, reference = mass_ours([length]), mass_reference([length])
    assert set(ours["size"]) == set(reference["size"]) == {length // 2 + length % 2}
    assert_agree("start", ours["start"], reference["start"])
    assert_agree("corruption", ours["corruption"], reference["corruption"], numeric=False)


def test_mass_negative_control():
    """A start uniform over the places, without the 20 % first / 20 % last rule: rejected."""
    ours, altered = mass_ours([20]), mass_reference([20], at_ends=False)
    assert_rejected("start", ours["start"], altered["start"])


def test_mass_fragment_length_follows_restricted_mask_sent():
    """Over segment lengths 6 .. 40 the fragment sizes agree: the reference's round(0.5 x
    len(x)) counts the sentence-start </s> (`fragment_counts_sentence_start`). Control: without
    it, half of the lengths give a fragment one token shorter (5 words: 3 tokens, not 4)."""
    lengths = list(range(6, 41))
    ours, reference = mass_ours(lengths), mass_reference(lengths)
    assert_agree("size", ours["size"], reference["size"])
    without_start = dataclasses.replace(MASS_CONFIG, fragment_counts_sentence_start=False)
    assert without_start.fragment_size(6) == 3 and MASS_CONFIG.fragment_size(6) == 4
    assert_rejected("size", mass_ours(lengths, without_start)["size"], reference["size"])


def test_mass_xlm_layout_follows_restricted_mask_sent():
    """The reference's layout (`XLMMassMasking`) over sentence lengths 5 .. 39 words: the
    fragment's length (with the leading </s>), its start and the 80/10/10 agree."""
    lengths = list(range(6, 41))
    ours, reference = mass_ours(lengths, xlm_layout=True), mass_reference(lengths)
    for name in ("size", "start"):
        assert_agree(name, ours[name], reference[name])
    assert_agree("corruption", ours["corruption"], reference["corruption"], numeric=False)


# --- wav2vec 2.0: fairseq compute_mask_indices ---------------------------------------------------

WAV2VEC2_DRAWS = 3000
SPAN = 10


def reference_compute_mask_indices(frames: int, rng: np.random.Generator,
                                   mask_prob: float = 0.65) -> np.ndarray:
    """`compute_mask_indices` for one utterance of `frames` frames as wav2vec2.py calls it
    (static spans of 10, min_masks 2, overlapping, `num_mask_ver` 2: the rounding draw is the
    utterance's own), re-stated: int(mask_prob x frames / 10 + u) span starts, at least 2,
    distinct and uniform over [0, frames - 10) (over num + 1 places where that range has no
    more than num), each masking 10 frames, clipped to the utterance. (One utterance:
    `require_same_masks` has nothing to equalise.)"""
    count = max(2, int(mask_prob * frames / SPAN + rng.random()))
    places = frames - SPAN if frames - SPAN > count else count + 1
    starts = rng.choice(places, count, replace=False)
    covered = (starts[:, None] + np.arange(SPAN)).ravel()
    mask = np.zeros(frames, bool)
    mask[covered[covered < frames]] = True
    return mask


def wav2vec2_statistics(sampler, frames: int, seed: int) -> dict[str, list]:
    """Per draw: masked frames, one masked frame among the first frames - 10 (20 bins), one
    masked frame anywhere (per frame in the last 10, 20 bins before), the last frame."""
    picker = np.random.default_rng(seed)
    out: dict[str, list] = {key: [] for key in (
        "masked", "masked position before the last span", "masked position", "last frame")}
    width = -(-(frames - SPAN) // 20)
    for _ in range(WAV2VEC2_DRAWS):
        mask = sampler(frames)
        positions = np.flatnonzero(mask)
        out["masked"].append(len(positions))
        out["masked position before the last span"].append(
            int(pick(positions[positions < frames - SPAN], picker)) // width)
        position = int(pick(positions, picker))
        out["masked position"].append(position // width if position < frames - SPAN
                                      else 1000 + position)
        out["last frame"].append(int(mask[-1]))
    return out


@functools.cache
def wav2vec2_ours(frames: int) -> dict[str, list]:
    rng = np.random.default_rng(91)
    return wav2vec2_statistics(
        lambda n: span_mask(np.asarray([n]), n, MaskingSettings(), rng)[0], frames, seed=101)


def wav2vec2_reference(frames: int, mask_prob: float = 0.65) -> dict[str, list]:
    rng = np.random.default_rng(92)
    return wav2vec2_statistics(lambda n: reference_compute_mask_indices(n, rng, mask_prob),
                               frames, seed=102)


@pytest.mark.parametrize("frames", [200, 40])
def test_wav2vec2_span_mask_follows_compute_mask_indices(frames):
    """The masked-frame count (mean, spread, histogram; spans overlap), the masked frames'
    positions (the last 10 frames each on its own) and whether the last frame is masked (never,
    in both) agree."""
    ours, reference = wav2vec2_ours(frames), wav2vec2_reference(frames)
    for name in ("masked", "masked position before the last span", "masked position"):
        assert_agree(name, ours[name], reference[name])
    assert not any(ours["last frame"]) and not any(reference["last frame"])


def test_wav2vec2_negative_control():
    """mask_prob 0.5 instead of 0.65 (p 0.05 of the frames start a span): the count comparison
    tells."""
    ours, altered = wav2vec2_ours(200), wav2vec2_reference(200, mask_prob=0.5)
    assert_rejected("masked", ours["masked"], altered["masked"])


SAME_MASK_ROWS = 6


def reference_same_masks(frames: int, rng: np.random.Generator, same: bool = True
                         ) -> np.ndarray:
    """[rows, frames]: `compute_mask_indices` over a batch of `SAME_MASK_ROWS` utterances of
    `frames` frames (no padding, as fairseq's pre-training crops them), re-stated: each row's
    masked frames drawn as above; with `require_same_masks` every row with more than the
    fewest keeps that many of them, chosen uniformly without replacement."""
    rows = [np.flatnonzero(reference_compute_mask_indices(frames, rng))
            for _ in range(SAME_MASK_ROWS)]
    fewest = min(len(row) for row in rows) if same else None
    mask = np.zeros((SAME_MASK_ROWS, frames), bool)
    for index, row in enumerate(rows):
        if fewest is not None and len(row) > fewest:
            row = rng.choice(row, fewest, replace=False)
        mask[index, row] = True
    return mask


def same_mask_statistics(sampler, frames: int, seed: int) -> dict[str, list]:
    """Per batch drawn: row 0's masked count, one masked position of one row, whether every
    row has the same count."""
    picker = np.random.default_rng(seed)
    out: dict[str, list] = {"masked": [], "masked position": [], "equal counts": []}
    for _ in range(WAV2VEC2_DRAWS):
        mask = sampler(frames)
        counts = mask.sum(axis=1)
        out["masked"].append(int(counts[0]))
        row = mask[int(picker.integers(SAME_MASK_ROWS))]
        out["masked position"].append(int(pick(np.flatnonzero(row), picker)) * 20 // frames)
        out["equal counts"].append(bool((counts == counts[0]).all()))
    return out


def same_masks_ours(frames: int, same: bool = True) -> dict[str, list]:
    rng = np.random.default_rng(93)
    return same_mask_statistics(
        lambda n: span_mask(np.full(SAME_MASK_ROWS, n), n, MaskingSettings(), rng,
                            same_count=same), frames, seed=103)


def test_wav2vec2_equal_masked_counts_follow_require_same_masks():
    """Every row of a batch keeps the same masked count, whose distribution (the fewest of six
    rows' counts) and the masked positions agree with fairseq's; without the equalisation
    (negative control) the counts differ between rows and their distribution is rejected."""
    ours = same_masks_ours(200)
    rng = np.random.default_rng(94)
    reference = same_mask_statistics(lambda n: reference_same_masks(n, rng), 200, seed=104)
    assert all(ours["equal counts"]) and all(reference["equal counts"])
    for name in ("masked", "masked position"):
        assert_agree(name, ours[name], reference[name])
    unequal = same_masks_ours(200, same=False)
    assert not all(unequal["equal counts"])
    assert_rejected("masked", unequal["masked"], reference["masked"])


# --- ERNIE 1.0: batching.py mask ----------------------------------------------------------------

ERNIE_DRAWS = 2000
ERNIE_CONFIG = ernie_examples.ErnieExampleConfig(max_seq_length=64, max_predictions_per_seq=20,
                                                 masking="entity")
ENTITY = ernie_examples.JOINS["entity"]


def unit_spans(labels: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each unit of ERNIE's seg_labels (a 0 and the 1s after it)."""
    starts = np.flatnonzero(labels == 0)
    boundaries = np.flatnonzero(labels != 1)  # unit starts and specials; the last is [SEP]
    ends = boundaries[np.searchsorted(boundaries, starts, side="right")]
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def reference_knowledge_mask(ids: np.ndarray, spans: list[tuple[int, int]],
                             rng: np.random.Generator,
                             rate=lambda position, length: 0.15, first_scaled: bool = True
                             ) -> tuple[np.ndarray, list[int]]:
    """`mask` with `mask_word` on, re-stated, for the units `spans` of ERNIE's seg_labels (-1
    for [CLS] / [SEP], 0 for a unit's first token, 1 for the rest of it). One uniform draw per
    token; a unit is taken when the draw at its first token is <= 0.15, with no cap on the
    total. Every token of a taken unit becomes [MASK], a uniform id in [1, vocab) or stays:
    the first token re-uses its (<= 0.15) draw against 0.15 x (0.2, 0.1), the others their
    own draw against (0.2, 0.1): 80/10/10 each. `rate` (a function of position and length) replaces
    0.15 and `first_scaled=False` compares the first token's draw with the unscaled
    thresholds (the negative controls). Returns (output, chosen positions)."""
    draws = rng.random(len(ids))
    replacements = rng.integers(1, VOCAB_SIZE, len(ids))
    output, chosen = ids.copy(), []
    for start, end in spans:
        threshold = rate(start, len(ids))
        if draws[start] > threshold:
            continue
        for position in range(start, end):
            scale = threshold if position == start and first_scaled else 1.0
            if draws[position] > 0.2 * scale:
                output[position] = MASK
            elif draws[position] > 0.1 * scale:
                output[position] = replacements[position]
            chosen.append(position)
    return output, chosen


@functools.cache
def ernie_examples_of(single_token_units: bool
                      ) -> tuple[tuple[np.ndarray, list[tuple[int, int]]], ...]:
    """20 pairs [CLS] A [SEP] B [SEP] of 64 tokens with units of 1-4 tokens (55/20/15/10 %), or
    all of one token, as (our ids: the entity bit on every token of a unit but its first;
    the units' [start, end), from the reference's seg_labels)."""
    rng = np.random.default_rng(111)
    examples = []
    for _ in range(20):
        tokens, labels = [CLS], [-1]
        while len(tokens) < 63:
            if len(tokens) == 31:
                tokens.append(SEP)
                labels.append(-1)
            size = 1 if single_token_units else int(rng.choice(4, p=[0.55, 0.2, 0.15, 0.1])) + 1
            size = min(size, (31 if len(tokens) < 31 else 63) - len(tokens))
            for offset in range(size):
                token = int(rng.integers(FIRST_TEXT_ID, 700))
                tokens.append(token | (ENTITY if offset else 0))
                labels.append(1 if offset else 0)
        examples.append((np.asarray([*tokens, SEP]), unit_spans(np.asarray([*labels, -1]))))
    return tuple(examples)


def ernie_statistics(sampler, single_token_units: bool, seed: int) -> dict[str, list]:
    """Per draw: masked count, one masked position (16 bins), the taken share of its 1-token
    and of its 4-token units; what happened to each masked token (pooled)."""
    picker = np.random.default_rng(seed)
    examples = ernie_examples_of(single_token_units)
    out: dict[str, list] = {key: [] for key in (
        "masked", "masked position", "corruption", "units of 1 taken", "units of 4 taken")}
    for draw in range(ERNIE_DRAWS):
        tokens, spans = examples[draw % len(examples)]
        output, chosen = sampler(tokens, spans)
        plain = tokens & ernie_examples.ID_BITS
        out["masked"].append(len(chosen))
        out["masked position"].append(int(pick(chosen, picker)) // 4 if len(chosen) else -1)
        out["corruption"].extend(corruption(output[chosen], plain[chosen]))
        starts, ends = np.asarray(spans).T
        taken = np.isin(starts, chosen)
        for size in (1, 4):
            if (ends - starts == size).any():
                out[f"units of {size} taken"].append(taken[ends - starts == size].mean())
    return out


def ernie_ours(single_token_units: bool, config: ernie_examples.ErnieExampleConfig = ERNIE_CONFIG
               ) -> dict[str, list]:
    rng = np.random.default_rng(121)
    for tokens, spans in ernie_examples_of(single_token_units):  # the same units as ERNIE's
        assert ernie_examples.units(tokens, VOCAB, config) == [
            list(range(start, end)) for start, end in spans]

    def sampler(tokens, spans):
        output, positions, _ = ernie_examples.knowledge_mask_tokens(tokens, VOCAB, config, rng)
        return output, positions

    return ernie_statistics(sampler, single_token_units, seed=131)


def ernie_reference(single_token_units: bool, **altered) -> dict[str, list]:
    rng = np.random.default_rng(122)
    return ernie_statistics(
        lambda tokens, spans: reference_knowledge_mask(tokens & ernie_examples.ID_BITS, spans,
                                                       rng, **altered),
        single_token_units, seed=132)


@functools.cache
def ernie_draws(single_token_units: bool) -> tuple[dict[str, list], dict[str, list]]:
    return ernie_ours(single_token_units), ernie_reference(single_token_units)


def test_ernie_agreeing_parts_follow_batching_mask():
    """What ours keeps of the reference: a taken unit's tokens get 80/10/10 (first token and
    the rest alike), and no position is favoured (units of one token: one masked position per
    draw agrees)."""
    for single_token_units in (False, True):
        ours, reference = ernie_draws(single_token_units)
        assert_agree("corruption", ours["corruption"], reference["corruption"], numeric=False)
    ours, reference = ernie_draws(True)
    assert_agree("masked position", ours["masked position"], reference["masked position"],
                 numeric=False)


def test_ernie_negative_controls():
    """The first token compared with the unscaled thresholds, and a unit rate rising with the
    position (0 to 0.3, mean 0.15): rejected by the corruption and position comparisons."""
    ours = ernie_draws(True)[0]
    scrambled = ernie_reference(True, first_scaled=False)
    assert_rejected("corruption", ours["corruption"], scrambled["corruption"], numeric=False)
    rising = ernie_reference(True, rate=lambda position, length: 0.3 * position / length)
    assert_rejected("masked position", ours["masked position"], rising["masked position"],
                    numeric=False)


def test_ernie_stated_departure_units_fill_bert_budget():
    """Stated in docs/methods/masked_lm.md: the reference takes each unit with probability 0.15
    and no cap; ours, with `unit_selection=budget` (the default), fills BERT's 15 % budget
    (round(0.15 x 64) = 10 here). Directions: ours never passes the budget, the reference
    often does; our count spreads less; and since a unit that does not fit is passed over,
    ours takes long units less often than short ones, where the reference takes every unit at
    0.15 whatever its length."""
    ours, reference = ernie_draws(False)
    budget = bert_examples.prediction_budget(64, ERNIE_CONFIG)
    assert budget == 10
    assert max(ours["masked"]) <= budget
    assert np.mean(np.asarray(reference["masked"]) > budget) > 0.2
    assert np.std(ours["masked"]) < np.std(reference["masked"]) / 2
    assert spread_p(ours["masked"], reference["masked"]) < ALPHA
    ours_ratio = np.mean(ours["units of 4 taken"]) / np.mean(ours["units of 1 taken"])
    reference_ratio = (np.mean(reference["units of 4 taken"])
                       / np.mean(reference["units of 1 taken"]))
    assert ours_ratio < 0.8 < reference_ratio < 1.25, (ours_ratio, reference_ratio)
    assert abs(np.mean(reference["units of 1 taken"]) - 0.15) < 0.01


def test_ernie_bernoulli_units_follow_batching_mask():
    """`examples.unit_selection=bernoulli` (ernie_base): each unit taken with probability 0.15
    whatever its length and with no budget, as the reference: the masked count (mean and
    spread), the taken share of 1- and 4-token units and the masked position agree. Control:
    the budget selection (BERT's) is rejected on the count."""
    bernoulli = dataclasses.replace(ERNIE_CONFIG, unit_selection="bernoulli",
                                    max_predictions_per_seq=64)
    ours, reference = ernie_ours(False, bernoulli), ernie_draws(False)[1]
    for name in ("masked", "units of 1 taken", "units of 4 taken"):
        assert_agree(name, ours[name], reference[name])
    assert_agree("masked position", ours["masked position"], reference["masked position"],
                 numeric=False)
    assert_rejected("masked", ernie_draws(False)[0]["masked"], reference["masked"])


# --- wav2vec (1.0) negatives -------------------------------------------------------------------
# facebookresearch/fairseq `fairseq/models/wav2vec/wav2vec.py` (`Wav2VecPredictionsModel.
# sample_negatives`, n_negatives > 0, no cross-sample negatives, no sample_distance).

W2V_FRAMES, W2V_NEGATIVES, W2V_DRAWS = 12, 10, 4000


def reference_wav2vec_negatives(frames: int, rng: np.random.Generator, layout: str = "fairseq"
                                ) -> np.ndarray:
    """[T, N] frame indices of one utterance's negatives per target frame t, re-stated from
    `sample_negatives`: N T draws from [0, T - 1), laid out t-major (entry j belongs to target
    j // N), each at or above its target moved up by one; the features are then gathered with
    those N T indices and viewed as [N, T] (entry j is negative j // T of target j % T).
    `layout`: "fairseq" as that code does it; "t_major" read back t-major as its exclusion
    assumes (wav2vec2.py's layout); "no_exclusion" draws from [0, T) (the negative control)."""
    count = frames * W2V_NEGATIVES
    if layout == "no_exclusion":
        return rng.integers(0, frames, count).reshape(frames, W2V_NEGATIVES)
    draws = rng.integers(0, frames - 1, count)
    excluded = np.repeat(np.arange(frames), W2V_NEGATIVES)  # buffered_arange(T), expanded
    draws = draws + (draws >= excluded)
    if layout == "t_major":
        return draws.reshape(frames, W2V_NEGATIVES)
    return draws.reshape(W2V_NEGATIVES, frames).T


def wav2vec_statistics(draws: np.ndarray, seed: int) -> dict[str, list]:
    """Per draw ([T, N] of one utterance): one (target, negative) picked uniformly; its frame,
    its distance from the target and whether it is the target itself."""
    picker = np.random.default_rng(seed)
    out: dict[str, list] = {"negative frame": [], "distance": [], "is the positive": []}
    for negatives in draws:
        target = int(picker.integers(len(negatives)))
        frame = int(pick(negatives[target], picker))
        out["negative frame"].append(frame)
        out["distance"].append(frame - target)
        out["is the positive"].append(int(frame == target))
    return out


@functools.cache
def wav2vec_ours(real: int, padded: int) -> dict[str, list]:
    """Our sampler on W2V_DRAWS rows of `real` real frames right-padded to `padded`, in one
    call (each row an independent utterance)."""
    import jax
    import jax.numpy as jnp

    from pretext_jax.objectives.wav2vec import sample_negatives
    frames = jnp.broadcast_to(jnp.arange(padded) < real, (W2V_DRAWS, padded))
    draws = np.asarray(sample_negatives(jax.random.key(7), frames, W2V_NEGATIVES))
    return wav2vec_statistics(draws[:, :real], seed=111)


@functools.cache
def wav2vec_reference(frames: int, layout: str = "fairseq") -> dict[str, list]:
    rng = np.random.default_rng(112)
    return wav2vec_statistics(np.stack([reference_wav2vec_negatives(frames, rng, layout)
                                        for _ in range(W2V_DRAWS)]), seed=113)


@pytest.mark.parametrize("padded", [W2V_FRAMES, W2V_FRAMES + 5])
def test_wav2vec_negatives_follow_sample_negatives(padded):
    """Uniform over the utterance's frames (a padded row's real ones) in both: the negative's
    frame agrees with fairseq's as written; its distance from the target agrees with fairseq's
    exclusion read back as it is drawn (t-major)."""
    ours = wav2vec_ours(W2V_FRAMES, padded)
    assert_agree("negative frame", ours["negative frame"],
                 wav2vec_reference(W2V_FRAMES)["negative frame"])
    assert_agree("distance", ours["distance"], wav2vec_reference(W2V_FRAMES, "t_major")["distance"])


def test_wav2vec_negative_control():
    """Draws over [0, T) with no exclusion: the distance comparison tells."""
    assert_rejected("distance", wav2vec_ours(W2V_FRAMES, W2V_FRAMES)["distance"],
                    wav2vec_reference(W2V_FRAMES, "no_exclusion")["distance"])


def test_wav2vec_stated_departure_the_positive_is_never_a_negative():
    """Stated in docs/methods/speech.md: fairseq's wav2vec.py excludes, for the negative at
    [n, t] of its [N, T] view, the frame (n T + t) // N, not t (its exclusion is laid out
    t-major, its gather read back n-major), so the target itself is drawn as a negative about
    1 / (T - 1) of the time; ours excludes the target, as the paper and wav2vec2.py do."""
    ours, reference = wav2vec_ours(W2V_FRAMES, W2V_FRAMES), wav2vec_reference(W2V_FRAMES)
    assert not any(ours["is the positive"])
    rate = np.mean(reference["is the positive"])
    assert 0.5 / (W2V_FRAMES - 1) < rate < 1.5 / (W2V_FRAMES - 1), rate
