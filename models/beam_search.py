"""Beam search (and greedy decoding, its one-beam case) for encoder-decoders, with a key/value
cache, compiled once per shape and setting.

Works with any model that has `encode(input_ids, attention_mask, *, language_ids=None)`,
`prefill_decoder(encoded, attention_mask, length) -> DecoderCache` and `decode_step(token,
position, cache, *, language_ids=None) -> (logits, cache)`, and `config.decoder_start_token_id`
/ `config.eos_token_id` (models/t5.py, prophetnet.py, xlm.py `XLMTranslation`, prefix_lm.py
`PrefixLM`, whose cache's cross-attention slots hold its prefix; `language_ids` only for models
with language embeddings). The source is encoded once for B rows, its states
repeated for the B x num_beams beams; the cross-attention keys and values are computed once
(`prefill_decoder`); each step of one `jax.lax.while_loop` feeds every beam's last token
through the cached decoder and reorders the cached keys and values to the surviving beams.

The search is HF transformers' (generation/utils.py `_beam_search` and its helpers
`_get_top_k_continuations`, `_get_running_beams_for_next_iteration`, `_update_finished_beams`,
`_check_early_stop_heuristic`, `_beam_search_has_unfinished_sequences`; logits_process.py
`MinLengthLogitsProcessor`, `NoRepeatNGramLogitsProcessor`), re-stated on fixed buffers:

- the scores are log-softmax of the logits in float32, then the processors: `min_length` bans
  EOS while the sequence, decoder start token included, is shorter than `min_length` (so an
  output holds at least `min_length` tokens, EOS included); `no_repeat_ngram_size` n bans every
  token that would complete an n-gram already in the sequence (start token included);
- each source keeps `num_beams` running beams (at the start only beam 0 is live, the others
  score -1e9) and up to `num_beams` finished hypotheses. A step ranks the beams' summed scores
  over all beams x vocabulary and keeps the 2 x num_beams best candidates; a candidate ending in
  EOS or at `max_new_tokens` has finished. The best num_beams unfinished candidates run on; the
  finished ones among the first num_beams candidates join the hypotheses with the score
  sum / length ** `length_penalty` (length = new tokens, EOS included), keeping the best
  num_beams;
- `early_stopping`: True closes a source once it has num_beams hypotheses; False and "never"
  close it once the best running beam cannot beat the worst hypothesis, estimated at the
  current length (False) or, with a positive length penalty, at `max_new_tokens` ("never");
  the loop ends when every source is closed (True: every source full), or no candidate may
  continue.

Outputs are the best `num_return_sequences` hypotheses per source, best first, with their
scores (HF's `sequences_scores`); tokens after EOS are `pad_id`. tests/test_beam_search.py
checks them token for token and score for score against HF `generate(num_beams=...)` for T5
and ProphetNet, and against a Python re-statement for XLM's encoder-decoder.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError

PENALTY = -1.0e9  # HF's score for ruled-out beams and empty hypothesis slots


@dataclasses.dataclass(frozen=True)
class BeamSearch:
    """How to search (the names and meanings of HF `generate`'s arguments)."""

    num_beams: int = 4
    length_penalty: float = 1.0
    """A hypothesis scores sum(log p) / length ** length_penalty (> 0 favours longer ones)."""
    early_stopping: bool | str = False
    """True, False or "never" (see the module docstring)."""
    no_repeat_ngram_size: int = 0
    """Ban a token that would repeat an n-gram of this size; 0 = off."""
    min_length: int = 0
    """Outputs hold at least this many tokens, EOS included (EOS is banned before)."""
    num_return_sequences: int = 1
    """Hypotheses returned per source, best first (at most num_beams)."""

    def __post_init__(self) -> None:
        if self.num_beams < 1:
            raise UserError(f"num_beams={self.num_beams} must be >= 1 (1 = greedy)")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise UserError(f"num_return_sequences={self.num_return_sequences} must be in 1 .. "
                            f"num_beams={self.num_beams}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise UserError(f"early_stopping={self.early_stopping!r} must be True, False or "
                            "'never'")
        if self.no_repeat_ngram_size < 0 or self.min_length < 0:
            raise UserError("no_repeat_ngram_size and min_length must be >= 0 (0 = off)")


GREEDY = BeamSearch(num_beams=1, early_stopping=True)
"""One beam that stops at its first EOS: HF's greedy decoding, token for token."""


@dataclasses.dataclass(frozen=True)
class Decoded:
    """`sequences` [B, R, max_new_tokens] (the decoder start token left out, `pad_id` after
    EOS) and their `scores` [B, R] (HF's `sequences_scores`), best first."""

    sequences: np.ndarray
    scores: np.ndarray


def repeated_ngrams(sequences: jax.Array, length: jax.Array, n: jax.Array, vocab_size: int
                    ) -> jax.Array:
    """[N, V] bool: the tokens that would repeat an n-gram (n >= 1, traced) of
    `sequences[:, :length]` [N, L]: each n-gram there whose first n - 1 tokens equal the last
    n - 1 bans its last token. Window j holds tokens j .. j + n - 1."""
    count, width = sequences.shape
    padded = jnp.pad(sequences, ((0, 0), (0, width)))  # every window start in 0 .. L - 1
    match = jnp.broadcast_to(jnp.arange(width) <= length - n, (count, width))  # decoded windows

    def same(i: jax.Array, match: jax.Array) -> jax.Array:
        suffix = jax.lax.dynamic_slice_in_dim(padded, length - (n - 1) + i, 1, axis=1)
        return match & (jax.lax.dynamic_slice_in_dim(padded, i, width, axis=1) == suffix)

    match = jax.lax.fori_loop(0, n - 1, same, match)
    last = jax.lax.dynamic_slice_in_dim(padded, n - 1, width, axis=1)
    banned = jnp.where(match, last, vocab_size)  # vocab_size: a spare column
    rows = jnp.arange(count)[:, None]
    return jnp.zeros((count, vocab_size + 1), bool).at[rows, banned].set(True)[:, :vocab_size]


def _gather(values: jax.Array, indices: jax.Array) -> jax.Array:
    """values [B, K, ...] at beam `indices` [B, J] -> [B, J, ...]."""
    indices = indices.reshape(*indices.shape, *(1,) * (values.ndim - 2))
    return jnp.take_along_axis(values, indices, axis=1)


def _languages(ids: jax.Array | None) -> dict[str, jax.Array]:
    """The `language_ids` keyword, passed only when there are language ids."""
    return {} if ids is None else {"language_ids": ids}


@nnx.jit(static_argnames=("max_new_tokens", "num_beams"))
def _beam_search(model: Any, input_ids: jax.Array, attention_mask: jax.Array,
                 source_languages: jax.Array | None, target_languages: jax.Array | None,
                 settings: dict[str, jax.Array], eos_id: jax.Array, pad_id: jax.Array, *,
                 max_new_tokens: int, num_beams: int) -> tuple[jax.Array, jax.Array]:
    batch, k = input_ids.shape[0], num_beams
    length_penalty, ngram = settings["length_penalty"], settings["no_repeat_ngram_size"]
    rows = batch * k
    encoded = model.encode(input_ids, attention_mask, **_languages(source_languages))
    cache = model.prefill_decoder(jnp.repeat(encoded, k, axis=0),
                                  jnp.repeat(attention_mask, k, axis=0), max_new_tokens)
    languages = None if target_languages is None else jnp.repeat(target_languages, k)
    # sequences[..., t] is the decoder input at position t: the start token, then the output.
    start = jnp.full((batch, k, max_new_tokens + 1), pad_id, jnp.int32).at[..., 0].set(
        model.config.decoder_start_token_id)
    candidates_first = jnp.arange(2 * k) < k  # HF's `top_num_beam_mask`
    graphdef, params = nnx.split(model)

    def more(state):
        step, go = state[0], state[1]
        return (step < max_new_tokens) & go

    def body(state):
        (step, _, running, running_scores, finished, finished_scores, finished_done,
         improvable, cache, params) = state
        model = nnx.merge(graphdef, params)  # parameters ride in the loop state (NNX)
        logits, cache = model.decode_step(running[..., step].reshape(rows), step, cache,
                                          **_languages(languages))
        scores = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [rows, V]
        vocab = scores.shape[-1]
        length = step + 1  # tokens in each running sequence, start token included
        scores = jnp.where((length < settings["min_length"]) & (jnp.arange(vocab) == eos_id),
                           -jnp.inf, scores)
        scores = jax.lax.cond(
            ngram > 0, lambda: jnp.where(repeated_ngrams(running.reshape(rows, -1), length,
                                                         ngram, vocab), -jnp.inf, scores),
            lambda: scores)
        total = (scores.reshape(batch, k, vocab) + running_scores[..., None]).reshape(batch, -1)
        top_scores, top = jax.lax.top_k(total, 2 * k)
        parents, tokens = top // vocab, (top % vocab).astype(jnp.int32)
        extended = _gather(running, parents).at[..., step + 1].set(tokens)
        ended = (tokens == eos_id) | (step + 1 >= max_new_tokens)

        # The best k candidates still running continue.
        open_scores = top_scores + ended.astype(jnp.float32) * PENALTY
        keep = jax.lax.top_k(open_scores, k)[1]
        running, running_scores = _gather(extended, keep), _gather(open_scores, keep)
        parents = _gather(parents, keep)

        # Ended candidates among the first k join the hypotheses, unless the source is closed.
        normalized = top_scores / (length.astype(jnp.float32) ** length_penalty)
        full = jnp.all(finished_done, axis=1, keepdims=True) & settings["stop_when_full"]
        normalized = normalized + full.astype(jnp.float32) * PENALTY
        normalized = normalized + (~improvable).astype(jnp.float32) * PENALTY
        joins = ended & candidates_first
        normalized = normalized + (~joins).astype(jnp.float32) * PENALTY
        best = jax.lax.top_k(jnp.concatenate([finished_scores, normalized], axis=1), k)[1]
        finished = _gather(jnp.concatenate([finished, extended], axis=1), best)
        finished_scores = _gather(jnp.concatenate([finished_scores, normalized], axis=1), best)
        finished_done = _gather(jnp.concatenate([finished_done, joins], axis=1), best)

        cache = cache.reorder((jnp.arange(batch)[:, None] * k + parents).reshape(rows))

        # Can a running beam still beat the worst hypothesis?
        reach = jnp.where(settings["never"] & (length_penalty > 0), max_new_tokens, length)
        best_running = running_scores[:, :1] / (reach.astype(jnp.float32) ** length_penalty)
        worst = jnp.where(finished_done, jnp.min(finished_scores, axis=1, keepdims=True),
                          PENALTY)
        improvable = improvable & jnp.any(best_running > worst, axis=1, keepdims=True)
        go = (jnp.any(improvable) & ~(jnp.all(finished_done) & settings["stop_when_full"])
              & ~jnp.all(ended))
        return (step + 1, go, running, running_scores, finished, finished_scores,
                finished_done, improvable, cache, params)

    state = (jnp.int32(0), jnp.bool_(True), start,
             jnp.zeros((batch, k), jnp.float32).at[:, 1:].set(PENALTY), start,
             jnp.full((batch, k), PENALTY, jnp.float32), jnp.zeros((batch, k), bool),
             jnp.ones((batch, 1), bool), cache, params)
    state = jax.lax.while_loop(more, body, state)
    return state[4][..., 1:], state[5]


def _as_ids(ids: np.ndarray | None) -> jax.Array | None:
    return None if ids is None else jnp.asarray(np.asarray(ids, np.int32))


def beam_search(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
                *, max_new_tokens: int, search: BeamSearch = BeamSearch(),
                source_language_ids: np.ndarray | None = None,
                target_language_ids: np.ndarray | None = None, pad_id: int = 0) -> Decoded:
    """The best `search.num_return_sequences` outputs of an encoder-decoder `model` for the
    sources `input_ids` [B, S] (`attention_mask` 1 = token; default all tokens), at most
    `max_new_tokens` tokens each, ending at `model.config.eos_token_id`.
    `source_language_ids` [B, S] and `target_language_ids` [B] (one language per output) are
    for models with language embeddings only. Equal to HF `generate(num_beams=...,
    length_penalty=..., early_stopping=..., no_repeat_ngram_size=..., min_length=...,
    num_return_sequences=..., max_new_tokens=...)` (tests/test_beam_search.py)."""
    input_ids = np.asarray(input_ids, np.int32)
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise UserError("sources must be a [batch, length] array of token ids")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be at least 1")
    mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask,
                                                                             np.int32)
    settings = {"length_penalty": jnp.float32(search.length_penalty),
                "min_length": jnp.int32(search.min_length),
                "no_repeat_ngram_size": jnp.int32(search.no_repeat_ngram_size),
                "stop_when_full": jnp.bool_(search.early_stopping is True),
                "never": jnp.bool_(search.early_stopping == "never")}
    sequences, scores = _beam_search(
        model, jnp.asarray(input_ids), jnp.asarray(mask), _as_ids(source_language_ids),
        _as_ids(target_language_ids), settings, jnp.int32(model.config.eos_token_id),
        jnp.int32(pad_id), max_new_tokens=max_new_tokens, num_beams=search.num_beams)
    returned = search.num_return_sequences
    return Decoded(np.asarray(sequences[:, :returned]), np.asarray(scores[:, :returned]))


def greedy_seq2seq(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
                   *, max_new_tokens: int, source_language_ids: np.ndarray | None = None,
                   target_language_ids: np.ndarray | None = None, pad_id: int = 0
                   ) -> np.ndarray:
    """Greedy output tokens [B, max_new_tokens]: `beam_search` with one beam that stops at its
    first EOS (`GREEDY`), the same tokens as HF `generate(do_sample=False, num_beams=1)`
    (tests/test_translation.py); arguments as `beam_search`."""
    return beam_search(model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                       search=GREEDY, source_language_ids=source_language_ids,
                       target_language_ids=target_language_ids, pad_id=pad_id).sequences[:, 0]
