"""MASS (method `mass`): masked sequence-to-sequence pre-training (Song et al. 2019, §2.2, §3.1;
reference microsoft/MASS MASS-unsupNMT) on the T5 encoder-decoder of `models.t5`.

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
"""

from __future__ import annotations

import jax
from flax import nnx

from pretext_jax.input_pipeline.examples import mass as mass_examples
from pretext_jax.models.t5 import T5, T5Config
from pretext_jax.objectives.common.losses import encoder_decoder_loss
from pretext_jax.objectives.common.masked_span import prepare_mass
from pretext_jax.objectives.common.preset_parts import T5_OPTIM, TINY_T5_MODEL, TINY_TEXT_TRAIN
from pretext_jax.objectives.registry import Batch, Method, Metrics, register


def mass_loss(model: T5, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the decoder's predictions of the fragment (`targets`, 0 elsewhere) from
    the masked segment (`inputs`, `input_mask`) and `decoder_inputs`, the decoder attending to
    the encoder's non-[MASK] positions (`cross_attention_mask`); `rng=None` is evaluation."""
    return encoder_decoder_loss(model, batch["inputs"], batch["input_mask"],
                                batch["decoder_inputs"], batch["targets"], rng,
                                batch.get("language_ids"), batch["cross_attention_mask"])


# MASS (Song et al. 2019, §3.1; microsoft/MASS MASS-unsupNMT README): a 6 + 6-layer Transformer
# of width 1024, FFN 4096, 8 heads (of 128), GELU, dropout 0.1 (attention 0.1), embeddings
# shared by encoder, decoder and output; Adam (b2 0.98, eps 1e-8) at lr 1e-4 with XLM's
# adam_inverse_sqrt schedule (from 1e-7 over 4,000 warmup updates), gradients clipped to norm 5
# (XLM's
# default); 3,000 tokens per GPU on 8 GPUs; sentences of 5 to 100 BPE tokens; fragment 50%,
# 80/10/10. The paper gives no step count: 83,334 steps of 240 rows are the README's 100
# epochs of 200,000 sentences. Departures: T5's relative position bias,
# pre-norm RMS layers and bias-free projections instead of learned absolute positions and
# post-LN layers (the model is `models.t5`); the tied LM head scales by d_model^-0.5 (T5 v1.0);
# fixed rows of 100 tokens, 240 per step (<= 24,000 tokens,
# padding included) instead of batches of 3,000 real tokens grouped by length; a 60,000-piece
# sentencepiece vocabulary instead of 60k BPE codes shared by the two languages. The
# unsupervised-NMT runs are bilingual: `data.source=en=...,fr=...` adds the language embeddings
# and one language per step (`--mass_steps 'en,fr'`); monolingual
# text (the paper's summarisation and conversation settings, §4.3-4.4) needs neither.
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
    "mass_base": {
        "model": {"hidden_size": 1024, "num_layers": 6, "num_heads": 8, "head_size": 128,
                  "intermediate_size": 4096, "feed_forward_proj": "gelu",
                  "hidden_dropout": 0.1, "attention_dropout": 0.1, "tie_word_embeddings": True,
                  "vocab_size": 0, "eos_token_id": 0},
        "examples": {"max_seq_length": 100, "min_length": 5, "fragment_fraction": 0.5,
                     "mask_token_prob": 0.8, "random_token_prob": 0.1},
        "data": {"vocab_size": 60000},
        "optim": {"optimizer": "adamw", "learning_rate": 1e-4, "schedule": "inverse_sqrt_warmup",
                  "warmup_steps": 4000, "warmup_init_learning_rate": 1e-7,
                  "b1": 0.9, "b2": 0.98, "eps": 1e-8,
                  "bias_correction": True, "weight_decay": 0.0, "clip_norm": 5.0},
        "train": {"steps": 83334, "batch_size": 240},
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
