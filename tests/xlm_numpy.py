"""A plain numpy (float64) re-statement of the reference's XLM Transformer, one side of it, for
the parity tests of `models.xlm`: facebookresearch/XLM src/model/transformer.py
`TransformerModel.fwd` as MASS-unsupNMT/src/model/transformer.py extends it (a decoder's
encoder-attention with one output projection per language, chosen by `langs.max()`;
`enc_mask`), re-stated from reading it, with our parameter names."""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx


def flat(module: nnx.Module) -> dict[tuple, np.ndarray]:
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def layer_norm(x, p, eps):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def linear(x, p):
    return x @ p["kernel"] + p["bias"]


def multi_head(x, kv, q, k, v, o, allowed, heads, language=None):
    """Softmax(q k^T / sqrt(d)) v per head over the `allowed` [B, T, S] keys, then `o` (with
    `language` [B], the kernel's and bias's language block of the per-language outputs)."""
    b, t, h = x.shape
    split = lambda y: y.reshape(b, -1, heads, h // heads).transpose(0, 2, 1, 3)  # noqa: E731
    scores = split(linear(x, q)) @ split(linear(kv, k)).transpose(0, 1, 3, 2) / math.sqrt(
        h // heads)
    scores = np.where(allowed[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = (weights @ split(linear(kv, v))).transpose(0, 2, 1, 3).reshape(b, t, h)
    if language is None:
        return linear(context, o)
    return np.stack([linear(context[i], {"kernel": o["kernel"][:, g * h:(g + 1) * h],
                                         "bias": o["bias"][g * h:(g + 1) * h]})
                     for i, g in enumerate(language)])


def numpy_xlm(params, config, ids, langs, mask, *, causal, positions=None, encoded=None,
              source_mask=None, cross_output_language=None):
    """(hidden [B, T, H], logits [B, T, V]) of one side: (token + position + language)
    embeddings, LayerNorm, zero padding; per layer self-attention (causal: triangular) -> + ->
    LN1, for a decoder encoder-attention over `encoded` at `source_mask` -> + -> LN15 (with
    `cross_output_language` [B], each row's output is that language's block of the
    per-language outputs; the reference passes `langs.max()`), FFN (GELU) -> + -> LN2, zero
    padding; then the tied prediction layer. `mask` [B, T] marks the tokens (the reference's
    `lengths`), `positions` [B, T] default 0 .. T - 1."""
    tree: dict = {}
    for path, value in params.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = np.asarray(value, np.float64)
    eps, heads = config.layer_norm_eps, config.num_heads
    mask = np.asarray(mask, bool)
    length = ids.shape[1]
    positions = np.arange(length)[None] if positions is None else positions
    x = (tree["word_embeddings"]["embedding"][ids]
         + tree["position_embeddings"]["embedding"][positions]
         + tree["lang_embeddings"]["embedding"][langs])
    x = layer_norm(x, tree["embedding_layer_norm"], eps) * mask[..., None]
    self_allowed = (np.tril(np.ones((length, length), bool))[None] & mask[:, None, :] if causal
                    else np.broadcast_to(mask[:, None, :], (len(ids), length, length)))
    if encoded is not None:
        cross = np.broadcast_to(np.asarray(source_mask, bool)[:, None, :],
                                (len(ids), length, source_mask.shape[1]))
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))
    for i in range(config.num_layers):
        p = jax.tree.map(lambda a, i=i: a[i], tree["layers"])
        x = layer_norm(x + multi_head(x, x, p["query"], p["key"], p["value"],
                                      p["attention_output"], self_allowed, heads),
                       p["attention_layer_norm"], eps)
        if encoded is not None:
            x = layer_norm(x + multi_head(x, encoded, p["cross_query"], p["cross_key"],
                                          p["cross_value"], p["cross_output"], cross, heads,
                                          cross_output_language),
                           p["cross_layer_norm"], eps)
        x = layer_norm(x + linear(gelu(linear(x, p["intermediate"])), p["output"]),
                       p["output_layer_norm"], eps) * mask[..., None]
    return x, x @ tree["word_embeddings"]["embedding"].T + tree["output_bias"]
