"""MASS: masked sequence-to-sequence pre-training (Song et al. 2019, §2.2, §3.1; reference
microsoft/MASS MASS-unsupNMT), on the T5 encoder-decoder of `models.t5` (method `mass`) or on
the reference's model, XLM's encoder-decoder of `models.xlm` (method `mass_xlm`, preset
`mass_base`, below).

Each segment's encoder input has a consecutive fragment of about half its tokens masked
(80/10/10) and the decoder predicts exactly that fragment from its shifted-right tokens, every
other decoder position being [MASK]; the loss is cross-entropy on the fragment's tokens only
(`objectives.common.losses.encoder_decoder_loss`). The masks, the fragment and the positions are
built in `input_pipeline.examples.mass`, whose docstring says how T5's relative positions keep
the paper's positions.

Bilingual pre-training (§3.1, unsupervised NMT): with `data.source=en=SOURCE,de=SOURCE` the
segments of each language carry its id, the model gets a language embedding per language
(`model.num_languages`, from the data) added to the token embeddings of encoder and decoder,
and each training step reads one language, drawn as MASS-unsupNMT draws its `--mass_steps`
(`mass_examples` docstring). Preset `mass_bilingual_tiny`.

The reference's model (method `mass_xlm`; MASS-unsupNMT/src/model/transformer.py and
src/trainer.py `mass_step`): `models.xlm.XLMTranslation`, an XLM encoder and an XLM decoder
(post-LN, learned absolute positions, language embeddings, GELU, each side's prediction layer
tied to its own embeddings), the decoder's cross-attention with one output projection per
language (`cross_output_per_language`, the reference's `attention_setting` v1). Its inputs are
the reference's layout (`mass_examples.XLMMassMasking`): the encoder reads `</s> x </s>` with
the fragment corrupted; the decoder reads only the fragment shifted right at its positions in
the sentence, attends to the encoder's non-[MASK] positions (`enc_mask`), and the loss is the
mean cross-entropy of the fragment's tokens (`PredLayer` on `pred_mask`). Every position of
encoder and decoder carries the segment's language (`langs1`, `langs2`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import mass as mass_examples
from pretext_jax.models.layers import split_rng
from pretext_jax.models.t5 import T5, T5Config
from pretext_jax.models.xlm import XLMTranslation, XLMTranslationConfig
from pretext_jax.objectives.common.losses import encoder_decoder_loss, weighted_cross_entropy
from pretext_jax.objectives.common.masked_span import prepare_mass
from pretext_jax.objectives.common.preset_parts import (
    NO_DROPOUT,
    T5_OPTIM,
    TINY_T5_MODEL,
    TINY_TEXT_MODEL,
    TINY_TEXT_OPTIM,
    TINY_TEXT_TRAIN,
)
from pretext_jax.objectives.registry import Batch, Method, Metrics, Resolution, register


def mass_loss(model: T5, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the decoder's predictions of the fragment (`targets`, 0 elsewhere) from
    the masked segment (`inputs`, `input_mask`) and `decoder_inputs`, the decoder attending to
    the encoder's non-[MASK] positions (`cross_attention_mask`); `rng=None` is evaluation."""
    return encoder_decoder_loss(model, batch["inputs"], batch["input_mask"],
                                batch["decoder_inputs"], batch["targets"], rng,
                                batch.get("language_ids"), batch["cross_attention_mask"])


def mass_xlm_loss(model: XLMTranslation, batch: Batch, rng: jax.Array | None
                  ) -> tuple[jax.Array, Metrics]:
    """The reference's `mass_step` loss: the encoder reads `inputs` (`input_mask`), the decoder
    the fragment shifted right (`decoder_inputs`, `decoder_mask`) at `decoder_positions`,
    cross-attending to the encoder's `cross_attention_mask` positions; the mean cross-entropy
    of the fragment's `targets` (`decoder_mask`). `language_ids` / `decoder_language_ids` for a
    model with language embeddings; `rng=None` is evaluation."""
    encoder_rng, decoder_rng = split_rng(rng, 2)
    encoded = model.encode(batch["inputs"], batch["input_mask"], encoder_rng,
                           language_ids=batch.get("language_ids"))
    weights = batch["decoder_mask"]
    hidden = model.decode(batch["decoder_inputs"], encoded, batch["cross_attention_mask"],
                          weights, decoder_rng, language_ids=batch.get("decoder_language_ids"),
                          position_ids=batch["decoder_positions"])
    loss, metrics = weighted_cross_entropy(model.logits(hidden), batch["targets"], weights,
                                           epsilon=1e-6)
    rows = jnp.float32(weights.shape[0])
    return loss, {**metrics, "target_tokens": (jnp.sum(weights.astype(jnp.float32)), rows),
                  "input_tokens": (jnp.sum(batch["input_mask"].astype(jnp.float32)), rows)}


def check_mass_xlm(model: XLMTranslationConfig, examples: mass_examples.MassExampleConfig,
                   objective: Any = None) -> None:
    """Every encoder position (the segment and its leading EOS) has a position embedding; one
    fragment per segment, as the reference. No `objective` setting bears on it."""
    if examples.max_seq_length + 1 > model.max_position_embeddings:
        raise UserError(f"examples.max_seq_length={examples.max_seq_length} plus the leading EOS "
                        f"exceeds model.max_position_embeddings={model.max_position_embeddings};"
                        " lower the first or raise the second")
    if examples.fragment_block:
        raise UserError("mass_xlm masks one fragment per sentence (MASS); set "
                        "examples.fragment_block=0 (blocks are ProphetNet's)")


# The T5 presets (method `mass`): MASS's data and loss on the T5 encoder-decoder.
PRESETS = {
    # t5_tiny's model (GELU instead of ReLU, as MASS) and optimiser: at this size Adafactor
    # at 0.01 lowers the held-out loss much faster than Adam at 2e-3 (5.98 against 6.95 after
    # 200 steps on the demo corpus).
    "mass_tiny": {
        "model": {**TINY_T5_MODEL, "feed_forward_proj": "gelu"},
        "examples": {"max_seq_length": 64},
        "data": {"vocab_size": 4000},
        "optim": {**T5_OPTIM, "warmup_steps": 1000},
        "train": TINY_TEXT_TRAIN,
    },
    # mass_tiny's model and optimiser on a bilingual corpus (data.source=en=PATH,de=PATH, e.g.
    # Multi30K's train.en and train.de): language embeddings from the data, one language per
    # step (§3.1); captions fit 48 tokens.
    "mass_bilingual_tiny": {
        "model": {**TINY_T5_MODEL, "feed_forward_proj": "gelu", "num_languages": 0},
        "examples": {"max_seq_length": 48},
        "data": {"vocab_size": 4000},
        "optim": {**T5_OPTIM, "warmup_steps": 1000},
        "train": TINY_TEXT_TRAIN,
    },
}

# The data decides the vocabulary, EOS (which also starts the decoder), padding and languages.
_XLM_DATA_SIZED = {"vocab_size": 0, "eos_token_id": 0, "pad_token_id": 0, "n_langs": 0}
# The reference's model (method `mass_xlm`). MASS (Song et al. 2019, §3.1, §4.1;
# microsoft/MASS MASS-unsupNMT README's pre-training command, train.py defaults): XLM's
# encoder-decoder of 6 + 6 layers of width 1024 (FFN 4 x 1024), 8 heads, GELU, dropout 0.1
# (attention 0.1), learned positions (512), language embeddings, each side's output tied to its
# embeddings, one cross-attention output per language (attention_setting v1); Adam (b2 0.98,
# eps 1e-8) at lr 1e-4 with XLM's adam_inverse_sqrt schedule (from 1e-7 over 4,000 warmup
# updates), gradients clipped to norm 5; 3,000 tokens per GPU on 8 GPUs (`--tokens_per_batch`:
# 24,000 per step here, rows of similar length together, `examples.tokens_per_batch`);
# sentences of 5 to 100 BPE tokens (longer ones removed); fragment round(0.5 x (length + 2)),
# 80/10/10. The paper gives no step count: the README's 100 epochs of 200,000 sentences, which
# XLM counts as --batch_size (32) per update whatever a batch holds, are 625,000 updates.
# Departures: the budget counts rows x their padded length (at most 8 shapes,
# `examples.length_buckets`) where XLM sums the real tokens of each GPU's length-sorted
# batch; a 60,000-piece sentencepiece vocabulary instead of 60k BPE codes shared by the two
# languages; torch's default init of the linear layers (uniform) is XLM's normal(0.02) here.
# The unsupervised-NMT runs are bilingual: `data.source=en=...,fr=...` adds the language
# embeddings and one language per step (`--mass_steps 'en,fr'`), each reading its language's
# next batch.
XLM_PRESETS = {
    # xlm_tiny's size and optimiser on MASS's data, monolingual or bilingual (data.source=
    # en=PATH,de=PATH); captions fit 48 tokens.
    "mass_xlm_tiny": {
        "model": {**TINY_TEXT_MODEL, **NO_DROPOUT, **_XLM_DATA_SIZED, "hidden_act": "gelu",
                  "embed_init_std": TINY_TEXT_MODEL["hidden_size"] ** -0.5,
                  "cross_output_per_language": True},
        "examples": {"max_seq_length": 48},
        "data": {"vocab_size": 4000},
        "optim": {**TINY_TEXT_OPTIM, "b2": 0.98},
        "train": TINY_TEXT_TRAIN,
    },
    "mass_base": {
        "model": {"hidden_size": 1024, "num_layers": 6, "num_heads": 8,
                  "intermediate_size": 4096, "hidden_act": "gelu", "hidden_dropout": 0.1,
                  "attention_dropout": 0.1, "max_position_embeddings": 512,
                  "sinusoidal_embeddings": False, "embed_init_std": 1024 ** -0.5,
                  "layer_norm_eps": 1e-12, "initializer_range": 0.02,
                  "cross_output_per_language": True, **_XLM_DATA_SIZED},
        "examples": {"max_seq_length": 101, "min_length": 5, "drop_long_sentences": True,
                     "fragment_fraction": 0.5, "fragment_at_start_prob": 0.2,
                     "fragment_at_end_prob": 0.2, "mask_token_prob": 0.8,
                     "random_token_prob": 0.1, "tokens_per_batch": 24000,
                     "length_buckets": 8},
        "data": {"vocab_size": 60000},
        "optim": {"optimizer": "adamw", "learning_rate": 1e-4, "schedule": "inverse_sqrt_warmup",
                  "warmup_steps": 4000, "warmup_init_learning_rate": 1e-7,
                  "b1": 0.9, "b2": 0.98, "eps": 1e-8,
                  "bias_correction": True, "weight_decay": 0.0, "clip_norm": 5.0},
        "train": {"steps": 625000, "batch_size": 240},
    },
}


register(Method(
    name="mass",
    model_config=T5Config,
    example_config=mass_examples.MassExampleConfig,
    build_model=lambda config, seed: T5(config, rngs=nnx.Rngs(seed)),
    loss=mass_loss,
    prepare=prepare_mass,
    units_per_example=lambda examples: examples.max_seq_length,
    description="MASS masked sequence-to-sequence pre-training on an encoder-decoder (Song et "
                "al. 2019)",
    presets=PRESETS,
))

register(Method(
    name="mass_xlm",
    model_config=XLMTranslationConfig,
    example_config=mass_examples.MassExampleConfig,
    build_model=lambda config, seed: XLMTranslation(config, rngs=nnx.Rngs(seed)),
    loss=mass_xlm_loss,
    prepare=functools.partial(prepare_mass, xlm_layout=True),
    units_per_example=lambda examples: examples.max_seq_length + 1,
    description="MASS on the reference's model, XLM's encoder-decoder, with its inputs and "
                "positions (Song et al. 2019; microsoft/MASS MASS-unsupNMT)",
    presets=XLM_PRESETS,
    resolution=Resolution(check=check_mass_xlm),
))
