"""Autoregressive generation with a key/value cache: greedy decoding and sampling with
temperature, top-k and top-p (nucleus, Holtzman et al. 2020), compiled once per shape.

Works with any model that has `prefill(ids, mask, cache_length) -> (logits, cache)` and
`decode(token, position, cache, index, key_mask) -> (logits, cache)` (models/gpt.py). The
prompt is run once (prefill), then one `jax.lax.while_loop` step per new token feeds the
previous token through the cache; all shapes are fixed (cache of prompt + max_new_tokens slots),
so one compilation serves every prompt of that padded length and every sampling setting (they
are traced scalars). Sampling keys are `fold_in(key(seed), step)`: deterministic for a seed.

Logit processing follows transformers' warpers in their order: temperature, then top-k (keep
the k largest, ties at the k-th kept), then top-p (keep the most probable tokens whose
cumulative probability before them is below p; at least one).

Encoder-decoders are decoded by `models.beam_search` (beam search, and greedy decoding as its
one-beam case).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: `greedy` (argmax) or a draw at `temperature` from the
    `top_k` (0 = all) most likely tokens, cut to the nucleus of mass `top_p` (1 = all)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.greedy and not self.temperature > 0:
            raise UserError(f"temperature {self.temperature} must be > 0; use --greedy for "
                            "argmax decoding")
        if self.top_k < 0:
            raise UserError(f"top-k {self.top_k} must be >= 0 (0 = no top-k cut)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p {self.top_p} must be in (0, 1] (1 = no nucleus cut)")


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
    """[B, V] logits -> float32 logits divided by `temperature`, with -inf outside the top-k
    and the top-p nucleus (one sort per row)."""
    scaled = logits.astype(jnp.float32) / temperature
    vocab = scaled.shape[-1]
    ranked = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranked = jnp.where(jnp.arange(vocab) < k, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = ((before < top_p) | (top_p >= 1.0)) & (jnp.arange(vocab) < k)
    kept = jnp.sum(keep, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(ranked, kept - 1, axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def choose(logits: jax.Array, key: jax.Array, greedy: jax.Array, temperature: jax.Array,
           top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The next token per row [B]: argmax when `greedy`, else a draw from the filtered logits."""
    drawn = jax.random.categorical(key, filter_logits(logits, temperature, top_k, top_p))
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)


@nnx.jit(static_argnames=("max_new_tokens",))
def _generate(model: Any, input_ids: jax.Array, attention_mask: jax.Array, key: jax.Array,
              settings: dict[str, jax.Array], eos_id: jax.Array, pad_id: jax.Array,
              max_new_tokens: int) -> jax.Array:
    batch, prompt = input_ids.shape
    logits, cache = model.prefill(input_ids, attention_mask, prompt + max_new_tokens)
    first_position = jnp.sum(attention_mask, axis=1)  # after the last real prompt token
    key_mask = jnp.concatenate([attention_mask.astype(bool),
                                jnp.zeros((batch, max_new_tokens), bool)], axis=1)

    def pick(logits: jax.Array, step: jax.Array, done: jax.Array) -> jax.Array:
        token = choose(logits, jax.random.fold_in(key, step), **settings)
        return jnp.where(done, pad_id, token)

    token = pick(logits, 0, jnp.zeros((batch,), bool))
    out = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)
    done = token == eos_id

    def more(state):
        step, *_, done, _ = state
        return (step < max_new_tokens) & ~jnp.all(done)

    graphdef, params = nnx.split(model)

    def body(state):
        step, token, out, cache, key_mask, done, params = state
        slot = prompt + step - 1  # where the previous token's keys and values go
        key_mask = key_mask.at[:, slot].set(True)
        # The parameters ride in the loop state: NNX refuses modules of the outer trace here.
        logits, cache = nnx.merge(graphdef, params).decode(
            token, first_position + step - 1, cache, slot, key_mask)
        token = pick(logits, step, done)
        return (step + 1, token, out.at[:, step].set(token), cache, key_mask,
                done | (token == eos_id), params)

    state = (jnp.int32(1), token, out, cache, key_mask, done, params)
    return jax.lax.while_loop(more, body, state)[2]


def generate(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray | None = None, *,
             max_new_tokens: int, sampling: Sampling = Sampling(), eos_id: int | None = None,
             pad_id: int = 0) -> np.ndarray:
    """New tokens [B, max_new_tokens] after left-padded prompts `input_ids` [B, P]
    (`attention_mask` 1 = token, 0 = left padding). A row stops at `eos_id` (kept) and is
    filled with `pad_id` after it; the loop ends when every row has stopped."""
    input_ids = np.asarray(input_ids, np.int32)
    mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask,
                                                                             np.int32)
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0 or not mask[:, -1].all():
        raise UserError("prompts must be a [batch, length] array, left-padded (the last "
                        "column all real tokens)")
    total = int(mask.sum(axis=1).max()) + max_new_tokens
    limit = model.config.max_position_embeddings
    if total > limit:
        raise UserError(f"prompt + max_new_tokens = {total} tokens exceeds the model's context "
                        f"of {limit}; shorten the prompt or lower max_new_tokens")
    settings = {"greedy": jnp.asarray(sampling.greedy),
                "temperature": jnp.float32(sampling.temperature if not sampling.greedy else 1.0),
                "top_k": jnp.int32(sampling.top_k), "top_p": jnp.float32(sampling.top_p)}
    out = _generate(model, jnp.asarray(input_ids), jnp.asarray(mask),
                    jax.random.key(sampling.seed), settings,
                    jnp.int32(-1 if eos_id is None else eos_id), jnp.int32(pad_id),
                    max_new_tokens=max_new_tokens)
    return np.asarray(out)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (ids, mask) [B, longest], padded on the left."""
    length = max(len(s) for s in sequences)
    ids = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for row, tokens in enumerate(sequences):
        if tokens:
            ids[row, length - len(tokens):] = tokens
            mask[row, length - len(tokens):] = 1
    return ids, mask


def generate_text(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int,
                  sampling: Sampling = Sampling(), stop_at_eos: bool = True) -> list[str]:
    """Each prompt followed by its continuation, decoded. An empty prompt starts from the
    end-of-text token (GPT-2's unconditional samples); generation stops at end-of-text when
    `stop_at_eos` (the token itself is not printed)."""
    encoded = [tokenizer.encode(p) or [tokenizer.eos_id] for p in prompts]
    ids, mask = left_pad(encoded, tokenizer.pad_id)
    new = generate(model, ids, mask, max_new_tokens=max_new_tokens, sampling=sampling,
                   eos_id=tokenizer.eos_id if stop_at_eos else None, pad_id=tokenizer.pad_id)
    texts = []
    for prompt, tokens, row in zip(prompts, encoded, new, strict=True):
        row = list(row)
        if stop_at_eos and tokenizer.eos_id in row:
            row = row[:row.index(tokenizer.eos_id)]
        start = tokens if prompt else []
        texts.append(tokenizer.decode([*start, *row]))
    return texts
