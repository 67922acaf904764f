"""MASS on the reference's model (method `mass_xlm`: models/xlm.py `XLMTranslation`,
input_pipeline/examples/mass.py `XLMMassMasking`, objectives/mass.py `mass_xlm_loss`) against a
numpy re-statement of microsoft/MASS MASS-unsupNMT: src/data/dataset.py `batch_sentences`
(`</s> words </s>`, time-major), src/trainer.py `restricted_mask_sent` and `mass_step` (the
encoder input, the decoder's fragment shifted right at the fragment's positions, `enc_mask`,
the language of every position, `PredLayer`'s mean cross-entropy on `pred_mask`), and the
reference's encoder and decoder (`tests/xlm_numpy.py`, with the per-language encoder-attention
output). The draws (where the fragment sits, what 80/10/10 made of it) are ours, taken from the
example and handed to the re-statement; their distribution against the reference's sampler is
`tests/test_reference_samplers.py`'s. Negative controls: the re-statement with the decoder at
positions 0 .. k - 1, without `enc_mask`, or with the other language's output differs. A few
optimizer steps lower the loss; the paper preset's settings."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from parity_utils import random_model
from xlm_numpy import flat, numpy_xlm

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import mass as me
from pretext_jax.input_pipeline.examples.bert import MaskingVocab
from pretext_jax.models.xlm import XLMTranslation, XLMTranslationConfig
from pretext_jax.objectives.mass import mass_xlm_loss
from pretext_jax.pretrain.config import make_config

PAD, EOS, MASK, VOCAB_SIZE, FIRST_WORD = 0, 3, 4, 40, 5
VOCAB = MaskingVocab(vocab_size=VOCAB_SIZE, pad_id=PAD, cls_id=2, sep_id=EOS, mask_id=MASK,
                     continuation=np.zeros(VOCAB_SIZE, bool))
EXAMPLES = me.MassExampleConfig(max_seq_length=14, min_length=2)
CONFIG = XLMTranslationConfig(vocab_size=VOCAB_SIZE, hidden_size=16, num_layers=2, num_heads=2,
                              intermediate_size=64, max_position_embeddings=32, n_langs=2,
                              cross_output_per_language=True, pad_token_id=PAD,
                              eos_token_id=EOS)


@pytest.fixture(scope="module")
def model() -> XLMTranslation:
    """Random parameters, the LayerNorm gains after the embeddings and after every layer x 5:
    peaked predictions, so that the loss tells the controls apart (near-uniform ones hide
    them)."""
    model = random_model(XLMTranslation, CONFIG, 3)
    for side in (model.encoder, model.decoder):
        side.embedding_layer_norm.scale[...] *= 5.0
        side.layers.output_layer_norm.scale[...] *= 5.0
    return model


def record(words: np.ndarray) -> np.ndarray:
    """A stored segment: the words, EOS, zeros up to max_seq_length."""
    tokens = np.zeros(EXAMPLES.max_seq_length, np.int32)
    tokens[:len(words)] = words
    tokens[len(words)] = EOS
    return tokens


def our_batch(sentences: list[np.ndarray], language: int, seed: int):
    masking = me.XLMMassMasking(VOCAB, EXAMPLES)
    rng = np.random.default_rng(seed)
    examples = [masking.random_map({"tokens": record(s), "language": np.array([language])}, rng)
                for s in sentences]
    return {key: jnp.asarray(np.stack([e[key] for e in examples])) for key in examples[0]}


def reference_mass_step(model, sentences, language, batch, *, original_positions=True,
                        enc_mask=True, other_output=False) -> float:
    """`mass_step`'s loss on one batch of equal-length sentences, re-stated: `batch_sentences`
    makes x [slen, bs] = `</s> words </s>`; `restricted_mask_sent` with one segment of
    mask_len = round(slen x 0.5) tokens at our draw's sentence positions pos_i (never 0), whose
    `mask_word` output is our draw's: x1 = x with x[pos_i] so replaced, x2 = x[pos_i - 1],
    y = x[pos_i], positions = pos_i - 1, len2 = mask_len; langs1 = langs2 = the language;
    encoder `fwd(causal=False)`; decoder `fwd(causal=True, src_enc, src_len, positions,
    enc_mask = x1 != mask_index)`, whose encoder-attention output is that of `langs.max()`
    (`attention_setting` v1); `predict` on pred_mask = y != pad: cross-entropy, mean. The
    controls: `original_positions=False` (0 .. k - 1), `enc_mask=False`, `other_output` (the
    other language's encoder-attention output)."""
    lengths = np.array([len(s) + 2 for s in sentences])
    assert (lengths == lengths[0]).all(), "the reference batches sentences of one length"
    slen, bs = lengths.max(), len(sentences)
    x = np.full((slen, bs), PAD)
    x[0] = EOS
    for i, words in enumerate(sentences):
        x[1:lengths[i] - 1, i] = words
        x[lengths[i] - 1, i] = EOS
    mask_len = round(len(x[:, 0]) * 0.5)
    x1, x2, y, positions = (np.full((n, bs), PAD) for n in (slen, mask_len, mask_len, mask_len))
    drawn_inputs = np.asarray(batch["inputs"])
    for i in range(bs):
        words = x[:lengths[i], i].copy()
        pos_i = np.asarray(batch["decoder_positions"])[i, :mask_len] + 1  # our draw
        assert pos_i.min() >= 1 and (np.asarray(batch["decoder_mask"])[i].sum() == mask_len)
        y[:, i], x2[:, i] = words[pos_i], words[pos_i - 1]
        words[pos_i] = drawn_inputs[i, pos_i]  # what our mask_word draw made of them
        x1[:lengths[i], i] = words
        positions[:, i] = pos_i - 1 if original_positions else np.arange(mask_len)
    langs1, langs2 = np.full_like(x1, language), np.full_like(x2, language)
    source = np.arange(slen)[None] < lengths[:, None]  # [bs, slen], the src_len mask
    encoded, _ = numpy_xlm(flat(model.encoder), CONFIG, x1.T, langs1.T, source, causal=False)
    source_mask = source & (x1.T != MASK) if enc_mask else source
    target_mask = np.ones((bs, mask_len), bool)
    output_language = 1 - langs2.max(0) if other_output else langs2.max(0)
    _, logits = numpy_xlm(flat(model.decoder), CONFIG, x2.T, langs2.T, target_mask,
                          causal=True, positions=positions.T, encoded=encoded,
                          source_mask=source_mask, cross_output_language=output_language)
    pred_mask = (y != PAD).T
    scores = logits[pred_mask]
    log_probs = scores - np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - scores.max(-1, keepdims=True)
    return float(-np.mean(log_probs[np.arange(len(scores)), y.T[pred_mask]]))


def sentences_of(words: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_WORD, VOCAB_SIZE, words) for _ in range(count)]


@pytest.mark.parametrize("words, language", [(9, 1), (6, 0)])
def test_loss_equals_the_reference_mass_step(model, words, language):
    """One batch of equal-length sentences (9 words: l = 11, k = round(5.5) = 6; 6 words:
    l = 8, k = 4), in either language: our loss equals the re-stated `mass_step` to 1e-5."""
    sentences = sentences_of(words, 4, seed=words)
    batch = our_batch(sentences, language, seed=words)
    ours, metrics = mass_xlm_loss(model, batch, None)
    reference = reference_mass_step(model, sentences, language, batch)
    np.testing.assert_allclose(float(ours), reference, rtol=0, atol=1e-5)
    k = round((words + 2) * 0.5)
    assert float(metrics["target_tokens"][0]) == 4 * k
    assert float(metrics["input_tokens"][0]) == 4 * (words + 2)
    # The fragment's [MASK]ed tokens are hidden from the decoder, some random/kept ones not.
    assert (np.asarray(batch["cross_attention_mask"]) == 0).sum() > 0


def test_negative_controls_differ(model):
    """The re-statement changed in one MASS-specific part no longer matches: the decoder at
    positions 0 .. k - 1 (not the fragment's), cross-attention to every source token (no
    `enc_mask`), or the other language's cross-attention output."""
    sentences = sentences_of(9, 4, seed=9)
    batch = our_batch(sentences, 1, seed=9)
    ours = float(mass_xlm_loss(model, batch, None)[0])
    assert max(batch["decoder_positions"][:, 0]) > 0  # a fragment away from the start
    for change in ({"original_positions": False}, {"enc_mask": False}, {"other_output": True}):
        assert abs(reference_mass_step(model, sentences, 1, batch, **change) - ours) > 1e-3, (
            change)


def test_rows_of_different_lengths_weigh_each_fragment_token_once(model):
    """Our batches are fixed rows (sentences of any length, decoders padded to the longest
    fragment): the loss is the token-weighted mean of the reference's loss over each sentence
    as its own batch, so padding adds nothing."""
    sentences = [*sentences_of(4, 1, 1), *sentences_of(11, 1, 2), *sentences_of(7, 1, 3)]
    batch = our_batch(sentences, 0, seed=5)
    ours = float(mass_xlm_loss(model, batch, None)[0])
    sizes = np.asarray(batch["decoder_mask"]).sum(1)
    assert sizes.tolist() == [3, 6, 4]  # round(0.5 x (words + 2))
    singles = [reference_mass_step(model, [s], 0, {k: v[i:i + 1] for k, v in batch.items()})
               for i, s in enumerate(sentences)]
    np.testing.assert_allclose(ours, np.dot(singles, sizes) / sizes.sum(), rtol=0, atol=1e-5)


def test_a_few_steps_lower_the_loss():
    """Adam on a fixed batch of 16 sentences: the loss falls well below its start (layers in a
    Python loop, no dropout: the quickest compile)."""
    model = XLMTranslation(dataclasses.replace(CONFIG, scan_layers=False), rngs=nnx.Rngs(0))
    batch = our_batch(sentences_of(8, 16, seed=7), 1, seed=7)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        (loss, _), grads = nnx.value_and_grad(mass_xlm_loss, has_aux=True)(model, batch, None)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(25)]
    assert losses[-1] < losses[0] - 1.0, losses


def test_layout_and_settings():
    """The layout's shapes (encoder L + 1, decoder the longest fragment), the reference's
    fragment sizes, the paper preset's settings, and the refusals."""
    batch = our_batch(sentences_of(13, 2, 0), 0, 0)  # 13 words + EOS fill the 14-token record
    assert batch["inputs"].shape == (2, 15) and batch["targets"].shape == (2, 8)
    assert me.xlm_decoder_length(EXAMPLES) == 8 == round(0.5 * 15)  # 7.5: to even
    assert (batch["inputs"][:, 0] == EOS).all() and (batch["decoder_mask"] == 1).all()
    assert EXAMPLES.fragment_size(1) == 1  # never more than the segment
    base = make_config("mass_base")
    assert base.method == "mass_xlm"
    model, examples = base.model, base.examples
    assert (model.hidden_size, model.intermediate_size, model.num_layers, model.num_heads,
            model.hidden_act, model.hidden_dropout, model.attention_dropout,
            model.cross_output_per_language, model.sinusoidal_embeddings) == (
        1024, 4096, 6, 8, "gelu", 0.1, 0.1, True, False)
    assert (examples.max_seq_length, examples.min_length, examples.drop_long_sentences,
            examples.fragment_fraction) == (101, 5, True, 0.5)
    with pytest.raises(UserError, match="max_position_embeddings"):
        make_config("mass_xlm_tiny", {"examples.max_seq_length": 128})
    with pytest.raises(UserError, match="fragment_block=0"):
        make_config("mass_xlm_tiny", {"examples.fragment_block": 16})
