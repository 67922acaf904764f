"""ALBERT: parity with HF `AlbertForPreTraining`, the HF round trip, cross-layer sharing (one set
of parameters, gradients of every application summed into it), sentence-order pairs, n-gram
masking, and training through the Trainer on a mixed mesh."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import converted, encoder_pretraining, padded_inputs, random_model

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import bert as bert_examples
from pretext_jax.input_pipeline.examples.albert import (
    AlbertExampleConfig,
    choose_ngram_spans,
    create_training_examples,
    ngram_mask_tokens,
    ngram_probabilities,
)
from pretext_jax.models.albert import Albert, AlbertConfig
from pretext_jax.models.encoder import EncoderStack
from pretext_jax.pretrain import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# HF AlbertConfig fields (E < H; the second with the exact GELU, three token types, dropout
# settings that evaluation ignores).
CONFIGS = [
    dict(vocab_size=99, embedding_size=16, hidden_size=32, num_hidden_layers=3,
         num_attention_heads=4, intermediate_size=37, max_position_embeddings=40,
         type_vocab_size=2),
    dict(vocab_size=64, embedding_size=8, hidden_size=24, num_hidden_layers=2,
         num_attention_heads=2, intermediate_size=40, max_position_embeddings=24,
         type_vocab_size=3, hidden_act="gelu", layer_norm_eps=1e-7, hidden_dropout_prob=0.1),
]
SMALL = AlbertConfig(vocab_size=50, embedding_size=12, hidden_size=24, num_layers=3,
                     num_heads=3, intermediate_size=40, max_position_embeddings=24)


ALBERT = encoder_pretraining("AlbertForPreTraining", pair_head="sop")


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_parity_with_hf_albert_for_pretraining(index, tmp_path):
    config = CONFIGS[index]
    reference = ALBERT.reference(index, **config)
    model = converted(reference, tmp_path)
    assert isinstance(model, Albert)
    inputs = padded_inputs(config["vocab_size"], config["type_vocab_size"], index)
    ALBERT.assert_parity(model, reference, *inputs)


@pytest.mark.usefixtures("deterministic_torch")
def test_our_model_round_trips_through_transformers(tmp_path):
    ours = random_model(Albert, SMALL, 0)
    _, hf_config = ALBERT.round_trip(ours, tmp_path / "exported", *padded_inputs(50, 2, 5))
    assert hf_config["hidden_act"] == "gelu_new" and hf_config["embedding_size"] == 12
    # Several layer groups (not ALBERT's sharing of one layer) are refused in one line.
    with pytest.raises(UserError, match="num_hidden_groups=2, inner_group_num=1; only 1 and 1"):
        hf.from_hf({**hf_config, "num_hidden_groups": 2}, {})


# --- Cross-layer sharing ---------------------------------------------------------------------

def parameter_count(config: AlbertConfig) -> int:
    model = nnx.eval_shape(lambda: Albert(config, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(v.get_value().shape))
               for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_parameter_count_does_not_depend_on_the_number_of_layers():
    counts = {n: parameter_count(dataclasses.replace(SMALL, num_layers=n)) for n in (1, 3, 12)}
    assert len(set(counts.values())) == 1, counts
    model = nnx.eval_shape(lambda: Albert(SMALL, rngs=nnx.Rngs(0)))
    assert model.encoder.stack.layer.query.kernel.get_value().shape == (24, 24)  # no layer axis
    # By hand: embeddings at E, projection, ONE layer, pooler, MLM head, SOP head.
    e, h, i, v = 12, 24, 40, 50
    layer = 4 * (h * h + h) + 2 * 2 * h + (h * i + i) + (i * h + h)
    expected = ((v + 24 + 2) * e + 2 * e + (e * h + h) + layer + (h * h + h)
                + (h * e + e) + 2 * e + v + (h * 2 + 2))
    assert counts[3] == expected


def test_gradients_of_every_application_land_in_the_one_layer():
    """The shared stack equals an unshared stack holding L copies of its layer, and its
    gradient is the sum of the copies' gradients (scan, and loop with remat)."""
    x = jax.random.normal(jax.random.key(1), (2, 5, 24))
    mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)[:, None, None, :]
    weights = jax.random.normal(jax.random.key(2), (2, 5, 24))

    def loss(stack):
        return jnp.sum(stack(x, mask, None) * weights)

    with nnx.use_eager_sharding(False):
        shared = EncoderStack(SMALL, rngs=nnx.Rngs(0), shared=True)
        copies = EncoderStack(SMALL, rngs=nnx.Rngs(1))
        looped = EncoderStack(dataclasses.replace(SMALL, scan_layers=False, remat="full"),
                              rngs=nnx.Rngs(0), shared=True)
    layer_state = nnx.state(shared.layer, nnx.Param)
    nnx.update(copies.layers, jax.tree.map(lambda p: jnp.stack([p] * 3), layer_state))
    gradient = nnx.jit(nnx.value_and_grad(loss))
    (loss_shared, grad_shared), (loss_copies, grad_copies) = gradient(shared), gradient(copies)
    np.testing.assert_allclose(loss_shared, loss_copies, rtol=1e-5)
    summed = jax.tree.map(lambda g: g.sum(axis=0), nnx.state(grad_copies.layers, nnx.Param))
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(grad_shared.layer, nnx.Param)),
                                 nnx.to_flat_state(summed), strict=True):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=2e-5, rtol=1e-4,
                                   err_msg=str(path))
    loss_looped, grad_looped = gradient(looped)
    np.testing.assert_allclose(loss_looped, loss_shared, rtol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(grad_shared, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(grad_looped, nnx.Param)),
                                 strict=True):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=1e-5, err_msg=str(path))


# --- Sentence-order pairs and n-gram masking --------------------------------------------------

VOCAB_SIZE = 20000
CONTINUATION = np.random.default_rng(0).random(VOCAB_SIZE) < 0.3
CONTINUATION[:5] = False
VOCAB = bert_examples.MaskingVocab(VOCAB_SIZE, 0, 2, 3, 4, CONTINUATION)


def traceable_documents(count: int = 800) -> list[list[list[int]]]:
    """Documents whose tokens are all distinct and increase through the corpus."""
    rng = np.random.default_rng(0)
    next_id, documents = 5, []
    for _ in range(count):
        document = []
        for _ in range(rng.integers(1, 7)):
            length = int(rng.integers(2, 9))
            document.append(list(range(next_id, next_id + length)))
            next_id += length
        documents.append(document)
    assert next_id < VOCAB_SIZE
    return documents


def test_sentence_order_pairs_are_balanced_and_really_swapped():
    documents = traceable_documents()
    document_of = {t: d for d, doc in enumerate(documents) for s in doc for t in s}
    config = AlbertExampleConfig(max_seq_length=24)
    rng = np.random.default_rng(0)
    same_document, other_document = [], []
    for index in range(len(documents)):
        for instance in bert_examples.create_instances_from_document(
                documents, index, config, VOCAB, rng, sentence_order=True):
            tokens, segments = instance.tokens, instance.segment_ids
            a = [t for t, s in zip(tokens, segments, strict=True) if s == 0 and t >= 5]
            b = [t for t, s in zip(tokens, segments, strict=True) if s == 1 and t >= 5]
            assert a and b and len(tokens) <= 24
            if {document_of[t] for t in a + b} == {index}:
                # Token ids grow through a document: label 0 = A before B, 1 = B before A.
                assert (max(a) < min(b)) == (not instance.is_random_next)
                assert (max(b) < min(a)) == instance.is_random_next
                same_document.append(instance.is_random_next)
            else:  # a one-sentence chunk: B from another document, as the reference
                assert instance.is_random_next and {document_of[t] for t in a} == {index}
                other_document.append(True)
    assert len(same_document) > 700
    # 3 standard deviations of the mean of ~800 fair coins are about 0.053.
    assert np.mean(same_document) == pytest.approx(0.5, abs=0.055)
    assert len(other_document) < len(same_document) / 2


def test_ngram_lengths_follow_one_over_n():
    np.testing.assert_allclose(ngram_probabilities(3), [6 / 11, 3 / 11, 2 / 11])
    candidates = [[i] for i in range(1, 41)]  # 40 adjacent one-piece words
    rng = np.random.default_rng(0)
    first = []
    for _ in range(6000):
        span = choose_ngram_spans(candidates, 6, ngram_probabilities(3), rng)[0]
        if span[0][0] <= 38:  # a start with 3 words ahead: the span has the drawn length
            first.append(len(span))
    frequencies = np.bincount(first, minlength=4)[1:] / len(first)
    # 4 standard deviations of a frequency from ~5,700 draws is about 0.026.
    np.testing.assert_allclose(frequencies, [6 / 11, 3 / 11, 2 / 11], atol=0.026)


def test_ngram_spans_are_contiguous_whole_words_within_the_budget():
    rng = np.random.default_rng(1)
    config = AlbertExampleConfig(max_seq_length=128)
    lengths, stepped_over_sep = [], 0
    for _ in range(300):
        body = rng.integers(5, VOCAB_SIZE, 100)
        tokens = np.concatenate([[2], body[:60], [3], body[60:], [3]]).astype(np.int32)
        words = bert_examples.masking_candidates(tokens, VOCAB, whole_word_mask=True)
        budget = bert_examples.prediction_budget(len(tokens), config)
        spans = choose_ngram_spans(words, budget, ngram_probabilities(3), rng)
        positions = [i for span in spans for word in span for i in word]
        assert len(positions) == len(set(positions)) <= budget
        for span in spans:
            assert all(word in words for word in span)  # whole words only
            flat = [i for word in span for i in word]
            # Contiguous tokens; [SEP] is stepped over only inside a word continued by "##"
            # pieces after it (the reference's candidates skip [SEP]), not between words.
            stretch = range(flat[0], flat[-1] + 1)
            assert flat == [i for i in stretch if tokens[i] not in (2, 3)]
            assert all(b[0] == a[-1] + 1 for a, b in zip(span, span[1:], strict=False))
            stepped_over_sep += len(flat) < len(stretch)
            lengths.append(len(span))
        output, masked, labels = ngram_mask_tokens(tokens, VOCAB, config, rng)
        np.testing.assert_array_equal(labels, tokens[masked])
        chosen = set(masked.tolist())
        for word in words:  # a word is masked entirely or not at all
            assert set(word) <= chosen or not set(word) & chosen
        changed = np.flatnonzero(output != tokens)
        assert set(changed.tolist()) <= chosen
    assert set(lengths) == {1, 2, 3} and stepped_over_sep > 0
    # Hand-computed: a budget of one prediction allows only one-piece words, never a 2-gram.
    tokens = np.array([2, 10, 11, 12, 3], np.int32)  # 11 continues 10: words [1, 2], [3]
    vocab = bert_examples.MaskingVocab(20, 0, 2, 3, 4, np.arange(20) == 11)
    words = bert_examples.masking_candidates(tokens, vocab, whole_word_mask=True)
    assert words == [[1, 2], [3]]
    for seed in range(20):
        assert choose_ngram_spans(words, 1, ngram_probabilities(3),
                                  np.random.default_rng(seed)) == [[[3]]]


def test_records_carry_sop_labels_and_ngram_masks():
    config = AlbertExampleConfig(max_seq_length=32, dupe_factor=2, max_predictions_per_seq=5)
    records = list(create_training_examples(traceable_documents(60), VOCAB, config, seed=0))
    labels = np.array([r["next_sentence_labels"] for r in records])
    assert set(labels) == {0, 1} and 0.4 < labels.mean() < 0.85  # one-sentence chunks add 1s
    for record in records:
        count = int(record["masked_lm_weights"].sum())
        length = int(record["input_mask"].sum())
        assert 1 <= count <= min(5, round(length * 0.15) or 1)
    with pytest.raises(UserError, match="dynamic_masking is not available for ALBERT"):
        AlbertExampleConfig(dynamic_masking=True)
    with pytest.raises(ValueError, match="factorises its embeddings"):
        AlbertConfig(hidden_size=128, embedding_size=128, num_heads=2)


def test_tiny_albert_trains_through_the_trainer_on_a_mixed_mesh(tmp_path):
    from pretext_jax.pretrain.config import make_config
    from pretext_jax.pretrain.trainer import Trainer

    overrides = {"model.hidden_size": 32, "model.num_heads": 2, "model.intermediate_size": 64,
                 "model.embedding_size": 16, "examples.max_seq_length": 32,
                 "examples.max_predictions_per_seq": 5, "examples.dupe_factor": 1,
                 "data.vocab_size": 1000, "data.cache_dir": str(tmp_path / "cache"),
                 "train.steps": 80, "train.batch_size": 32, "train.log_every": 5,
                 "train.eval_every": 80, "train.eval_batches": 2, "train.progress": False,
                 "train.checkpoint_every": 1000, "optim.warmup_steps": 10,
                 "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
    summary = Trainer(make_config("albert_tiny", overrides), tmp_path / "w").run()
    layer = summary["state"].params["encoder"]["stack"]["layer"]
    assert layer["query"]["kernel"][...].shape == (32, 32)  # one shared layer
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").open()]
    train = [r for r in rows if r["split"] == "train"]
    mlm = [r["mlm_loss"] for r in train]
    assert len(mlm) == 16 and np.isfinite([r["sop_loss"] for r in train]).all()
    # From ~ln(1000) = 6.9 down by far more than the step-to-step noise (~0.1).
    assert np.mean(mlm[:2]) - np.mean(mlm[-3:]) > 0.6, mlm
    assert summary["eval"]["mlm_loss"] < np.log(1000) - 0.6
    assert 0.0 <= summary["eval"]["sop_accuracy"] <= 1.0
