"""The fine-tuning classifier: parity with HF `BertForSequenceClassification` and
`ElectraForSequenceClassification` (classification and regression), export back to
transformers, and the move of pre-trained weights into a classifier."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import assert_same_params, padded_inputs, perturbed, random_params, torch_forward

from models.bert import Bert
from models.classifier import (
    ClassifierConfig,
    SequenceClassifier,
    classifier_config,
    from_pretrained,
)
from models.electra import ElectraDiscriminator
from models.encoder import EncoderConfig
from pretrain import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("deterministic_torch")

CASES = {
    "bert": ("BertConfig", "BertForSequenceClassification",
             dict(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=40, type_vocab_size=2)),
    "electra": ("ElectraConfig", "ElectraForSequenceClassification",
                dict(vocab_size=70, embedding_size=16, hidden_size=24, num_hidden_layers=2,
                     num_attention_heads=3, intermediate_size=40, max_position_embeddings=40,
                     type_vocab_size=2, hidden_act="gelu_new")),
}


@pytest.mark.parametrize("num_labels", [3, 1])
@pytest.mark.parametrize("head", ["bert", "electra"])
def test_parity_with_hf(head, num_labels, tmp_path):
    config_class, model_class, fields = CASES[head]
    torch.manual_seed(num_labels)
    config = getattr(transformers, config_class)(**fields, num_labels=num_labels)
    reference = perturbed(getattr(transformers, model_class)(config), num_labels)
    reference.save_pretrained(tmp_path)
    batch = padded_inputs(fields["vocab_size"], 2, num_labels)
    expected = torch_forward(reference, *batch).logits.numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete checkpoint loads without any warning
        model = hf.load(tmp_path)
    assert isinstance(model, SequenceClassifier)
    assert (model.config.head, model.config.num_labels) == (head, num_labels)
    np.testing.assert_allclose(np.asarray(model(*map(jnp.asarray, batch))), expected,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("head", ["bert", "electra"])
def test_classifier_exports_to_transformers(head, tmp_path):
    config = ClassifierConfig(vocab_size=50, hidden_size=24, embedding_size=12 if head ==
                              "electra" else 0, num_layers=2, num_heads=3, intermediate_size=40,
                              max_position_embeddings=20, head=head, num_labels=2)
    ours = random_params(SequenceClassifier(config, rngs=nnx.Rngs(0)), 1)
    hf.save(ours, tmp_path / "out")
    reloaded, info = getattr(transformers, CASES[head][1]).from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    batch = padded_inputs(50, 2, 3)
    np.testing.assert_allclose(torch_forward(reloaded.eval(), *batch).logits.numpy(),
                               np.asarray(ours(*map(jnp.asarray, batch))), atol=1e-5, rtol=0)
    assert_same_params(hf.load(tmp_path / "out"), ours)


@pytest.mark.parametrize("pretrained_class", [Bert, ElectraDiscriminator])
def test_pretrained_encoder_moves_into_the_classifier(pretrained_class):
    encoder = EncoderConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                            intermediate_size=32, max_position_embeddings=32,
                            hidden_dropout=0.0, attention_dropout=0.0)
    pretrained = random_params(pretrained_class(encoder, rngs=nnx.Rngs(0)), 2)
    config = classifier_config(pretrained, num_labels=2)
    assert config.head == ("bert" if pretrained_class is Bert else "electra")
    model = from_pretrained(pretrained, config, nnx.Rngs(1))
    ids, types, mask = map(jnp.asarray, padded_inputs(40, 2, 4))
    np.testing.assert_array_equal(model.encoder(ids, types, mask, None),
                                  pretrained.encoder(ids, types, mask, None))
    if pretrained_class is Bert:
        np.testing.assert_array_equal(model.head_dense.kernel[...], pretrained.pooler.kernel[...])
    # Dropout acts in training only, and differs per key.
    dropping = from_pretrained(pretrained, ClassifierConfig(
        **{**config.__dict__, "classifier_dropout": 0.5}), nnx.Rngs(1))
    first = dropping(ids, types, mask, rng=jax.random.key(0))
    assert not np.allclose(first, dropping(ids, types, mask, rng=jax.random.key(1)))
    np.testing.assert_array_equal(dropping(ids, types, mask), model(ids, types, mask))
