"""Beam search for encoder-decoders (models/beam_search.py): token for token and score for score
the same as HF `generate(num_beams=..., length_penalty=..., early_stopping=...,
no_repeat_ngram_size=..., min_length=..., num_return_sequences=...)` on a T5 and a ProphetNet
converted through `pretrain.hf`; on XLM's encoder-decoder (no HF class) the same as a plain
Python re-statement of HF's search run on the model's no-cache logits. Each family's cached
`decode_step` equals its full decoder. Negative controls: the length penalty, the n-gram ban
and the minimum length each change the outputs of a case here, the way they should."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import hf_reference, random_model

from pretext_jax.errors import UserError
from pretext_jax.models.beam_search import BeamSearch, beam_search
from pretext_jax.models.prophetnet import ProphetNet, ProphetNetConfig
from pretext_jax.models.t5 import T5, T5Config
from pretext_jax.models.xlm import XLMTranslation, XLMTranslationConfig
from pretext_jax.pretrain import hf

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

NEW_TOKENS = 12
HF_T5 = dict(vocab_size=61, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
             num_heads=4, feed_forward_proj="relu", tie_word_embeddings=True,
             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
# HF's generate sizes its cache by the encoder's depth (transformers 5.24), so the two match.
HF_PROPHETNET = dict(vocab_size=61, hidden_size=32, num_encoder_layers=2, num_decoder_layers=2,
                     num_encoder_attention_heads=4, num_decoder_attention_heads=2,
                     encoder_ffn_dim=37, decoder_ffn_dim=41, max_position_embeddings=40, ngram=2,
                     num_buckets=8, relative_max_distance=6)
# End-of-sequence ids that the random models reach at different steps (the start tokens stay
# HF's), so hypotheses finish early, late and never.
T5_EOS, PROPHETNET_EOS = 25, 40
SEARCHES = {
    "plain": BeamSearch(num_beams=4, length_penalty=1.0, early_stopping=False,
                        num_return_sequences=4),
    "early": BeamSearch(num_beams=4, length_penalty=2.0, early_stopping=True,
                        no_repeat_ngram_size=2, min_length=4, num_return_sequences=2),
    "never": BeamSearch(num_beams=4, length_penalty=0.5, early_stopping="never",
                        no_repeat_ngram_size=3, min_length=3, num_return_sequences=3),
}


def sources(vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """[4, 9] source ids padded at the end of three rows, and their mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab_size, (4, 9))
    mask = (np.arange(9) < np.array([9, 6, 3, 7])[:, None]).astype(np.int64)
    return ids * mask, mask


def hf_beam_search(model, ids, mask, search: BeamSearch, eos: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """HF's sequences [B, R, NEW_TOKENS] (start token left out, 0 after EOS, as ours) and
    `sequences_scores` [B, R]."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
            max_new_tokens=NEW_TOKENS, num_beams=search.num_beams,
            length_penalty=search.length_penalty, early_stopping=search.early_stopping,
            no_repeat_ngram_size=search.no_repeat_ngram_size, min_length=search.min_length,
            num_return_sequences=search.num_return_sequences, eos_token_id=eos, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True)
    sequences = np.zeros((len(out.sequences), NEW_TOKENS), np.int64)
    for row, tokens in zip(sequences, out.sequences[:, 1:].numpy(), strict=True):
        end = list(tokens).index(eos) + 1 if eos in tokens else len(tokens)
        row[:end] = tokens[:end]  # HF fills a finished row with EOS or the pad id
    shape = (len(ids), search.num_return_sequences)
    return sequences.reshape(*shape, NEW_TOKENS), out.sequences_scores.numpy().reshape(shape)


def ends(sequences: np.ndarray, eos: int) -> set[int | None]:
    """The lengths of the outputs that end with EOS (None: cut at NEW_TOKENS)."""
    return {list(row).index(eos) + 1 if eos in row else None
            for row in sequences.reshape(-1, NEW_TOKENS)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (HF reference, our model converted from its folder, EOS)}; tensors moved by
    N(0, scale^2) so that the searches branch (at HF's init every step picks one token)."""
    out = {}
    for name, architecture, config, scale, eos in (
            ("t5", "T5ForConditionalGeneration", HF_T5, 0.5, T5_EOS),
            ("prophetnet", "ProphetNetForConditionalGeneration", HF_PROPHETNET, 1.0,
             PROPHETNET_EOS)):
        reference = hf_reference(architecture, 0, scale=scale, **config)
        folder = tmp_path_factory.mktemp(name)
        reference.save_pretrained(folder)
        out[name] = (reference, hf.load(folder, eos_token_id=eos), eos)
    return out


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("family", ["t5", "prophetnet"])
def test_beam_search_equals_hf_generate(converted, family):
    reference, model, eos = converted[family]
    ids, mask = sources(61, seed=1)
    endings = set()
    for name, search in SEARCHES.items():
        if family == "prophetnet" and name == "never":
            continue  # two settings suffice to check the cache of the second family
        expected, expected_scores = hf_beam_search(reference, ids, mask, search, eos)
        out = beam_search(model, ids, mask, max_new_tokens=NEW_TOKENS, search=search)
        np.testing.assert_array_equal(out.sequences, expected, err_msg=name)
        # The scores add up to NEW_TOKENS log-probabilities of weights moved by N(0, 1):
        # ProphetNet's came 1.1e-5 from HF's on one CPU and within 1e-5 on another.
        np.testing.assert_allclose(out.scores, expected_scores, rtol=1e-5, atol=3e-5,
                                   err_msg=name)
        endings |= ends(out.sequences, eos)
    assert None in endings and len(endings) >= 3, endings  # finished at several steps


# ---------------------------------------------------------- XLM: a Python re-statement
def python_beam_search(log_probs, batch: int, search: BeamSearch, start: int, eos: int,
                       pad: int) -> tuple[np.ndarray, np.ndarray]:
    """HF's beam search (generation/utils.py `_beam_search`) re-stated per source with lists:
    `log_probs(prefixes)` gives the next-token log-probabilities [len(prefixes), V] of token
    lists (start token first). Returns the sequences [batch, R, NEW_TOKENS] (`pad` after EOS)
    and their scores, best first."""
    k, penalty = search.num_beams, np.float32(search.length_penalty)
    beams = [[([start], np.float32(0.0 if j == 0 else -1e9)) for j in range(k)]
             for _ in range(batch)]
    hypotheses: list[list[tuple[np.float32, list[int]]]] = [[] for _ in range(batch)]
    closed = [False] * batch
    for step in range(NEW_TOKENS):
        scores = log_probs([tokens for source in beams for tokens, _ in source])
        vocab, n = scores.shape[1], search.no_repeat_ngram_size
        last = step + 1 == NEW_TOKENS
        for b, source in enumerate(beams):
            candidates = []
            for j, (tokens, score) in enumerate(source):
                row = scores[b * k + j].copy()
                if len(tokens) < search.min_length:
                    row[eos] = -np.inf
                if n and len(tokens) >= n:
                    seen = {tuple(tokens[i:i + n - 1]): [] for i in range(len(tokens) - n + 1)}
                    for i in range(len(tokens) - n + 1):
                        seen[tuple(tokens[i:i + n - 1])].append(tokens[i + n - 1])
                    row[seen.get(tuple(tokens[len(tokens) - n + 1:]), [])] = -np.inf
                candidates += [(score + row[v], j * vocab + v, tokens + [v])
                               for v in range(vocab)]
            candidates = sorted(candidates, key=lambda c: (-c[0], c[1]))[:2 * k]
            over = [c[2][-1] == eos or last for c in candidates]
            full = len(hypotheses[b]) == k and search.early_stopping is True
            if not (closed[b] or full):
                hypotheses[b] += [(c[0] / np.float32(step + 1) ** penalty, c[2])
                                  for rank, (c, o) in enumerate(zip(candidates, over, strict=True))
                                  if o and rank < k]
                hypotheses[b] = sorted(hypotheses[b], key=lambda h: -h[0])[:k]
            beams[b] = [(c[2], c[0]) for c, o in zip(candidates, over, strict=True) if not o][:k]
            if len(hypotheses[b]) == k and not last:
                reach = (NEW_TOKENS if search.early_stopping == "never" and penalty > 0
                         else step + 1)
                best = beams[b][0][1] / np.float32(reach) ** penalty
                closed[b] = closed[b] or best <= min(h[0] for h in hypotheses[b])
        if last or all(closed) or (search.early_stopping is True
                                   and all(len(h) == k for h in hypotheses)):
            break
    r = search.num_return_sequences
    sequences = np.full((batch, r, NEW_TOKENS), pad, np.int64)
    scores = np.zeros((batch, r), np.float32)
    for b, found in enumerate(hypotheses):
        for i, (score, tokens) in enumerate(found[:r]):
            sequences[b, i, :len(tokens) - 1], scores[b, i] = tokens[1:], score
    return sequences, scores


XLM = XLMTranslationConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                           intermediate_size=64, max_position_embeddings=32, n_langs=3,
                           embed_init_std=1.0, hidden_dropout=0.0, attention_dropout=0.0,
                           pad_token_id=2, eos_token_id=36)


@pytest.fixture(scope="module")
def xlm():
    return random_model(XLMTranslation, XLM, 4)


def no_cache_log_probs(model, ids, mask, source_languages, target_languages, k: int):
    """`log_probs(prefixes)` for `python_beam_search`: the decoder recomputed over each prefix
    (every decoder input a token, as generation counts them), no cache."""
    encoded = model.encode(jnp.asarray(ids), jnp.asarray(mask),
                           language_ids=jnp.asarray(source_languages))
    encoded, mask = jnp.repeat(encoded, k, axis=0), jnp.repeat(jnp.asarray(mask), k, axis=0)
    languages = jnp.repeat(jnp.asarray(target_languages)[:, None], k, axis=0)

    @nnx.jit
    def last_log_probs(model, buffer, length):
        hidden = model.decode(buffer, encoded, mask, jnp.ones_like(buffer),
                              language_ids=jnp.broadcast_to(languages, buffer.shape))
        return jax.nn.log_softmax(model.logits(hidden)[jnp.arange(len(buffer)), length - 1])

    def log_probs(prefixes):
        buffer = np.zeros((len(prefixes), NEW_TOKENS), np.int32)
        for row, tokens in zip(buffer, prefixes, strict=True):
            row[:len(tokens)] = tokens
        return np.asarray(last_log_probs(model, jnp.asarray(buffer), len(prefixes[0])))

    return log_probs


@pytest.mark.parametrize("name", ["plain", "never"])
def test_xlm_beam_search_equals_a_python_restatement_on_uncached_logits(xlm, name):
    search = SEARCHES[name]
    ids, mask = sources(XLM.vocab_size, seed=2)
    source_languages, target_languages = np.zeros_like(ids), np.array([1, 2, 1, 2])
    out = beam_search(xlm, ids, mask, max_new_tokens=NEW_TOKENS, search=search,
                      source_language_ids=source_languages,
                      target_language_ids=target_languages, pad_id=XLM.pad_token_id)
    log_probs = no_cache_log_probs(xlm, ids, mask, source_languages, target_languages,
                                   search.num_beams)
    expected, scores = python_beam_search(log_probs, len(ids), search, XLM.eos_token_id,
                                          XLM.eos_token_id, XLM.pad_token_id)
    np.testing.assert_array_equal(out.sequences, expected)
    np.testing.assert_allclose(out.scores, scores, rtol=1e-5, atol=1e-5)
    assert len(ends(expected, XLM.eos_token_id)) >= 3


# ------------------------------------------------------------- the cache, the settings
def t5_with_languages() -> T5:
    return random_model(T5, T5Config(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                                     head_size=8, intermediate_size=24, num_languages=2,
                                     hidden_dropout=0.0, attention_dropout=0.0), 5)


def prophetnet() -> ProphetNet:
    return random_model(ProphetNet, ProphetNetConfig(
        vocab_size=40, hidden_size=16, num_encoder_layers=1, num_decoder_layers=2,
        num_encoder_attention_heads=2, num_decoder_attention_heads=2, encoder_ffn_dim=24,
        decoder_ffn_dim=24, max_position_embeddings=40, num_buckets=8, relative_max_distance=6,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0), 6)


def xlm_with_cross_outputs_per_language() -> XLMTranslation:
    return random_model(XLMTranslation, dataclasses.replace(XLM, cross_output_per_language=True),
                        7)


@pytest.mark.parametrize("family", ["t5", "prophetnet", "xlm", "xlm_per_language"])
def test_decode_step_through_the_cache_equals_the_full_decoder(family, xlm):
    """Feeding the decoder inputs one at a time through `prefill_decoder` / `decode_step` gives
    `logits(decode(...))` at every position (ProphetNet: stream 0 beside the cached main
    stream, across log-spaced buckets; T5 and XLM with language embeddings, a language per
    row; XLM also with MASS's cross-attention output per language)."""
    model = {"t5": t5_with_languages, "prophetnet": prophetnet,
             "xlm_per_language": xlm_with_cross_outputs_per_language}.get(family, lambda: xlm)()
    ids, mask = map(jnp.asarray, sources(40, seed=3))
    decoder_ids = jnp.asarray(np.random.default_rng(4).integers(3, 40, (4, 11)))
    languages = family != "prophetnet"
    row_languages = jnp.arange(len(ids)) % (2 if family == "t5" else 3)  # [B]

    def target(ids: jax.Array) -> dict[str, jax.Array]:
        rows = row_languages.reshape(-1, *[1] * (ids.ndim - 1))
        return {"language_ids": jnp.broadcast_to(rows, ids.shape)} if languages else {}

    graphdef, params = nnx.split(model)

    @jax.jit
    def full_and_cached(params):
        model = nnx.merge(graphdef, params)
        encoded = model.encode(ids, mask, **target(ids))
        full = model.logits(model.decode(decoder_ids, encoded, mask,
                                         jnp.ones_like(decoder_ids), **target(decoder_ids)))

        def step(carry, t):
            cache, params = carry
            logits, cache = nnx.merge(graphdef, params).decode_step(
                decoder_ids[:, t], t, cache, **target(decoder_ids[:, t]))
            return (cache, params), logits

        cache = model.prefill_decoder(encoded, mask, decoder_ids.shape[1])
        steps = jax.lax.scan(step, (cache, params), jnp.arange(decoder_ids.shape[1]))[1]
        return full, jnp.swapaxes(steps, 0, 1)

    full, cached = full_and_cached(params)
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=0)


def test_settings_change_the_outputs_as_they_should(converted):
    """Negative controls on the T5 of the HF check: a lower length penalty prefers the shorter
    hypotheses; without the n-gram ban the outputs repeat bigrams, with it none does; without
    the minimum length some output is shorter, with it none is."""
    _, model, eos = converted["t5"]
    ids, mask = sources(61, seed=1)

    def search(**settings):
        return beam_search(model, ids, mask, max_new_tokens=NEW_TOKENS,
                           search=dataclasses.replace(SEARCHES["plain"], **settings))

    def lengths(out):
        return [list(row).index(eos) + 1 if eos in row else NEW_TOKENS
                for row in out.sequences[:, 0]]

    short, long = search(length_penalty=-1.0), search(length_penalty=2.0)
    assert (short.sequences != long.sequences).any()
    assert sum(lengths(short)) < sum(lengths(long))

    def repeats(out) -> int:
        count = 0
        for row in out.sequences.reshape(-1, NEW_TOKENS):
            tokens = [0, *row[:list(row).index(eos) + 1 if eos in row else NEW_TOKENS]]
            bigrams = list(zip(tokens, tokens[1:], strict=False))
            count += len(bigrams) - len(set(bigrams))
        return count

    assert repeats(search()) > 0 and repeats(search(no_repeat_ngram_size=2)) == 0
    assert min(lengths(search())) < 5 <= min(lengths(search(min_length=5)))


def test_bad_settings_are_refused_with_the_fix():
    for settings, message in (({"num_beams": 0}, "num_beams=0 must be >= 1"),
                              ({"num_return_sequences": 5}, "num_return_sequences=5 must be"),
                              ({"early_stopping": "sometimes"}, "True, False or 'never'"),
                              ({"no_repeat_ngram_size": -1}, "must be >= 0")):
        with pytest.raises(UserError, match=message):
            BeamSearch(**settings)
