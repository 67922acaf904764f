"""Translation: T5's language embeddings (MASS's bilingual setting), greedy encoder-decoder
decoding (`models.generate.greedy_seq2seq`) against HF `generate`, and the `translation`
fine-tune with its BLEU check (`objectives.translation`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import random_params

from pretext_jax.errors import UserError
from pretext_jax.models import t5_hf
from pretext_jax.models.generate import greedy_seq2seq
from pretext_jax.models.t5 import T5, T5Config
from pretext_jax.pretrain import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HF_T5 = dict(vocab_size=61, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
             num_heads=4, feed_forward_proj="relu", tie_word_embeddings=True,
             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
SMALL = T5Config(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, head_size=8,
                 intermediate_size=24, hidden_dropout=0.0, attention_dropout=0.0)


def sources(vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """[4, 9] source ids padded at the end of three rows, and their mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab_size, (4, 9))
    mask = (np.arange(9) < np.array([9, 6, 3, 7])[:, None]).astype(np.int64)
    return ids * mask, mask


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A random HF T5 and its folder, every tensor moved by N(0, 0.5^2) so that greedy outputs
    vary from step to step (at HF's init they repeat one token)."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**HF_T5))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator))
    folder = tmp_path_factory.mktemp("t5")
    model.save_pretrained(folder)
    return model.eval(), folder


def hf_greedy(model, ids, mask, new_tokens: int, eos: int) -> np.ndarray:
    """HF's greedy tokens without the start token, padded with 0 to `new_tokens`."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             do_sample=False, num_beams=1, max_new_tokens=new_tokens,
                             min_new_tokens=0, eos_token_id=eos, pad_token_id=0).numpy()
    return np.pad(out[:, 1:], ((0, 0), (0, new_tokens + 1 - out.shape[1])))


def test_greedy_seq2seq_equals_hf_generate_and_stops_rows_at_eos(hf_pair):
    reference, folder = hf_pair
    ids, mask = sources(HF_T5["vocab_size"], seed=1)
    model = hf.load(folder)
    free = greedy_seq2seq(model, ids, mask, max_new_tokens=12)
    np.testing.assert_array_equal(free, hf_greedy(reference, ids, mask, 12, eos=1))
    # An end-of-sequence id that rows reach at different steps: each row keeps it, then pads.
    eos = int(free[3, 3])
    stopping = hf.load(folder, eos_token_id=eos)
    out = greedy_seq2seq(stopping, ids, mask, max_new_tokens=12)
    np.testing.assert_array_equal(out, hf_greedy(reference, ids, mask, 12, eos=eos))
    stops = []
    for row, tokens in zip(free, out, strict=True):
        stops.append(list(row).index(eos) + 1 if eos in row else 12)
        np.testing.assert_array_equal(tokens[:stops[-1]], row[:stops[-1]])
        assert (tokens[stops[-1]:] == 0).all()
    assert len(set(stops)) >= 3 and 12 in stops  # rows stop at different steps, one never
    with pytest.raises(UserError, match="max_new_tokens"):
        greedy_seq2seq(model, ids, mask, max_new_tokens=0)


def with_languages(table: np.ndarray) -> T5:
    """SMALL with language embeddings `table`, other parameters those of `plain()`."""
    model = T5(dataclasses.replace(SMALL, num_languages=len(table)), rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(plain(), nnx.Param))
    model.language_embeddings.embedding.set_value(jnp.asarray(table, jnp.float32))
    return model


def plain() -> T5:
    return random_params(nnx.eval_shape(lambda: T5(SMALL, rngs=nnx.Rngs(0))), seed=3)


def test_language_embeddings_add_to_tokens_in_encoder_and_decoder():
    ids, mask = sources(SMALL.vocab_size, seed=2)
    decoder_ids = ids[:, :5]
    zero, base = with_languages(np.zeros((2, 16))), plain()
    assert base.language_embeddings is None and zero.language_embeddings is not None
    languages = np.tile([[0], [1]], (2, 9))
    # A zero table is no table (and without the table the ids are refused).
    np.testing.assert_allclose(
        zero(ids, mask, decoder_ids, language_ids=languages,
             decoder_language_ids=languages[:, :5]).logits,
        base(ids, mask, decoder_ids).logits, atol=1e-6)
    with pytest.raises(ValueError, match="language_ids"):
        base.encode(ids, mask, language_ids=languages)
    with pytest.raises(ValueError, match="language_ids"):
        zero.encode(ids, mask)
    # A row of the table is added to each token embedding of that language, and changes the
    # output; encoder and decoder read the same table.
    table = np.random.default_rng(0).normal(size=(2, 16)).astype(np.float32)
    model = with_languages(table)
    np.testing.assert_allclose(model.embed(jnp.asarray(ids), jnp.asarray(languages)),
                               np.asarray(model.shared(jnp.asarray(ids))) + table[languages],
                               atol=1e-6)
    shifted = np.asarray(model.encode(ids, mask, language_ids=languages))
    assert not np.allclose(shifted, np.asarray(base.encode(ids, mask)), atol=1e-3)
    np.testing.assert_allclose(shifted[:2], np.asarray(
        model.encode(ids[:2], mask[:2], language_ids=languages[:2])), atol=1e-6)
    flipped = np.asarray(model.encode(ids, mask, language_ids=1 - languages))
    assert not np.allclose(shifted, flipped, atol=1e-3)
    encoded = jnp.asarray(shifted)
    decoded = [np.asarray(model.decode(decoder_ids, encoded, mask, language_ids=lang[:, :5]))
               for lang in (languages, 1 - languages)]
    assert not np.allclose(*decoded, atol=1e-3)
    # Greedy decoding passes the languages: target language 0 and 1 give other outputs.
    out = [greedy_seq2seq(model, ids, mask, max_new_tokens=6, source_language_ids=languages,
                          target_language_ids=np.full(4, lang)) for lang in (0, 1)]
    assert (out[0] != out[1]).any()
    with pytest.raises(UserError, match="^this T5 has language embeddings [^\n]*$"):
        t5_hf.config_to_hf(model.config)
