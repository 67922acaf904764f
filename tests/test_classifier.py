"""The fine-tuning classifier: parity with HF `*ForSequenceClassification` of BERT, ELECTRA,
RoBERTa, ALBERT, MPNet, XLNet and XLM (classification and regression), export back to
transformers, and the move of pre-trained weights into a classifier."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import (
    classifier_parity,
    converted,
    family_inputs,
    hf_reference,
    padded_inputs,
    random_params,
)

from pretext_jax.models.albert import Albert, AlbertConfig
from pretext_jax.models.bert import Bert
from pretext_jax.models.classifier import (
    ClassifierConfig,
    MPNetClassifierConfig,
    SequenceClassifier,
    XLMClassifierConfig,
    XLNetClassifierConfig,
    classifier_config,
    from_pretrained,
)
from pretext_jax.models.electra import ElectraDiscriminator
from pretext_jax.models.encoder import EncoderConfig
from pretext_jax.models.roberta import Roberta, RobertaConfig
from pretext_jax.models.xlm import XLM, XLMConfig
from pretext_jax.models.xlnet import XLNet, XLNetConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("deterministic_torch")

CASES = {
    "bert": ("BertForSequenceClassification",
             dict(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=40, type_vocab_size=2)),
    "electra": ("ElectraForSequenceClassification",
                dict(vocab_size=70, embedding_size=16, hidden_size=24, num_hidden_layers=2,
                     num_attention_heads=3, intermediate_size=40, max_position_embeddings=40,
                     type_vocab_size=2, hidden_act="gelu_new")),
    "roberta": ("RobertaForSequenceClassification",
                dict(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=40, type_vocab_size=1,
                     pad_token_id=1)),
    "albert": ("AlbertForSequenceClassification",
               dict(vocab_size=70, embedding_size=16, hidden_size=24, num_hidden_layers=3,
                    num_attention_heads=3, intermediate_size=40, max_position_embeddings=40,
                    classifier_dropout_prob=0.2)),
    "mpnet": ("MPNetForSequenceClassification",
              dict(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                   intermediate_size=40, max_position_embeddings=40)),
}


# HF XLNetConfig fields: a 3-class head, and a regression head on a deeper model with ReLU,
# clamped relative distances and its own summary dropout.
XLNET_CASES = {
    "3 labels": dict(vocab_size=60, d_model=24, n_layer=2, n_head=3, d_inner=40, num_labels=3),
    "regression": dict(vocab_size=45, d_model=16, n_layer=3, n_head=2, d_inner=24, num_labels=1,
                       ff_activation="relu", layer_norm_eps=1e-6, clamp_len=4,
                       summary_last_dropout=0.3),
}


def xlnet_inputs(vocab_size: int, seed: int = 0):
    """`padded_inputs` in XLNet's layout: padding on the left (segment id 4), the <cls>
    (segment id 2) last."""
    ids, types, mask = (np.flip(a, axis=1).copy() for a in padded_inputs(vocab_size, 2, seed))
    types[:, -1] = 2
    types[mask == 0] = 4
    return ids, types, mask


def hf_and_ours(architecture: str, fields: dict, tmp_path):
    """A perturbed HF classifier of `fields` and ours converted from its folder."""
    reference = hf_reference(architecture, fields["num_labels"], **fields)
    return reference, converted(reference, tmp_path)


@pytest.mark.parametrize("head,num_labels", [("bert", 3), ("bert", 1), ("electra", 3),
                                             ("electra", 1), ("roberta", 3), ("albert", 1),
                                             ("mpnet", 3)])
def test_parity_with_hf(head, num_labels, tmp_path):
    architecture, fields = CASES[head]
    reference, model = hf_and_ours(architecture, {**fields, "num_labels": num_labels}, tmp_path)
    assert isinstance(model, SequenceClassifier)
    assert (model.config.head, model.config.num_labels) == (head, num_labels)
    if head == "albert":  # its classifier_dropout_prob, not the hidden dropout (0)
        assert model.config.head_dropout == 0.2
    classifier_parity(architecture).assert_parity(
        model, reference, *family_inputs(head, fields["vocab_size"], num_labels))


@pytest.mark.parametrize("case", XLNET_CASES)
def test_xlnet_parity_with_hf(case, tmp_path):
    fields = XLNET_CASES[case]
    reference, model = hf_and_ours("XLNetForSequenceClassification", fields, tmp_path)
    assert isinstance(model, SequenceClassifier)
    assert (model.config.head, model.config.num_labels) == ("xlnet", fields["num_labels"])
    assert model.config.head_dropout == fields.get("summary_last_dropout", 0.1)
    ids, types, mask = xlnet_inputs(fields["vocab_size"], fields["num_labels"])
    parity = classifier_parity("XLNetForSequenceClassification")
    parity.assert_parity(model, reference, ids, types, mask)
    # Only the real tokens matter: other ids and segments at the padding change nothing.
    parity.assert_parity(model, reference, np.where(mask, ids, 5), np.where(mask, types, 0), mask)


# HF XLMConfig fields: a 3-class head with language embeddings, and a regression head with
# fixed sinusoidal positions, ReLU and its own summary dropout.
XLM_CASES = {
    "3 labels": dict(vocab_size=60, emb_dim=24, n_layers=2, n_heads=3, n_langs=2,
                     max_position_embeddings=30, num_labels=3),
    "regression": dict(vocab_size=45, emb_dim=16, n_layers=3, n_heads=2, n_langs=1,
                       sinusoidal_embeddings=True, gelu_activation=False, layer_norm_eps=1e-6,
                       summary_first_dropout=0.3, num_labels=1),
}


def xlm_inputs(vocab_size: int, seed: int = 0):
    """`padded_inputs` padded with XLM's id 2 (never a real token) and no token types (XLM's
    classifier reads none)."""
    ids, _, mask = padded_inputs(vocab_size, 2, seed)
    return np.where(mask == 1, np.maximum(ids, 3), 2), np.zeros_like(ids), mask


@pytest.mark.parametrize("case", XLM_CASES)
def test_xlm_parity_with_hf(case, tmp_path):
    fields = XLM_CASES[case]
    reference, model = hf_and_ours("XLMForSequenceClassification", fields, tmp_path)
    assert isinstance(model, SequenceClassifier) and model.head_dense is None
    assert (model.config.head, model.config.num_labels) == ("xlm", fields["num_labels"])
    assert model.config.head_dropout == fields.get("summary_first_dropout", 0.1)
    ids, types, mask = xlm_inputs(fields["vocab_size"], fields["num_labels"])
    parity = classifier_parity("XLMForSequenceClassification")
    expected = parity.assert_parity(model, reference, ids, types, mask)
    # The head reads the first position only: other ids at the padding change nothing.
    np.testing.assert_allclose(model(jnp.asarray(np.where(mask, ids, 5)), None, mask),
                               expected["logits"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("head", ["bert", "electra", "roberta", "albert", "mpnet", "xlnet", "xlm"])
def test_classifier_exports_to_transformers(head, tmp_path):
    shape = dict(vocab_size=50, hidden_size=24, num_layers=2, num_heads=3, intermediate_size=40)
    if head == "xlnet":
        config = XLNetClassifierConfig(**shape, num_labels=2, classifier_dropout=0.2)
        architecture, batch = "XLNetForSequenceClassification", xlnet_inputs(50, 3)
    elif head == "xlm":
        config = XLMClassifierConfig(**{**shape, "intermediate_size": 96}, n_langs=3,
                                     max_position_embeddings=20, num_labels=2,
                                     classifier_dropout=0.2)
        architecture, batch = "XLMForSequenceClassification", xlm_inputs(50, 3)
    elif head == "mpnet":
        config = MPNetClassifierConfig(**shape, max_position_embeddings=20, num_labels=2,
                                       classifier_dropout=0.2)
        architecture, batch = CASES[head][0], family_inputs(head, 50, 3)
    else:
        config = ClassifierConfig(
            **shape, embedding_size=12 if head in ("electra", "albert") else 0,
            max_position_embeddings=20, head=head, num_labels=2, classifier_dropout=0.2,
            **({"type_vocab_size": 1, "position_padding_id": 1} if head == "roberta" else {}))
        architecture, batch = CASES[head][0], family_inputs(head, 50, 3)
    ours = random_params(SequenceClassifier(config, rngs=nnx.Rngs(0)), 1)
    classifier_parity(architecture).round_trip(ours, tmp_path / "out", *batch)


ENCODER = dict(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
               max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
PRETRAINED = {  # head -> (pre-trained class, its config)
    "bert": (Bert, EncoderConfig(**ENCODER)),
    "electra": (ElectraDiscriminator, EncoderConfig(**ENCODER)),
    "roberta": (Roberta, RobertaConfig(**ENCODER, position_padding_id=1)),
    "albert": (Albert, AlbertConfig(**ENCODER, embedding_size=8)),
}


@pytest.mark.parametrize("head", PRETRAINED)
def test_pretrained_encoder_moves_into_the_classifier_parity(head):
    pretrained_class, encoder = PRETRAINED[head]
    pretrained = random_params(pretrained_class(encoder, rngs=nnx.Rngs(0)), 2)
    config = classifier_config(pretrained, num_labels=2)
    assert config.head == head
    model = from_pretrained(pretrained, config, nnx.Rngs(1))
    assert classifier_config(model, num_labels=3).head == config.head  # a fine-tuned one's
    ids, types, mask = map(jnp.asarray, family_inputs(head, 40, 4))
    np.testing.assert_array_equal(model.encoder(ids, types, mask, None),
                                  pretrained.encoder(ids, types, mask, None))
    if head in ("bert", "albert"):  # the pre-trained pooler is the head's first layer
        np.testing.assert_array_equal(model.head_dense.kernel[...], pretrained.pooler.kernel[...])
    # Dropout acts in training only, and differs per key.
    dropping = from_pretrained(pretrained, ClassifierConfig(
        **{**config.__dict__, "classifier_dropout": 0.5}), nnx.Rngs(1))
    first = dropping(ids, types, mask, rng=jax.random.key(0))
    assert not np.allclose(first, dropping(ids, types, mask, rng=jax.random.key(1)))
    np.testing.assert_array_equal(dropping(ids, types, mask), model(ids, types, mask))


def test_pretrained_xlnet_moves_into_the_classifier_parity():
    config = XLNetConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                         intermediate_size=32, mem_len=6, reuse_len=4, memory_batch_size=3,
                         bi_data=True, same_length=True, hidden_dropout=0.0,
                         attention_dropout=0.0)
    pretrained = random_params(XLNet(config, rngs=nnx.Rngs(0)), 2)
    head_config = classifier_config(pretrained, num_labels=2, classifier_dropout=0.5)
    # Fine-tuning runs without memory or bi_data (run_classifier.py's run config).
    assert (head_config.head, head_config.bi_data, head_config.same_length, head_config.mem_len,
            head_config.reuse_len, head_config.memory_batch_size) == ("xlnet", False, False,
                                                                      0, 0, 0)
    model = from_pretrained(pretrained, head_config, nnx.Rngs(1))
    assert classifier_config(model, num_labels=3).head == "xlnet"
    moved = nnx.to_flat_state(nnx.state(model.transformer, nnx.Param))
    source = dict(nnx.to_flat_state(nnx.state(pretrained, nnx.Param)))
    assert len(moved) == len(source) - 1  # all but the LM bias
    for path, variable in moved:
        np.testing.assert_array_equal(variable.get_value(), source[path].get_value())
    assert "memory" not in nnx.state(model.transformer)
    # The head reads the last position; dropout acts in training only, and differs per key.
    ids, types, mask = map(jnp.asarray, xlnet_inputs(40, 4))
    hidden, _ = model.transformer.encode(ids, types, mask)
    summary = jnp.tanh(model.head_dense(hidden[:, -1]))
    np.testing.assert_allclose(model(ids, types, mask), model.head_output(summary), rtol=1e-6)
    first = model(ids, types, mask, rng=jax.random.key(0))
    assert not np.allclose(first, model(ids, types, mask, rng=jax.random.key(1)))


def test_pretrained_xlm_moves_into_the_classifier_parity():
    config = XLMConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                       intermediate_size=64, max_position_embeddings=32, n_langs=2, causal=True,
                       hidden_dropout=0.0, attention_dropout=0.0)
    pretrained = random_params(XLM(config, rngs=nnx.Rngs(0)), 2)
    head_config = classifier_config(pretrained, num_labels=2, classifier_dropout=0.5)
    # A CLM-pre-trained XLM classifies bidirectionally (XLM's glue.py: causal=False).
    assert (head_config.head, head_config.causal, head_config.n_langs) == ("xlm", False, 2)
    model = from_pretrained(pretrained, head_config, nnx.Rngs(1))
    assert classifier_config(model, num_labels=3).head == "xlm"
    moved = nnx.to_flat_state(nnx.state(model.transformer, nnx.Param))
    source = dict(nnx.to_flat_state(nnx.state(pretrained, nnx.Param)))
    assert len(moved) == len(source) - 1  # all but the prediction layer's bias
    for path, variable in moved:
        np.testing.assert_array_equal(variable.get_value(), source[path].get_value())
    # The head is dropout + one linear layer on the first position's state.
    ids, types, mask = map(jnp.asarray, xlm_inputs(40, 4))
    first = np.asarray(model.transformer.hidden(ids, mask))[:, 0]
    expected = first @ np.asarray(model.head_output.kernel[...]) + np.asarray(
        model.head_output.bias[...])
    np.testing.assert_allclose(model(ids, types, mask), expected, atol=1e-5, rtol=0)
    dropped = model(ids, types, mask, rng=jax.random.key(0))
    assert not np.allclose(dropped, model(ids, types, mask, rng=jax.random.key(1)))
