"""XLM's data (input_pipeline/examples/xlm.py, Lample & Conneau 2019 §3.1-3.3): language
sampling q ~ p^0.5, 256-token streams, MLM positions drawn by sqrt(1/frequency) with 80/10/10,
TLM pairs with positions reset and per-half language ids, determinism per seed, a small build
on the real Multi30K with a shared vocabulary, and one-line errors."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import MaskingVocab
from pretext_jax.input_pipeline.examples.xlm import (
    LineSplit,
    StepSchedule,
    XLMExampleConfig,
    XLMMasking,
    language_ids,
    language_probabilities,
    mask_weights,
    parallel_sentences,
    parse_corpora,
    prepare_streams,
    prepare_tlm,
    sentence_stream,
    stream_examples,
    stream_statistics,
    tlm_examples,
    tlm_record,
    tokenizer_sample,
    train_shared_tokenizer,
    weighted_mask,
)
from pretext_jax.input_pipeline.parallel import open_parallel
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.input_pipeline.records import RecordDirectory, make_loader, write_records

VOCAB = MaskingVocab(vocab_size=1000, pad_id=0, cls_id=2, sep_id=3, mask_id=4,
                     continuation=np.zeros(1000, bool))
EOS, PAD = VOCAB.sep_id, VOCAB.pad_id


class WordTokenizer:
    """Whitespace words -> their integer value (test sentences are written as numbers)."""

    eos_id, pad_id, vocab_size = EOS, PAD, 1000

    def encode(self, text: str) -> list[int]:
        return [int(word) for word in text.split()]

    def save(self, directory: Path) -> None:
        (directory / "words.txt").write_text("whitespace words as integers\n")


def within(observed: np.ndarray, expected: np.ndarray, trials: int, sigmas: float = 4.5) -> None:
    """Observed frequencies within `sigmas` binomial standard deviations of the expected."""
    std = np.sqrt(expected * (1 - expected) / trials)
    assert np.all(np.abs(observed - expected) <= sigmas * std + 1e-12), (observed, expected)


def test_language_probabilities_are_p_to_the_half_normalised():
    counts = {"en": 9000, "de": 900, "fr": 100}
    p = np.array([9000, 900, 100]) / 10000
    expected = np.sqrt(p) / np.sqrt(p).sum()
    np.testing.assert_allclose(language_probabilities(counts, 0.5), expected, rtol=1e-12)
    np.testing.assert_allclose(language_probabilities(counts, 1.0), p, rtol=1e-12)
    # The tokenizer's sample: sentences per language ~ Multinomial(size, q).
    corpora = {lang: (lambda n=n, lang=lang: (f"{lang} {i}" for i in range(n)))
               for lang, n in counts.items()}
    sample = list(tokenizer_sample(corpora, 8000, 0.5, seed=1))
    assert len(sample) == 8000 and sample == list(tokenizer_sample(corpora, 8000, 0.5, seed=1))
    observed = np.array([sum(s.startswith(lang) for s in sample) for lang in counts]) / 8000
    within(observed, expected, 8000)
    assert len(set(s for s in sample if s.startswith("fr"))) > 80  # uniform within a language


def stream_records(tmp_path: Path, language: int, pieces: int, name: str) -> RecordDirectory:
    config = XLMExampleConfig(stream_length=8, max_sentence_length=2)
    documents = [[[10 + language] * 7] for _ in range(pieces)]  # 7 tokens + eos = one piece
    write_records(stream_examples(documents, WordTokenizer(), 0, language_id=language,
                                  config=config), tmp_path / name, num_shards=1)
    return RecordDirectory(tmp_path / name)


def pair_records(tmp_path: Path, first: int, second: int, count: int, name: str
                 ) -> RecordDirectory:
    """TLM records of one direction: line i is (100 + i) in `first`, (200 + i) in `second`."""
    config = XLMExampleConfig(stream_length=8, max_sentence_length=2)
    write_records((tlm_record([100 + i], [200 + i], first, second, config, EOS, PAD)
                   for i in range(count)), tmp_path / name, num_shards=1)
    return RecordDirectory(tmp_path / name)


def schedule_sets(tmp_path: Path) -> tuple[dict, np.ndarray, dict, np.ndarray]:
    """Three languages (streams of 5, 50 and 20 pieces) and two TLM directions (30 and 10
    pairs), with their sampling probabilities."""
    mono = {"de": stream_records(tmp_path, 0, 5, "de"), "en": stream_records(tmp_path, 1, 50, "en"),
            "fr": stream_records(tmp_path, 2, 20, "fr")}
    pairs = {"de-en": pair_records(tmp_path, 0, 1, 30, "de-en"),
             "en-fr": pair_records(tmp_path, 1, 2, 10, "en-fr")}
    return (mono, language_probabilities({"de": 5, "en": 50, "fr": 20}, 0.5),
            pairs, language_probabilities({"de-en": 30, "en-fr": 10}, 0.5))


def test_step_schedule_alternates_languages_and_pairs_as_shuf_order(tmp_path):
    mono, q_mono, pairs, q_pairs = schedule_sets(tmp_path)
    schedule = StepSchedule(mono, q_mono, pairs, q_pairs, seed=3, batch_size=8)
    # A cycle is min(5, 3) = 3 monolingual steps, then min(5, 2) = 2 pair steps (shuf_order).
    assert schedule.cycle_steps == 5 and schedule.names == ("de", "en", "fr", "de-en", "en-fr")
    steps = np.array([schedule.step_set(step) for step in range(5 * 2000)]).reshape(2000, 5)
    assert (steps[:, :3] < 3).all() and (steps[:, 3:] >= 3).all()
    # Languages are drawn with replacement by q ~ p^0.5, pairs by q over their pair counts.
    within(np.bincount(steps[:, :3].ravel(), minlength=3) / 6000, q_mono, 6000)
    within(np.bincount(steps[:, 3:].ravel() - 3, minlength=2) / 4000, q_pairs, 4000)
    assert len({tuple(row) for row in steps[:, :3]}) > 10  # not one fixed order
    # Every step's 8 records come from its set: one language, or one direction of pairs.
    for step in range(40):
        chosen = [schedule.choose(step * 8 + row) for row in range(8)]
        assert {which for which, _ in chosen} == {schedule.step_set(step)}
        rows = [schedule.records[which].spec.decode(schedule[step * 8 + row])
                for row, (which, _) in enumerate(chosen)]
        name = schedule.names[schedule.step_set(step)]
        languages = {tuple(np.unique(r["langs"][r["input_mask"] > 0]).tolist()) for r in rows}
        assert languages == {tuple(sorted({"de": 0, "en": 1, "fr": 2}[part]
                                          for part in name.split("-")))}
    # Rows are uniform over the set, with replacement; all is a function of (seed, batch, key).
    picks = [schedule.choose(k)[1] for k in range(8 * 400) if schedule.choose(k)[0] == 1]
    assert len(set(picks)) == 50
    again = StepSchedule(mono, q_mono, pairs, q_pairs, seed=3).for_global_batch(8)
    assert [again.choose(k) for k in range(300)] == [schedule.choose(k) for k in range(300)]
    other = StepSchedule(mono, q_mono, pairs, q_pairs, seed=4, batch_size=8)
    assert [other.choose(k) for k in range(300)] != [schedule.choose(k) for k in range(300)]
    # Only languages (MLM / CLM) or only pairs (TLM): cycles of min(5, count) steps.
    assert StepSchedule(mono, q_mono, {}, [], 0).cycle_steps == 3
    assert StepSchedule({}, [], pairs, q_pairs, 0).cycle_steps == 2


def test_step_schedule_loads_one_set_per_batch_and_resumes_exactly(tmp_path):
    mono, q_mono, pairs, q_pairs = schedule_sets(tmp_path)
    schedule = StepSchedule(mono, q_mono, pairs, q_pairs, seed=1).for_global_batch(4)
    config = XLMExampleConfig(stream_length=8, max_sentence_length=2, max_predictions_per_seq=2)
    weights = mask_weights(np.ones(1000, np.int64), 0.5, VOCAB)

    def loader():
        return iter(make_loader(schedule, batch_size=4, seed=0, shuffle=False,
                                transforms=[XLMMasking(VOCAB, weights, config)]))

    iterator = loader()
    batches = [next(iterator) for _ in range(6)]
    for step, batch in enumerate(batches):
        expected = schedule.records[schedule.step_set(step)].examples(
            [schedule.choose(step * 4 + row)[1] for row in range(4)])
        np.testing.assert_array_equal(batch["langs"], expected["langs"])
        np.testing.assert_array_equal(batch["positions"], expected["positions"])
    state = iterator.get_state()
    following = [next(iterator) for _ in range(4)]
    resumed = loader()
    resumed.set_state(state)
    for a, b in zip(following, [next(resumed) for _ in range(4)], strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_stream_pieces_are_256_tokens_and_concatenate_back_to_the_stream():
    rng = np.random.default_rng(0)
    documents = [[list(rng.integers(5, 1000, rng.integers(1, 60))) for _ in range(20)]
                 for _ in range(5)]
    stream = sentence_stream(documents, EOS)
    sentences = [s for d in documents for s in d]
    assert len(stream) == sum(len(s) + 1 for s in sentences) and (stream == EOS).sum() == 100
    assert stream[len(sentences[0])] == EOS and list(stream[:len(sentences[0])]) == sentences[0]
    rows = list(stream_examples(documents, WordTokenizer(), 0, language_id=2,
                                config=XLMExampleConfig()))
    assert len(rows) == math.ceil(len(stream) / 256)
    assert all(len(r["input_ids"]) == 256 for r in rows)
    assert all(r["input_mask"].all() for r in rows[:-1]) and not rows[-1]["input_mask"].all()
    joined = np.concatenate([r["input_ids"][r["input_mask"] > 0] for r in rows])
    np.testing.assert_array_equal(joined, stream)
    assert all((r["langs"][r["input_mask"] > 0] == 2).all() for r in rows)
    np.testing.assert_array_equal(rows[0]["positions"], np.arange(256))


def inclusion_probabilities(weights: np.ndarray, draws: int) -> np.ndarray:
    """Exact P(position chosen) for `draws` successive draws without replacement, each with
    probability proportional to the weights of the positions not yet drawn."""
    result = np.zeros(len(weights))
    for order in itertools.permutations(range(len(weights)), draws):
        probability, left = 1.0, weights.sum()
        for position in order:
            probability *= weights[position] / left
            left -= weights[position]
        result[list(order)] += probability
    return result


def test_mlm_positions_follow_inverse_sqrt_frequency_and_80_10_10():
    counts = np.zeros(1000, np.int64)
    counts[10:30] = np.geomspace(1, 1e6, 20).astype(np.int64)  # 20 word ids
    weights = mask_weights(counts, 0.5, VOCAB)
    assert weights[[0, 2, 3, 4]].sum() == 0 and weights[31] == 0  # specials, unseen ids
    np.testing.assert_allclose(weights[10:30], counts[10:30] ** -0.5)
    tokens = np.array([EOS, *range(10, 30), EOS], np.int32)  # 22 tokens -> ceil(3.3) = 4
    config = XLMExampleConfig()
    rng = np.random.default_rng(0)
    trials = 6000
    chosen = np.zeros(len(tokens))
    outcome = np.zeros(3)  # [MASK], random id, kept
    for _ in range(trials):
        output, positions, labels = weighted_mask(tokens, weights, VOCAB, config, rng)
        assert len(positions) == 4 and (labels == tokens[positions]).all()
        assert (output[np.setdiff1d(np.arange(len(tokens)), positions)] ==
                np.delete(tokens, positions)).all()
        chosen[positions] += 1
        new = output[positions]
        outcome += [(new == VOCAB.mask_id).sum(), ((new != VOCAB.mask_id) & (new != labels)).sum(),
                    (new == labels).sum()]
    expected = np.zeros(len(tokens))
    expected[1:-1] = inclusion_probabilities(weights[tokens[1:-1]], 4)
    assert chosen[0] == chosen[-1] == 0
    within(chosen / trials, expected, trials)
    # A uniform choice (4/20 each) is far outside these tolerances: the check can fail.
    assert np.abs(expected[1:-1] - 0.2).max() > 10 * np.sqrt(0.16 / trials)
    within(outcome / outcome.sum(), np.array([0.8, 0.1 * 0.999, 0.1 + 0.1 * 0.001]),
           int(outcome.sum()))


def test_tlm_record_resets_positions_and_gives_each_half_its_language():
    config = XLMExampleConfig(stream_length=32, max_sentence_length=5)
    row = tlm_record([11, 12, 13], [21, 22], 0, 1, config, EOS, PAD)
    length = 5 + 4
    assert row["input_ids"][:length].tolist() == [EOS, 11, 12, 13, EOS, EOS, 21, 22, EOS]
    assert row["positions"][:length].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert row["langs"][:length].tolist() == [0] * 5 + [1] * 4
    assert row["input_mask"].tolist() == [1] * length + [0] * (32 - length)
    assert (row["input_ids"][length:] == PAD).all()
    lines = [{"en": "11 12", "de": "21"}, {"en": "11 12 13 14 15 16", "de": "21"},
             {"en": "", "de": "21"}]
    rows = list(tlm_examples(lines, ["en", "de"], WordTokenizer(), config, {"de": 0, "en": 1}))
    assert len(rows) == 2  # too long and empty pairs dropped, both directions kept
    assert rows[0]["langs"][:4].tolist() == [1] * 4 and rows[1]["langs"][:3].tolist() == [0] * 3
    # MLM masking reaches both halves, never the end-of-sentence tokens or padding.
    counts = np.ones(1000, np.int64)
    masking = XLMMasking(VOCAB, mask_weights(counts, 0.5, VOCAB), config)
    halves = np.zeros(2)
    rng = np.random.default_rng(0)
    long_row = tlm_record(range(11, 16), range(21, 26), 0, 1, config, EOS, PAD)
    for _ in range(200):
        out = masking.random_map(long_row, rng)
        positions = out["masked_lm_positions"][out["masked_lm_weights"] > 0]
        assert len(positions) == math.ceil(0.15 * 14)
        assert not np.isin(long_row["input_ids"][positions], [EOS, PAD]).any()
        halves += np.bincount(long_row["langs"][positions], minlength=2)
        np.testing.assert_array_equal(out["positions"], long_row["positions"])
    assert halves.min() > 100


def test_tlm_held_out_fraction_splits_aligned_lines_with_both_directions_on_one_side(tmp_path):
    # Line i: "i+100" in en, "i+500" in de, so a record names its line.
    for language, offset in (("en", 100), ("de", 500)):
        (tmp_path / f"p.{language}").write_text("".join(f"{i + offset}\n" for i in range(40)))
    spec = f"{tmp_path / 'p.en'},{tmp_path / 'p.de'}"
    config, ids = XLMExampleConfig(stream_length=16, max_sentence_length=4), {"de": 0, "en": 1}

    def lines(split: LineSplit) -> list[set[int]]:
        """The line numbers of each direction's records (de-en, en-de) of that side."""
        records = prepare_tlm(spec, WordTokenizer(), config, ids, tmp_path / "cache", split)
        rows = records.examples(range(len(records)))
        first = rows["input_ids"][:, 1]
        return [{int(t) - 100 if t < 500 else int(t) - 500 for t in first[rows["langs"][:, 0]
                                                                         == lang]}
                for lang in (0, 1)]

    train, held = lines(LineSplit(0.2, 3, False)), lines(LineSplit(0.2, 3, True))
    assert train[0] == train[1] and held[0] == held[1]  # both directions of a line, one side
    assert len(held[0]) == 8 and held[0] | train[0] == set(range(40)) and not held[0] & train[0]
    assert lines(LineSplit(0.2, 3, True)) == held and lines(LineSplit(0.2, 4, True)) != held
    # The tokenizer of a split corpus reads the training side's sentences only.
    sentences = parallel_sentences(open_parallel(spec), "de", LineSplit(0.2, 3, False))
    assert [int(s) - 500 for s in sentences] == sorted(train[0])


def test_record_caches_tell_tokenizers_apart_by_what_they_encode(tmp_path):
    """TLM's and Unicoder's record caches are keyed by the tokenizer's saved files: the same
    vocabulary cased and lowercased (same kind and size, other ids for "Cat") get other keys,
    so a run never reads records another tokenizer wrote; an equal tokenizer the same key."""
    from pretext_jax.input_pipeline.tokenizers import WordPieceTokenizer, tokenizer_fingerprint

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "cat", "Cat", "##s"]
    lowercased, cased = WordPieceTokenizer(vocab, True), WordPieceTokenizer(vocab, False)
    assert lowercased.encode("Cats") != cased.encode("Cats")
    assert tokenizer_fingerprint(lowercased) != tokenizer_fingerprint(cased)
    assert tokenizer_fingerprint(WordPieceTokenizer(list(vocab), True)) == tokenizer_fingerprint(
        lowercased)
    (tmp_path / "p.en").write_text("Cats\n" * 8)
    (tmp_path / "p.de").write_text("cat\n" * 8)
    spec = f"{tmp_path / 'p.en'},{tmp_path / 'p.de'}"
    config = XLMExampleConfig(stream_length=16, max_sentence_length=4)
    records = [prepare_tlm(spec, tokenizer, config, {"de": 0, "en": 1}, tmp_path / "cache")
               for tokenizer in (lowercased, cased)]
    assert records[0].directory != records[1].directory
    first = [r.examples(range(len(r)))["input_ids"] for r in records]
    assert not np.array_equal(*first)


def test_masked_loading_is_deterministic_per_seed(tmp_path):
    records = {"de": stream_records(tmp_path, 0, 6, "de"),
               "en": stream_records(tmp_path, 1, 6, "en")}
    config = XLMExampleConfig(stream_length=8, max_sentence_length=2)
    weights = mask_weights(stream_statistics(records["en"], 1000) + 1, 0.5, VOCAB)
    assert (tmp_path / "en" / "token_counts.npy").is_file()

    def batches(seed: int) -> list[np.ndarray]:
        schedule = StepSchedule(records, [0.5, 0.5], {}, [], seed=7, length=64)
        loader = make_loader(schedule, batch_size=8, seed=seed, num_epochs=1,
                             transforms=[XLMMasking(VOCAB, weights, config)])
        return [batch["input_ids"] for batch in loader]

    first = batches(0)
    assert len(first) == 8 and all((a == b).all() for a, b in zip(first, batches(0), strict=True))
    assert any((a != b).any() for a, b in zip(first, batches(1), strict=True))
    assert (np.concatenate(first) == VOCAB.mask_id).any()


def test_bad_inputs_are_one_line_errors(tmp_path):
    for spec in ("en=a.txt", "en=a.txt,de", "en=a.txt,en=b.txt"):
        with pytest.raises(UserError) as error:
            parse_corpora(spec)
        assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="language de has no text"):
        language_probabilities({"en": 3, "de": 0}, 0.5)
    (tmp_path / "a.en").write_text("1 2\n3 4\n")
    (tmp_path / "a.de").write_text("5\n")
    with pytest.raises(UserError, match="same number of lines"):
        prepare_tlm(f"{tmp_path / 'a.en'},{tmp_path / 'a.de'}", WordTokenizer(),
                    XLMExampleConfig(), {"en": 0, "de": 1}, tmp_path / "cache")
    with pytest.raises(UserError, match="tlm_pairs"):
        list(tlm_examples([], ["en", "de"], WordTokenizer(), XLMExampleConfig(tlm_pairs="en-fr"),
                          {"en": 0, "de": 1}))
    with pytest.raises(UserError, match="max_sentence_length"):
        XLMExampleConfig(stream_length=64, max_sentence_length=100)
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "text.txt").write_text("a b c\nd e f\n")
    data = DataConfig(vocab_size=20, prepare_workers=1)
    corpora = {"en": str(tmp_path / "text.txt"), "de": str(tmp_path / "empty.txt")}
    with pytest.raises(UserError, match="^language de has no text; [^\n]*$"):
        train_shared_tokenizer(corpora, data, 0.5, tmp_path / "t.model", 0)


def test_multi30k_shared_vocabulary_streams_and_tlm(shared_data, tmp_path):
    folder = shared_data / "multi30k"
    if not (folder / "train.en").is_file():
        pytest.skip(f"Multi30K not found in {folder}")
    files = {}
    for language in ("en", "de"):
        with open(folder / f"train.{language}", encoding="utf-8") as handle:
            lines = list(itertools.islice(handle, 400))
        files[language] = tmp_path / f"train.{language}"
        # Documents of 10 captions (blank lines), so that some can be held out.
        files[language].write_text("".join(line + "\n" * (i % 10 == 9)
                                           for i, line in enumerate(lines)), encoding="utf-8")
    corpora = parse_corpora(f"en={files['en']},de={files['de']}")
    ids = language_ids(corpora)
    assert ids == {"de": 0, "en": 1}
    data = DataConfig(vocab_size=400, prepare_workers=1, held_out_fraction=0.5)
    config = XLMExampleConfig(stream_length=64, max_sentence_length=30)
    prepared, tokenizer = prepare_streams(corpora, data, config, tmp_path / "cache", seed=0)
    vocabulary = {tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)}
    assert {"▁Mann", "▁und", "▁the", "▁and"} <= vocabulary  # words of both languages
    for language, (train, held_out) in prepared.items():
        rows = train.examples(range(len(train)))
        assert rows["input_ids"].shape[1] == 64 and (
            rows["langs"][rows["input_mask"] > 0] == ids[language]).all()
        counts = stream_statistics(train, tokenizer.vocab_size)
        assert counts[tokenizer.eos_id] > 0 and len(held_out) > 0
    for language in files:  # the parallel text: the same captions without the blank lines
        text = files[language].read_text(encoding="utf-8").replace("\n\n", "\n")
        files[language] = tmp_path / f"parallel.{language}"
        files[language].write_text(text, encoding="utf-8")
    tlm = prepare_tlm(f"{files['en']},{files['de']}", tokenizer, config, ids, tmp_path / "cache")
    lines = zip(*(files[lang].read_text(encoding="utf-8").splitlines() for lang in ("en", "de")),
                strict=True)
    kept = sum(all(0 < len(tokenizer.encode(s)) <= 30 for s in pair) for pair in lines)
    assert 100 < kept < 400 and len(tlm) == 2 * kept  # both directions, too-long pairs dropped
    rows = tlm.examples(range(len(tlm)))
    for row in range(0, len(tlm), 97):
        ids_row, positions = rows["input_ids"][row], rows["positions"][row]
        ends = np.flatnonzero(ids_row == tokenizer.eos_id)
        assert len(ends) == 4 and ends[2] == ends[1] + 1
        assert positions[ends[2]] == 0 and (positions[:ends[2]] == np.arange(ends[2])).all()
        langs = rows["langs"][row]
        assert len(set(langs[:ends[2]].tolist())) == 1 and langs[ends[2]] != langs[0]
    assert tlm.directory == prepare_tlm(f"{files['en']},{files['de']}", tokenizer, config, ids,
                                        tmp_path / "cache").directory
