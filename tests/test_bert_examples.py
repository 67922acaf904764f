"""BERT example building as create_pretraining_data.py: masking statistics, whole-word groups,
NSP pairs, truncation, static vs dynamic masking."""

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


def build(documents, vocab, **overrides):
    config = be.BertExampleConfig(**{"dupe_factor": 1, **overrides})
    return config, list(be.create_training_examples(documents, vocab, config, seed=3))


def test_masking_statistics(documents, vocab):
    config, examples = build(documents, vocab, max_predictions_per_seq=200, dupe_factor=2)
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


def test_overall_rate_and_max_predictions(documents, vocab):
    _, examples = build(documents, vocab, max_predictions_per_seq=200)
    weights = sum(ex["masked_lm_weights"].sum() for ex in examples)
    tokens = sum(ex["input_mask"].sum() for ex in examples)
    assert weights / tokens == pytest.approx(0.15, abs=0.01)
    _, capped = build(documents, vocab, max_predictions_per_seq=4)
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


def test_short_sequences_at_short_seq_prob(documents, vocab):
    long_docs = [[s for doc in documents[i:i + 10] for s in doc] for i in range(0, 250, 10)]
    _, plain = build(long_docs, vocab, short_seq_prob=0.0)
    _, short = build(long_docs, vocab, short_seq_prob=0.5)
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


def test_static_dupes_and_determinism(documents, vocab):
    _, once = build(documents, vocab)
    _, again = build(documents, vocab)
    _, three = build(documents, vocab, dupe_factor=3)
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(once, again,
                                                                             strict=True))
    assert 2.5 * len(once) < len(three) < 3.5 * len(once)


def test_dynamic_masking(documents, vocab):
    config, records = build(documents, vocab, dynamic_masking=True, dupe_factor=5)
    static_config, static = build(documents, vocab)
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
