"""BERT example building as create_pretraining_data.py: masking statistics, whole-word groups,
NSP pairs, truncation, short sequences, static vs dynamic masking, feature layout."""

from __future__ import annotations

import dataclasses
import types

import grain
import numpy as np
import pytest

from input_pipeline import bert_examples as be
from input_pipeline.errors import UserError

VOCAB_SIZE = 1000
PAD, UNK, CLS, SEP, MASK = range(5)
SPECIALS = [PAD, CLS, SEP]


@pytest.fixture(scope="module")
def vocab() -> be.MaskingVocab:
    continuation = np.random.default_rng(0).random(VOCAB_SIZE) < 0.3
    continuation[:5] = False
    return be.MaskingVocab(VOCAB_SIZE, PAD, CLS, SEP, MASK, continuation)


def make_documents(seed: int, count: int, sentences: tuple[int, int]) -> list[list[list[int]]]:
    """`count` documents of random sentences (3..40 word ids >= 5) per document."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(5, VOCAB_SIZE, rng.integers(3, 41)).tolist()
             for _ in range(rng.integers(*sentences))] for _ in range(count)]


@pytest.fixture(scope="module")
def documents() -> list[list[list[int]]]:
    return make_documents(1, 250, (1, 12))


def build(documents, vocab, seed=3, **overrides):
    config = be.BertExampleConfig(**{"dupe_factor": 1, **overrides})
    return config, list(be.create_training_examples(documents, vocab, config, seed))


def unmasked_pairs(documents, vocab, rng, indices, **overrides):
    """(document index, unmasked Instance) for the documents at `indices`."""
    config = be.BertExampleConfig(dynamic_masking=True, **overrides)
    return [(i, inst) for i in indices
            for inst in be.create_instances_from_document(documents, i, vocab, config, rng)]


def num_to_predict(length: int, max_predictions: int) -> int:
    return min(max_predictions, max(1, int(round(length * 0.15))))


def test_masking_statistics(documents, vocab):
    rng = np.random.default_rng(0)
    config = be.BertExampleConfig(max_predictions_per_seq=200)
    shown_all, original_all, total_tokens = [], [], 0
    for _, inst in unmasked_pairs(documents, vocab, rng, range(len(documents))):
        tokens = inst.tokens
        output, positions, labels = be.mask_tokens(tokens, vocab, config, rng)
        assert len(positions) == num_to_predict(len(tokens), 200)
        assert np.all(np.diff(positions) > 0) and 0 < positions[0] and positions[-1] < len(tokens)
        np.testing.assert_array_equal(labels, tokens[positions])
        assert not np.isin(labels, SPECIALS).any()
        untouched = np.ones(len(tokens), bool)
        untouched[positions] = False
        np.testing.assert_array_equal(output[untouched], tokens[untouched])
        shown_all.append(output[positions])
        original_all.append(labels)
        total_tokens += len(tokens)
    shown, original = np.concatenate(shown_all), np.concatenate(original_all)
    assert len(shown) > 5000
    assert len(shown) / total_tokens == pytest.approx(0.15, abs=0.005)
    masked = np.mean(shown == MASK)
    kept = np.mean(shown == original)  # 10% kept, plus random draws of the original id (1/V)
    random = np.mean((shown != MASK) & (shown != original))
    assert masked == pytest.approx(0.8, abs=0.02)
    assert kept == pytest.approx(0.1 + 0.1 / VOCAB_SIZE, abs=0.015)
    assert random == pytest.approx(0.1 - 0.1 / VOCAB_SIZE, abs=0.015)
    assert shown[shown != MASK].max() > 900  # random ids span the vocabulary


def test_random_replacements_cover_the_whole_vocabulary():
    """As the reference (all vocab words), random ids include special ones."""
    vocab = be.MaskingVocab(8, PAD, CLS, SEP, MASK, np.zeros(8, bool))
    config = be.BertExampleConfig(max_predictions_per_seq=100, masked_lm_prob=0.9)
    tokens = np.array([CLS] + [7] * 50 + [SEP], np.int32)
    rng = np.random.default_rng(0)
    shown = np.concatenate([be.mask_tokens(tokens, vocab, config, rng)[0] for _ in range(100)])
    random = shown[(shown != MASK) & (shown != 7) & (np.arange(len(shown)) % 52 != 0)
                   & (np.arange(len(shown)) % 52 != 51)]
    assert set(random.tolist()) == {0, 1, 2, 3, 5, 6}  # MASK and 7 are filtered out above
    assert np.bincount(random, minlength=8)[[0, 1, 2, 3, 5, 6]].min() > 50


def test_max_predictions_and_special_tokens(documents, vocab):
    rng = np.random.default_rng(1)
    config = be.BertExampleConfig(max_predictions_per_seq=4)
    for _, inst in unmasked_pairs(documents, vocab, rng, range(60)):
        _, positions, _ = be.mask_tokens(inst.tokens, vocab, config, rng)
        assert len(positions) == num_to_predict(len(inst.tokens), 4)
    padded = np.array([CLS, 9, SEP, 10, SEP, PAD, PAD, PAD], np.int32)
    for _ in range(50):
        _, positions, _ = be.mask_tokens(padded, vocab, config, rng)
        assert set(positions.tolist()) <= {1, 3}


def incomplete_words(tokens, positions, vocab) -> int:
    """Masked pieces whose word (first piece plus following continuation pieces) is partly
    unmasked."""
    masked = set(positions.tolist())
    bad = 0
    for p in masked:
        word_piece = tokens[p - 1] not in SPECIALS
        bad += vocab.continuation[tokens[p]] and word_piece and p - 1 not in masked
        bad += p + 1 < len(tokens) and vocab.continuation[tokens[p + 1]] and p + 1 not in masked
    return bad


def test_whole_word_masking_keeps_words_together(documents, vocab):
    rng = np.random.default_rng(2)
    whole = be.BertExampleConfig(whole_word_mask=True, max_predictions_per_seq=30)
    pieces = dataclasses.replace(whole, whole_word_mask=False)
    shortfall = piece_violations = 0
    for _, inst in unmasked_pairs(documents, vocab, rng, range(120)):
        _, positions, labels = be.mask_tokens(inst.tokens, vocab, whole, rng)
        target = num_to_predict(len(inst.tokens), 30)
        assert len(positions) <= target
        np.testing.assert_array_equal(labels, inst.tokens[positions])
        assert incomplete_words(inst.tokens, positions, vocab) == 0
        shortfall += target - len(positions)
        piece_violations += incomplete_words(
            inst.tokens, be.mask_tokens(inst.tokens, vocab, pieces, rng)[1], vocab)
    assert piece_violations > 100  # the check does catch per-piece masking
    assert shortfall > 0  # groups that would overshoot are skipped, as the reference


def find(sequence: np.ndarray, flat: np.ndarray) -> int:
    """Offset of `sequence` as a contiguous run in `flat`, else -1."""
    haystack, needle = flat.astype(np.int32).tobytes(), sequence.astype(np.int32).tobytes()
    at = haystack.find(needle)
    while at % 4:
        at = haystack.find(needle, at + 1)
    return at // 4 if at >= 0 else -1


def flatten(document) -> tuple[np.ndarray, set[int]]:
    """A document's tokens and its sentence boundaries (offsets)."""
    lengths = np.cumsum([0] + [len(s) for s in document])
    return np.concatenate(document), set(lengths.tolist())


def split_pair(instance: be.Instance) -> tuple[np.ndarray, np.ndarray]:
    tokens = instance.tokens
    sep = int(np.flatnonzero(tokens == SEP)[0])
    return tokens[1:sep], tokens[sep + 1:-1]


def test_next_sentence_pairs(documents, vocab):
    rng = np.random.default_rng(5)
    flats = [flatten(doc) for doc in documents]
    pairs = unmasked_pairs(documents, vocab, rng, range(150))
    labels = np.array([inst.is_random_next for _, inst in pairs])
    assert 0.5 < labels.mean() < 0.7  # 50%, plus single-sentence chunks (always random)
    exact = 0
    for source, inst in pairs:
        a, b = split_pair(inst)
        assert len(a) >= 1 and len(b) >= 1 and len(inst.tokens) <= 128
        assert inst.tokens[0] == CLS and inst.tokens[-1] == SEP and np.sum(inst.tokens == SEP) == 2
        np.testing.assert_array_equal(inst.segment_ids, [0] * (len(a) + 2) + [1] * (len(b) + 1))
        flat, bounds = flats[source]
        a_at = find(a, flat)
        assert a_at >= 0
        untruncated = len(a) + len(b) < 125
        if inst.is_random_next:
            assert find(b, flat) < 0
            b_doc = next(d for d, (f, _) in enumerate(flats) if find(b, f) >= 0)
            b_at, b_bounds = find(b, flats[b_doc][0]), flats[b_doc][1]
            if untruncated:  # whole sentences from a random start
                assert b_at in b_bounds and b_at + len(b) in b_bounds
        else:
            b_at = find(b, flat)
            # B continues A in the same document, across a sentence boundary.
            assert any(a_at + len(a) <= k <= b_at for k in bounds)
            if untruncated:
                assert b_at == a_at + len(a) and a_at in bounds and b_at + len(b) in bounds
                exact += 1
    assert exact > 30


def test_unused_sentences_are_put_back(documents, vocab):
    """Without truncation, the A parts (and real B parts) of a document's pairs, in order,
    are exactly the document: the sentences after A in a random-next chunk are reused."""
    small = [doc for doc in documents if sum(map(len, doc)) <= 250]
    rng = np.random.default_rng(6)
    pairs = unmasked_pairs(small, vocab, rng, range(len(small)), max_seq_length=512,
                           short_seq_prob=0.0)
    random_with_leftovers = 0
    for index, doc in enumerate(small):
        parts = []
        for source, inst in pairs:
            if source == index:
                a, b = split_pair(inst)
                parts += [a] if inst.is_random_next else [a, b]
                random_with_leftovers += inst.is_random_next and len(a) < sum(map(len, doc))
        np.testing.assert_array_equal(np.concatenate(parts), np.concatenate(doc))
    assert random_with_leftovers > 20


def test_short_sequences_at_short_seq_prob(vocab):
    """One-token sentences make a pair exactly as long as its target: the longest pair of a
    document shows whether the document drew a short target (uniform in [2, 125])."""
    documents = [[[5 + (i % 900)] for i in range(600)] for _ in range(300)]
    for prob in (0.0, 0.3):
        rng = np.random.default_rng(7)
        longest = np.zeros(len(documents), int)
        for source, inst in unmasked_pairs(documents, vocab, rng, range(len(documents)),
                                           short_seq_prob=prob):
            longest[source] = max(longest[source], len(inst.tokens) - 3)
        short = longest[longest < 125]
        assert len(short) / len(documents) == pytest.approx(prob * 123 / 124, abs=0.07)
    assert short.min() < 10 and short.mean() == pytest.approx(63, abs=12)


def test_truncation_trims_the_longer_side_from_both_ends():
    rng = np.random.default_rng(0)
    a_full, b_full = np.arange(100, 160), np.arange(200, 250)
    ends = np.zeros(4)
    for _ in range(200):
        a, b = be.truncate_seq_pair(a_full, b_full, 40, rng)
        assert len(a) == len(b) == 20
        assert find(a, a_full) >= 0 and find(b, b_full) >= 0  # contiguous runs
        ends += [a[0] != 100, a[-1] != 159, b[0] != 200, b[-1] != 249]
    assert np.all(ends > 150)
    a, b = be.truncate_seq_pair(a_full, b_full[:10], 40, rng)
    assert len(a) == 30 and np.array_equal(b, b_full[:10])
    a, b = be.truncate_seq_pair(a_full[:1], b_full, 2, rng)
    assert len(a) == 1 and len(b) == 1


def originals(example):
    count = int(example["masked_lm_weights"].sum())
    tokens = example["input_ids"].copy()
    tokens[example["masked_lm_positions"][:count]] = example["masked_lm_ids"][:count]
    return tokens, example["masked_lm_positions"][:count]


def test_feature_layout(documents, vocab):
    _, examples = build(documents[:40], vocab, max_seq_length=64, max_predictions_per_seq=8)
    shapes = {"input_ids": (64,), "input_mask": (64,), "segment_ids": (64,),
              "masked_lm_positions": (8,), "masked_lm_ids": (8,), "masked_lm_weights": (8,),
              "next_sentence_labels": ()}
    for ex in examples:
        assert {k: v.shape for k, v in ex.items()} == shapes
        assert ex["masked_lm_weights"].dtype == np.float32
        assert all(v.dtype == np.int32 for k, v in ex.items() if k != "masked_lm_weights")
        length, count = int(ex["input_mask"].sum()), int(ex["masked_lm_weights"].sum())
        assert np.all(ex["input_mask"][:length] == 1) and np.all(ex["input_ids"][length:] == PAD)
        assert np.all(ex["segment_ids"][length:] == 0) and ex["segment_ids"][length - 1] == 1
        assert count == num_to_predict(length, 8)
        assert not ex["masked_lm_weights"][count:].any()
        assert not ex["masked_lm_positions"][count:].any() and not ex["masked_lm_ids"][count:].any()
        assert originals(ex)[0][0] == CLS and ex["next_sentence_labels"] in (0, 1)


def test_static_dupes_and_determinism(documents, vocab):
    _, once = build(documents, vocab)
    _, again = build(documents, vocab)
    _, other_seed = build(documents, vocab, seed=4)
    _, three = build(documents, vocab, dupe_factor=3)
    for x, y in zip(once, again, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    assert not all(np.array_equal(x["input_ids"], y["input_ids"])
                   for x, y in zip(once, other_seed, strict=False))
    assert 2.7 * len(once) < len(three) < 3.3 * len(once)
    # The same pair recurs across dupes, with a fresh mask each time.
    seen: dict[bytes, list[np.ndarray]] = {}
    for ex in three:
        tokens, positions = originals(ex)
        seen.setdefault(tokens.tobytes(), []).append(positions)
    repeats = [p for p in seen.values() if len(p) > 1]
    assert len(repeats) > 50
    same = np.mean([np.array_equal(p[0], p[1]) for p in repeats])
    assert same < 0.1


def test_dynamic_masking(documents, vocab):
    config, records = build(documents, vocab, dynamic_masking=True, dupe_factor=5)
    _, static = build(documents, vocab)
    assert set(records[0]) == {"input_ids", "input_mask", "segment_ids", "next_sentence_labels"}
    assert abs(len(records) - len(static)) < 0.1 * len(static)  # dupe_factor does not apply
    masking = be.DynamicMasking(vocab, config)
    record = {k: v.copy() for k, v in records[0].items()}
    for value in record.values():
        value.flags.writeable = False  # as decoded from ArrayRecord
    first = masking.random_map(record, np.random.default_rng(1))
    same = masking.random_map(record, np.random.default_rng(1))
    other = masking.random_map(record, np.random.default_rng(2))
    for key in static[0]:
        assert first[key].shape == static[0][key].shape
        assert first[key].dtype == static[0][key].dtype
        np.testing.assert_array_equal(first[key], same[key])
    for key in record:
        np.testing.assert_array_equal(record[key], records[0][key])
    assert not np.array_equal(first["masked_lm_positions"], other["masked_lm_positions"])
    np.testing.assert_array_equal(originals(first)[0], record["input_ids"])
    length = int(record["input_mask"].sum())
    assert first["masked_lm_weights"].sum() == num_to_predict(length, 20)
    # Through Grain: fixed per (seed, index), new masks in the next epoch.
    dataset = grain.MapDataset.source(records[:20]).repeat(2).random_map(masking, seed=0)
    epoch_one = [dataset[i]["masked_lm_positions"] for i in range(20)]
    np.testing.assert_array_equal(epoch_one[0], dataset[0]["masked_lm_positions"])
    changed = [not np.array_equal(epoch_one[i], dataset[20 + i]["masked_lm_positions"])
               for i in range(20)]
    assert sum(changed) > 15


def test_majority_baseline(documents, vocab):
    examples = {"masked_lm_ids": np.array([[7, 7, 3], [7, 2, 0]]),
                "masked_lm_weights": np.array([[1, 1, 1], [1, 1, 0]], np.float32)}
    assert be.majority_baseline_accuracy(examples) == pytest.approx(3 / 5)
    _, built = build([[[9] * 20, [9] * 20]] * 4 + documents[:20], vocab)
    stacked = {k: np.stack([ex[k] for ex in built]) for k in built[0]}
    weights = stacked["masked_lm_weights"]
    expected = weights[stacked["masked_lm_ids"] == 9].sum() / weights.sum()
    assert be.majority_baseline_accuracy(stacked) == pytest.approx(expected)
    assert be.majority_baseline_accuracy(stacked) > 0.1


def test_from_tokenizer():
    tokenizer = types.SimpleNamespace(vocab_size=6, pad_id=0, cls_id=2, sep_id=3, mask_id=4,
                                      continuation=[False, False, False, False, False, True])
    vocab = be.MaskingVocab.from_tokenizer(tokenizer)
    assert (vocab.vocab_size, vocab.cls_id, vocab.mask_id) == (6, 2, 4)
    assert vocab.continuation.dtype == bool and vocab.continuation[5]
    with pytest.raises(UserError, match="continuation"):
        be.MaskingVocab(7, 0, 2, 3, 4, vocab.continuation)


@pytest.mark.parametrize("field,value", [("max_seq_length", 4), ("masked_lm_prob", 0.0),
                                         ("masked_lm_prob", 1.5), ("short_seq_prob", -0.1),
                                         ("dupe_factor", 0), ("max_predictions_per_seq", 0)])
def test_config_validation(field, value):
    with pytest.raises(UserError, match=field):
        dataclasses.replace(be.BertExampleConfig(), **{field: value})
