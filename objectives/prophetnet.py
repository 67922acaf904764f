"""ProphetNet (method `prophetnet`): future n-gram prediction with the n-stream decoder (Qi et al.
2020, §2.2-2.3, §3; reference microsoft/ProphetNet `ngram_criterions.py` and HF
`ProphetNetForConditionalGeneration._compute_loss`), pre-trained on MASS-style span masking.

Loss. Predicting stream s at decoder position t reads the main stream up to t - s and predicts
token t (`models.prophetnet`), i.e. the token s + 1 ahead of its context: each stream's targets
are the labels themselves, the shift by the stream index being the attention layout's. The loss
is one cross-entropy over every stream's target tokens, divided by their number: the paper's
weights alpha_j (§2.2, Eq. 3) are all equal in the reference criterion and in HF, which we
follow. `label_smoothing` is HF's and the reference's `eps`: (1 - eps) x NLL + eps / V x the
sum over the vocabulary of -log p, per target token. `disable_ngram_loss` keeps stream 0 only
(a plain next-token loss).

Data. §3 pre-trains as MASS does: a contiguous span of 15% of the tokens is masked in the
encoder input (80/10/10) and the decoder predicts it. The records, the span and the decoder
inputs are MASS's (`input_pipeline.examples.mass`,
`objectives.common.masked_span.prepare_mass`), with the span's start uniform (the paper:
"randomly pick a starting position u"). The decoder inputs keep the segment's length, the span
shifted right at its own positions and [MASK] elsewhere, so the learned positions are the
sentence's, as the paper's. The one adaptation: stream s >= 1 at the
first s positions of the span would read only [MASK] inputs before the span, so, as the
reference criterion does with its `target_idx` (stream s only predicts span tokens at index >= s
within the span), stream s counts target t only where t - s is also a target
(`streams_within_span`; off, the loss is HF's).

Not done: the paper packs 512-token inputs with one span per 64-token block; segments here are
the corpus's sentences (MASS's records), one span each.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import mass as mass_examples
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.prophetnet import PAD_ID, ProphetNet, ProphetNetConfig
from pretext_jax.objectives.common.losses import smoothed_nll
from pretext_jax.objectives.common.masked_span import prepare_mass
from pretext_jax.objectives.common.preset_parts import NO_DROPOUT, TINY_TEXT_OPTIM, TINY_TEXT_TRAIN
from pretext_jax.objectives.registry import (
    Batch,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
)


@dataclasses.dataclass(frozen=True)
class ProphetNetLossSettings:
    """The future n-gram loss's settings (HF `ProphetNetConfig.eps`, `disable_ngram_loss`)."""

    label_smoothing: float = 0.0
    """Label smoothing eps in [0, 1) (HF `eps` 0.0; the reference's fine-tuning uses 0.1)."""
    disable_ngram_loss: bool = False
    """Train stream 0 only (next-token prediction), as HF's and the reference's flag."""
    streams_within_span: bool = True
    """Stream s predicts target t only if t - s is a target too (the reference's target_idx)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"objective.label_smoothing={self.label_smoothing} must be in [0, 1)")


def stream_weights(targets: jax.Array, ngram: int, objective: ProphetNetLossSettings
                   ) -> jax.Array:
    """[B, ngram, T] float32: which target tokens (non-0 `targets` [B, T]) each stream predicts
    (see the module docstring)."""
    present = targets != PAD_ID
    weights = []
    for s in range(ngram):
        w = present & (s == 0 or not objective.disable_ngram_loss)
        if objective.streams_within_span and s > 0:
            before = jnp.pad(present[:, :-s], ((0, 0), (s, 0)))  # present[t - s]
            w = w & before
        weights.append(w)
    return jnp.stack(weights, axis=1).astype(jnp.float32)


def ngram_loss(ngram_logits: jax.Array, targets: jax.Array, objective: ProphetNetLossSettings
               ) -> tuple[jax.Array, Metrics]:
    """The future n-gram loss of `ngram_logits` [B, ngram, T, V] on `targets` [B, T] (0 = no
    target), float32, and its metrics: the loss, and stream 0's (next-token) cross-entropy and
    accuracy, as exact sums."""
    log_probs = jax.nn.log_softmax(ngram_logits.astype(jnp.float32), axis=-1)
    labels = jnp.broadcast_to(targets[:, None, :], log_probs.shape[:3])
    per_token, nll = smoothed_nll(log_probs, labels, objective.label_smoothing)
    weights = stream_weights(targets, ngram_logits.shape[1], objective)
    total = jnp.sum(weights)
    loss = jnp.sum(weights * per_token) / jnp.maximum(total, 1.0)
    first = weights[:, 0]
    correct = (jnp.argmax(log_probs[:, 0], axis=-1) == targets).astype(jnp.float32)
    return loss, {"loss": (jnp.sum(weights * per_token), total),
                  "next_token_loss": (jnp.sum(first * nll[:, 0]), jnp.sum(first)),
                  "next_token_accuracy": (jnp.sum(first * correct), jnp.sum(first))}


def prophetnet_loss(model: ProphetNet, batch: Batch, rng: jax.Array | None, *,
                    objective: ProphetNetLossSettings | None = None
                    ) -> tuple[jax.Array, Metrics]:
    """The future n-gram loss of every stream's predictions of the span (`targets`) from the
    masked segment (`inputs`, `input_mask`) and the MASS decoder inputs; `rng=None` is
    evaluation, `objective` None the defaults."""
    objective = objective or ProphetNetLossSettings()
    out = model(batch["inputs"], batch["input_mask"], batch["decoder_inputs"], rng=rng)
    loss, metrics = ngram_loss(out.ngram_logits, batch["targets"], objective)
    targets, inputs = batch["targets"], batch["input_mask"]
    rows = jnp.float32(targets.shape[0])
    return loss, {**metrics,
                  "target_tokens": (jnp.sum((targets != PAD_ID).astype(jnp.float32)), rows),
                  "input_tokens": (jnp.sum(inputs.astype(jnp.float32)), rows)}


def prepare_prophetnet(data: DataConfig, examples: mass_examples.MassExampleConfig,
                       cache_dir: Path, seed: int) -> PreparedData:
    """MASS's span-masking records of one monolingual corpus (ProphetNet has no language
    embeddings, so a bilingual `LANG=SOURCE` corpus is refused)."""
    if mass_examples.language_corpora(data.source) is not None:
        raise UserError(f"ProphetNet has no language embeddings; give one corpus as "
                        f"data.source, not languages ({data.source})")
    return prepare_mass(data, examples, cache_dir, seed)


def check_prophetnet(model: ProphetNetConfig, examples: mass_examples.MassExampleConfig,
                     objective: ProphetNetLossSettings | None = None) -> None:
    """Segments must fit the learned positions (the predicting streams use position T + 1),
    and the decoder start token must be the one the MASS decoder inputs begin with."""
    del objective
    if examples.max_seq_length > model.max_length:
        raise UserError(f"examples.max_seq_length={examples.max_seq_length} needs "
                        f"model.max_position_embeddings >= {examples.max_seq_length + 2}; "
                        "raise it or lower examples.max_seq_length")
    if model.decoder_start_token_id != mass_examples.DECODER_START:
        raise UserError(f"model.decoder_start_token_id={model.decoder_start_token_id}; the MASS "
                        f"decoder inputs start with {mass_examples.DECODER_START}, set it so")


# The span masking of §3 on MASS's records: 15% of a segment, start uniform, 80/10/10.
SPAN_MASKING = {"fragment_fraction": 0.15, "fragment_counts_sentence_start": False,
                "fragment_at_start_prob": 0.0, "fragment_at_end_prob": 0.0,
                "mask_token_prob": 0.8, "random_token_prob": 0.1}

# ProphetNet pre-trained on the 16GB corpus (Qi et al. 2020 §3, §4.1; the microsoft/ProphetNet
# README's ProphetNet-En-16GB, the same size as ProphetNet-large): 12 + 12 layers of width 1024,
# FFN 4096, 16 heads, GELU, n = 2, 32 buckets up to 128, 512 positions; Adam at lr 3e-4, 1,024
# sequences per batch, 500K steps; spans of 15% with one span per 64 tokens. Not in the paper,
# taken from the reference's fine-tuning recipe (README: fairseq Adam b2 0.999, weight decay
# 0.01, clipping 0.1, dropout 0.1, fairseq's inverse_sqrt from --warmup-init-lr 1e-07): those
# settings; warmup 10,000 steps is our choice (the paper gives none).
# Inputs are a document's consecutive sentences with one 15% span in every 64-token block
# (`examples.pack_sentences`, `examples.fragment_block`), 510 tokens long: the paper's 512 less
# the two positions the 512 learned ones reserve (HF's checkpoints: positions 1 .. T + 1
# below 512). Departure: a
# sentencepiece vocabulary of 30,522 pieces trained on the corpus instead of BERT's uncased
# WordPiece (give BERT's vocab.txt as data.tokenizer for the reference's).
PRESETS = {
    "prophetnet_tiny": {
        "model": {"hidden_size": 64, "num_encoder_layers": 2, "num_decoder_layers": 2,
                  "num_encoder_attention_heads": 4, "num_decoder_attention_heads": 4,
                  "encoder_ffn_dim": 256, "decoder_ffn_dim": 256,
                  "max_position_embeddings": 128, "vocab_size": 0, "eos_token_id": 0,
                  **NO_DROPOUT, "activation_dropout": 0.0},
        "examples": {"max_seq_length": 64, **SPAN_MASKING},
        "data": {"vocab_size": 4000},
        # Adam at 1e-2: with a 15% span there are few targets per row, and at 2e-3 the
        # held-out loss of the suite's 40-step run falls by 0.4 only (1e-2: by 0.9).
        "optim": {**TINY_TEXT_OPTIM, "learning_rate": 1e-2},
        "train": TINY_TEXT_TRAIN,
    },
    "prophetnet_base": {
        "model": {"hidden_size": 1024, "num_encoder_layers": 12, "num_decoder_layers": 12,
                  "num_encoder_attention_heads": 16, "num_decoder_attention_heads": 16,
                  "encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096, "hidden_act": "gelu",
                  "max_position_embeddings": 512, "ngram": 2, "num_buckets": 32,
                  "relative_max_distance": 128, "hidden_dropout": 0.1,
                  "attention_dropout": 0.1, "activation_dropout": 0.1, "vocab_size": 0,
                  "eos_token_id": 0},
        "examples": {"max_seq_length": 510, "min_length": 5, "pack_sentences": True,
                     "fragment_block": 64, **SPAN_MASKING},
        "data": {"vocab_size": 30522},
        "optim": {"optimizer": "adamw", "learning_rate": 3e-4, "schedule": "inverse_sqrt_warmup",
                  "warmup_steps": 10000, "warmup_init_learning_rate": 1e-7,
                  "b1": 0.9, "b2": 0.999, "eps": 1e-8,
                  "bias_correction": True, "eps_before_bias_correction": True,
                  "weight_decay": 0.01, "decay_norms_and_biases": True, "clip_norm": 0.1},
        "train": {"steps": 500000, "batch_size": 1024},
    },
}


register(Method(
    name="prophetnet",
    model_config=ProphetNetConfig,
    example_config=mass_examples.MassExampleConfig,
    objective_config=ProphetNetLossSettings,
    build_model=lambda config, seed: ProphetNet(config, rngs=nnx.Rngs(seed)),
    loss=prophetnet_loss,
    prepare=prepare_prophetnet,
    units_per_example=lambda examples: examples.max_seq_length,
    description="ProphetNet future n-gram prediction with the n-stream decoder, on MASS-style "
                "span masking (Qi et al. 2020)",
    presets=PRESETS,
    resolution=Resolution(check=check_prophetnet),
    start=Start(hf_models=(ProphetNet,)),
))
