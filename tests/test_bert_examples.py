"""BERT example building as create_pretraining_data.py: masking statistics, whole-word groups,
NSP pairs, truncation, static vs dynamic masking; each for the one-by-one builder
(`create_training_examples`) and the bulk one (`bert_batches`), whose records must have the same
distribution."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import bert as be

VOCAB_SIZE = 1000
PAD, UNK, CLS, SEP, MASK = range(5)


@pytest.fixture(scope="module")
def vocab() -> be.MaskingVocab:
    continuation = np.random.default_rng(0).random(VOCAB_SIZE) < 0.3
    continuation[:5] = False
    return be.MaskingVocab(VOCAB_SIZE, PAD, CLS, SEP, MASK, continuation)


@pytest.fixture(scope="module")
def documents() -> list[list[list[int]]]:
    rng = np.random.default_rng(1)
    return [[rng.integers(5, VOCAB_SIZE, rng.integers(3, 41)).tolist()
             for _ in range(rng.integers(1, 12))] for _ in range(250)]


def bulk_examples(documents, vocab, config, seed):
    return [row for batch in be.bert_batches(documents, vocab, config, seed)
            for row in batch.rows()]


BUILDERS = {"one_by_one": be.create_training_examples, "bulk": bulk_examples}


@pytest.fixture(params=list(BUILDERS))
def builder(request):
    return BUILDERS[request.param]


def build(documents, vocab, builder=be.create_training_examples, seed=3, **overrides):
    config = be.BertExampleConfig(**{"dupe_factor": 1, **overrides})
    return config, list(builder(documents, vocab, config, seed))


def test_masking_statistics(documents, vocab, builder):
    config, examples = build(documents, vocab, builder, max_predictions_per_seq=200,
                             dupe_factor=2)
    total = kept = random = masked = 0
    for ex in examples:
        length = int(ex["input_mask"].sum())
        count = int(ex["masked_lm_weights"].sum())
        assert count == min(200, max(1, int(round(length * 0.15))))
        positions = ex["masked_lm_positions"][:count]
        assert np.all(np.diff(positions) > 0) and positions.max() < length
        assert np.all(ex["masked_lm_positions"][count:] == 0)
        assert np.all(ex["masked_lm_ids"][count:] == 0)
        # Special tokens are never chosen; labels are the original tokens.
        original = ex["input_ids"].copy()
        original[positions] = ex["masked_lm_ids"][:count]
        assert not np.isin(original[positions], [CLS, SEP, PAD]).any()
        assert original[0] == CLS and (original[:length] == SEP).sum() == 2
        shown = ex["input_ids"][positions]
        masked += int((shown == MASK).sum())
        kept += int((shown == original[positions]).sum())
        random += int(((shown != MASK) & (shown != original[positions])).sum())
        total += count
    assert total > 5000
    assert masked / total == pytest.approx(0.8, abs=0.02)
    # "keep" is 10%, plus random draws that happen to hit the original id (1/V of 10%).
    assert kept / total == pytest.approx(0.1, abs=0.015)
    assert random / total == pytest.approx(0.1, abs=0.015)


def test_overall_rate_and_max_predictions(documents, vocab, builder):
    _, examples = build(documents, vocab, builder, max_predictions_per_seq=200)
    weights = sum(ex["masked_lm_weights"].sum() for ex in examples)
    tokens = sum(ex["input_mask"].sum() for ex in examples)
    assert weights / tokens == pytest.approx(0.15, abs=0.01)
    _, capped = build(documents, vocab, builder, max_predictions_per_seq=4)
    assert max(ex["masked_lm_weights"].sum() for ex in capped) == 4
    assert capped[0]["masked_lm_positions"].shape == (4,)


def test_whole_word_masking_keeps_words_together(documents, vocab):
    config, examples = build(documents, vocab, whole_word_mask=True, max_predictions_per_seq=30)
    for ex in examples:
        count = int(ex["masked_lm_weights"].sum())
        original = ex["input_ids"].copy()
        original[ex["masked_lm_positions"][:count]] = ex["masked_lm_ids"][:count]
        positions = set(ex["masked_lm_positions"][:count].tolist())
        length = int(ex["input_mask"].sum())
        assert count <= min(30, max(1, int(round(length * 0.15))))
        for p in positions:  # a masked piece's whole word is masked
            if vocab.continuation[original[p]] and original[p - 1] not in (CLS, SEP):
                assert p - 1 in positions
            if p + 1 < length and vocab.continuation[original[p + 1]]:
                assert p + 1 in positions


def locate(sequence: list[int], documents) -> tuple[int, int] | None:
    """(document, offset) where `sequence` appears contiguously in a document's tokens."""
    n = len(sequence)
    for d, doc in enumerate(documents):
        flat = [t for s in doc for t in s]
        for i in range(len(flat) - n + 1):
            if flat[i:i + n] == sequence:
                return d, i
    return None


def test_next_sentence_pairs(documents, vocab):
    config = be.BertExampleConfig(short_seq_prob=0.0)
    rng = np.random.default_rng(5)
    instances = [inst for i in range(80)
                 for inst in be.create_instances_from_document(documents, i, config, vocab, rng)]
    labels = np.array([inst.is_random_next for inst in instances])
    assert 0.4 < labels.mean() < 0.75  # 50% random, plus single-sentence chunks (always random)
    checked = 0
    for inst in instances:
        tokens = inst.tokens.tolist()
        sep = tokens.index(SEP)
        a, b = tokens[1:sep], tokens[sep + 1:-1]
        assert tokens[0] == CLS and tokens[-1] == SEP and len(tokens) <= 128
        assert inst.segment_ids.tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1)
        assert a and b
        if not inst.is_random_next and checked < 40:
            # The pair is real text: A then B, contiguous, up to truncation at the ends.
            a_at, b_at = locate(a, documents), locate(b, documents)
            assert a_at is not None and b_at is not None and a_at[0] == b_at[0]
            assert b_at[1] >= a_at[1] + len(a)
            checked += 1
    assert checked == 40


def test_bulk_pairs_are_real_text(documents, vocab):
    """`bert_batches`' rows are [CLS] A [SEP] B [SEP] with BERT's segment ids, padded; A and B
    are contiguous text of the documents, B after A in A's document when not random."""
    config, rows = build(documents[:80], vocab, bulk_examples, dynamic_masking=True,
                         short_seq_prob=0.0)
    labels = np.array([row["next_sentence_labels"] for row in rows])
    assert 0.4 < labels.mean() < 0.75
    checked = {0: 0, 1: 0}
    for row in rows:
        length = int(row["input_mask"].sum())
        assert row["input_mask"].tolist() == [1] * length + [0] * (128 - length)
        tokens = row["input_ids"][:length].tolist()
        assert (row["input_ids"][length:] == PAD).all()
        sep = tokens.index(SEP)
        a, b = tokens[1:sep], tokens[sep + 1:-1]
        assert tokens[0] == CLS and tokens[-1] == SEP and a and b
        assert row["segment_ids"].tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1) + [0] * (
            128 - length)
        label = int(row["next_sentence_labels"])
        if checked[label] < 30:
            a_at, b_at = locate(a, documents[:80]), locate(b, documents[:80])
            assert a_at is not None and b_at is not None
            if not label:
                assert a_at[0] == b_at[0] and b_at[1] >= a_at[1] + len(a)
            checked[label] += 1
    assert checked == {0: 30, 1: 30}


def pair_statistics(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    stacked = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
    length = stacked["input_mask"].sum(1)
    chosen = stacked["masked_lm_weights"] > 0
    return {"length": length, "length_a": length - stacked["segment_ids"].sum(1) - 2,
            "random_next": stacked["next_sentence_labels"],
            "masked": chosen.sum(1),
            "position": (stacked["masked_lm_positions"] / length[:, None])[chosen]}


def test_bulk_records_have_the_one_by_one_distribution(documents, vocab):
    """The bulk builder draws in another order, so its records differ from the one-by-one
    builder's for a seed, but not in distribution: two-sample Kolmogorov-Smirnov tests of pair
    length, A's length, masked count and masked position, and the share of random B, on ~11k
    pairs each. A negative control (other short_seq_prob) shows the tests see a small change."""
    from scipy import stats

    settings = {"dupe_factor": 20, "max_predictions_per_seq": 20}
    _, reference = build(documents, vocab, be.create_training_examples, **settings)
    _, bulk = build(documents, vocab, bulk_examples, seed=11, **settings)
    _, changed = build(documents, vocab, be.create_training_examples, seed=12,
                       **{**settings, "short_seq_prob": 0.2})
    expected, same, other = map(pair_statistics, (reference, bulk, changed))
    assert 0.97 < len(bulk) / len(reference) < 1.03
    for key in ("length", "length_a", "masked", "position"):
        assert stats.ks_2samp(expected[key], same[key]).pvalue > 0.001, key
    share = expected["random_next"].mean()
    spread = np.sqrt(share * (1 - share) * (1 / len(bulk) + 1 / len(reference)))
    assert abs(same["random_next"].mean() - share) < 4 * spread
    assert stats.ks_2samp(expected["length"], other["length"]).pvalue < 1e-6


def test_truncated_lengths_are_the_reference_loops():
    """How many tokens `truncate_seq_pair`'s one-at-a-time loop (the reference's) removes from
    each side, for every pair of lengths up to 60 and three limits."""
    for limit in (1, 25, 61):
        length_a, length_b = np.meshgrid(np.arange(1, 61), np.arange(1, 61))
        from_a, from_b = be.truncated_lengths(length_a.ravel(), length_b.ravel(), limit)
        for la, lb, ra, rb in zip(length_a.ravel(), length_b.ravel(), from_a, from_b,
                                  strict=True):
            a, b = la, lb
            while a + b > limit:
                if a > b:
                    a -= 1
                else:
                    b -= 1
            assert (ra, rb) == (la - a, lb - b), (la, lb, limit)


def test_tokens_with_special_ids_are_never_masked(vocab, builder):
    """Text tokens that are [CLS], [SEP] or [PAD] ids are not candidates (the reference skips
    [CLS] and [SEP] by value)."""
    rng = np.random.default_rng(2)
    documents = [[np.where(rng.random(30) < 0.3, rng.choice([CLS, SEP, PAD], 30),
                           rng.integers(5, VOCAB_SIZE, 30)).tolist() for _ in range(6)]
                 for _ in range(40)]
    _, rows = build(documents, vocab, builder, dupe_factor=3)
    hits = 0
    for row in rows:
        count = int(row["masked_lm_weights"].sum())
        assert not np.isin(row["masked_lm_ids"][:count], [CLS, SEP, PAD]).any()
        hits += count
    assert hits > 1000


def test_bert_records_are_built_in_bulk_unless_whole_words_are_masked(documents, vocab):
    config = be.BertExampleConfig(dupe_factor=1)
    bulk = list(be.bert_training_examples(documents, vocab, config, 0))
    assert bulk and all(isinstance(batch, be.ExampleBatch) for batch in bulk)
    whole_words = dataclasses.replace(config, whole_word_mask=True)
    assert all(isinstance(row, dict) for row in be.bert_training_examples(
        documents, vocab, whole_words, 0))


def test_short_sequences_at_short_seq_prob(documents, vocab, builder):
    long_docs = [[s for doc in documents[i:i + 10] for s in doc] for i in range(0, 250, 10)]
    _, plain = build(long_docs, vocab, builder, short_seq_prob=0.0)
    _, short = build(long_docs, vocab, builder, short_seq_prob=0.5)
    fill = [ex["input_mask"].sum() / 128 for ex in plain]
    short_fill = [ex["input_mask"].sum() / 128 for ex in short]
    assert np.mean(fill) > 0.9
    assert np.mean(short_fill) < np.mean(fill) - 0.1


def test_truncation_trims_the_longer_side_from_both_ends():
    rng = np.random.default_rng(0)
    fronts = backs = 0
    for _ in range(200):
        a, b = list(range(100, 160)), list(range(200, 210))
        be.truncate_seq_pair(a, b, 40, rng)
        assert len(a) + len(b) == 40 and b == list(range(200, 210))
        fronts += a[0] != 100
        backs += a[-1] != 159
    assert fronts > 150 and backs > 150


def test_static_dupes_and_determinism(documents, vocab, builder):
    _, once = build(documents, vocab, builder)
    _, again = build(documents, vocab, builder)
    _, other = build(documents, vocab, builder, seed=4)
    _, three = build(documents, vocab, builder, dupe_factor=3)
    for key in once[0]:
        assert all(np.array_equal(x[key], y[key]) for x, y in zip(once, again, strict=True))
    assert not all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(once, other,
                                                                                 strict=False))
    assert 2.5 * len(once) < len(three) < 3.5 * len(once)


def test_dynamic_masking(documents, vocab, builder):
    config, records = build(documents, vocab, builder, dynamic_masking=True, dupe_factor=5)
    static_config, static = build(documents, vocab, builder)
    assert set(records[0]) == {"input_ids", "input_mask", "segment_ids", "next_sentence_labels"}
    assert len(records) < 1.5 * len(static)  # dupe_factor does not apply
    masking = be.DynamicMasking(vocab, config)
    original = {key: value.copy() for key, value in records[0].items()}
    first = masking.random_map(records[0], np.random.default_rng(1))
    same = masking.random_map(records[0], np.random.default_rng(1))
    other = masking.random_map(records[0], np.random.default_rng(2))
    assert set(first) == set(static[0])
    for key in first:
        assert first[key].shape == static[0][key].shape
        assert first[key].dtype == static[0][key].dtype
        np.testing.assert_array_equal(first[key], same[key])
    assert not np.array_equal(first["masked_lm_positions"], other["masked_lm_positions"])
    assert set(records[0]) == set(original)  # the record is not mutated
    for key, value in original.items():
        np.testing.assert_array_equal(records[0][key], value, err_msg=key)


def test_majority_baseline():
    examples = {"masked_lm_ids": np.array([[7, 7, 3], [7, 2, 0]]),
                "masked_lm_weights": np.array([[1, 1, 1], [1, 1, 0]], np.float32)}
    assert be.majority_baseline_accuracy(examples) == pytest.approx(3 / 5)


@pytest.mark.parametrize("field,value", [("max_seq_length", 4), ("masked_lm_prob", 0.0),
                                         ("masked_lm_prob", 1.5), ("short_seq_prob", -0.1),
                                         ("dupe_factor", 0)])
def test_config_validation(field, value):
    with pytest.raises(UserError, match=field):
        dataclasses.replace(be.BertExampleConfig(), **{field: value})
