"""The encoder-decoder families that fine-tune on a sequence-to-sequence task (translation,
`objectives/translation.py`; summarisation, `objectives/summarization.py`): each family's model
and config, the teacher-forced loss, the start from a pre-trained model, and batched decoding
of held-out sources (`models.beam_search`).

The protocol a family's model follows: `encode`, `decode`, `logits` for the loss;
`prefill_decoder`, `decode_step` for decoding; `config.decoder_start_token_id`,
`config.eos_token_id`; `language_ids` for models with language embeddings. ProphetNet also
gives every predicting stream's logits (`Family.stream_logits`), for losses that train them all
(its fine-tuning criterion, `ngram_criterions.py`). UniLM's family is one network, a BERT run as
a prefix LM (`models.prefix_lm`): it follows the decoding protocol only (its loss is
`objectives.common.masked_targets`'), its source and target share one position range
(`Family.positions`), and a `unilm` run's BERT starts it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.models.beam_search import BeamSearch, beam_search
from pretext_jax.models.bert import Bert
from pretext_jax.models.layers import split_rng
from pretext_jax.models.prefix_lm import PrefixLM, PrefixLMConfig
from pretext_jax.models.prophetnet import ProphetNet, ProphetNetConfig
from pretext_jax.models.t5 import T5, T5Config
from pretext_jax.models.xlm import XLM, XLMTranslation, XLMTranslationConfig, load_both_sides
from pretext_jax.objectives.common.losses import label_smoothed_cross_entropy
from pretext_jax.objectives.common.starts import check_same_architecture
from pretext_jax.objectives.registry import Batch, Metrics

DECODE_BATCH = 128


@dataclasses.dataclass(frozen=True)
class T5TranslationConfig(T5Config):
    """A T5 (or MASS, BART) encoder-decoder to fine-tune, and where its weights come from."""

    init: str = ""
    """Start from this pretext workdir or model directory (same architecture); '' = random."""


@dataclasses.dataclass(frozen=True)
class ProphetNetTranslationConfig(ProphetNetConfig):
    """A ProphetNet encoder-decoder to fine-tune (decoding uses stream 0, the next-token
    stream), and where its weights come from."""

    init: str = ""
    """Start from this pretext workdir or model directory (same architecture); '' = random."""


@dataclasses.dataclass(frozen=True)
class XLMTranslationRunConfig(XLMTranslationConfig):
    """An XLM encoder-decoder to fine-tune (Lample & Conneau 2019 §5.2), both sides from a
    pre-trained XLM."""

    eos_token_id: int = 0
    """End of sentence, which also starts the decoder; 0 = the tokenizer's EOS (the data's)."""
    init: str = ""
    """Start from this pretext XLM workdir or model directory; '' = random."""


@dataclasses.dataclass(frozen=True)
class PrefixLMRunConfig(PrefixLMConfig):
    """A BERT run as a sequence-to-sequence prefix LM (UniLM, Dong et al. 2019 §2.4), and
    where its weights come from."""

    init: str = ""
    """Start from this pretext `unilm` workdir or model directory (its BERT), or a fine-tuned
    prefix LM of the same architecture; '' = random."""


def _single_stream(model: Any, inputs: jax.Array, input_mask: jax.Array,
                   decoder_inputs: jax.Array, rng: jax.Array | None,
                   languages: dict[str, jax.Array], target_languages: dict[str, jax.Array]
                   ) -> jax.Array:
    """[B, 1, T, V]: the next-token logits through `encode` / `decode` / `logits`."""
    encoder_rng, decoder_rng = split_rng(rng, 2)
    encoded = model.encode(inputs, input_mask, encoder_rng, **languages)
    hidden = model.decode(decoder_inputs, encoded, input_mask, None, decoder_rng,
                          **target_languages)
    return model.logits(hidden)[:, None]


def _prophetnet_streams(model: ProphetNet, inputs: jax.Array, input_mask: jax.Array,
                        decoder_inputs: jax.Array, rng: jax.Array | None,
                        languages: dict[str, jax.Array], target_languages: dict[str, jax.Array]
                        ) -> jax.Array:
    """[B, ngram, T, V]: every predicting stream's logits (stream 0 the next token)."""
    del languages, target_languages  # no language embeddings
    return model(inputs, input_mask, decoder_inputs, rng=rng).ngram_logits


@dataclasses.dataclass(frozen=True)
class Family:
    """An encoder-decoder family that fine-tunes: its model class (built as
    `model_class(config, rngs=nnx.Rngs(seed))`, following the decoding protocol), its config
    type for fine-tuning (the model's config plus an `init` field), the config fields its data
    decides from the tokenizer, and its number of language embeddings (0: the model takes no
    `language_ids`)."""

    model_class: type
    model_config: type
    data_fields: Callable[[Any], dict[str, Any]]
    languages: Callable[[Any], int]
    pretrained_class: type | None = None
    """A pre-trained model it also starts from, besides `model_class` (XLM's encoder)."""
    free_fields: frozenset[str] = frozenset()
    """Fields of `pretrained_class`'s config that the fine-tuned model sets itself."""
    load_pretrained: Callable[[Any, Any], None] | None = None
    """(fresh model, pre-trained `pretrained_class` model) -> None: puts the pre-trained weights
    into the fresh model. A `model_class` start has every parameter copied."""
    stream_logits: Callable[..., jax.Array] | None = None
    """(model, inputs, input_mask, decoder_inputs, rng, languages, target_languages) ->
    [B, S, T, V]: the logits of all S predicting streams (ProphetNet); None: the one
    next-token stream."""
    positions: Callable[[int, int], int] | None = None
    """(source length, target length) -> the positions a pair uses when source and target
    are one sequence (a prefix LM); None: each side has its own."""
    summary_fields: Callable[[Any], dict[str, Any]] | None = None
    """tokenizer -> the config fields summarisation sets from it (`PreparedData.model_fields`):
    the prefix LM's special tokens, which a BERT's config lacks; None: the starting model's."""

    @property
    def starts_from(self) -> tuple[type, ...]:
        """The classes of the models it starts from: its own (e.g. a MASS run's encoder-decoder)
        and `pretrained_class`."""
        return (self.model_class,) + ((self.pretrained_class,) if self.pretrained_class else ())

    def build_model(self, config: Any, seed: int) -> Any:
        return self.model_class(config, rngs=nnx.Rngs(seed))


def eos_fields(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's vocabulary and its EOS ([SEP]) as end of sequence (T5/MASS, ProphetNet)."""
    return {"vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_id}


def xlm_fields(tokenizer: Any) -> dict[str, Any]:
    """XLM also takes the tokenizer's padding id (its embeddings zero it)."""
    return {**eos_fields(tokenizer), "pad_token_id": tokenizer.pad_id}


def prefix_lm_fields(tokenizer: Any) -> dict[str, Any]:
    """The vocabulary and the prefix LM's [CLS], [SEP], [MASK] and [PAD]."""
    return {"vocab_size": tokenizer.vocab_size, "sos_token_id": tokenizer.cls_id,
            "eos_token_id": tokenizer.eos_id, "mask_token_id": tokenizer.mask_id,
            "pad_token_id": tokenizer.pad_id}


def widen_positions(rows: jax.Array, count: int) -> jax.Array:
    """A position table [P, E] as `count` rows: its first `count`, or its rows repeated
    from the start to fill the new ones (unilm-v1 modeling.py `from_pretrained` 826-845,
    e.g. BERT's 512 rows as CNN/DailyMail's 768)."""
    return jnp.concatenate([rows] * -(-count // rows.shape[0]), axis=0)[:count]


def load_bert(fresh: PrefixLM, loaded: Bert) -> None:
    """A `unilm` run's BERT into the prefix LM: its encoder and masked-LM head (not the pooler
    and the pair head), the position table widened to the run's (`widen_positions`)."""
    weights = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    for key, variable in nnx.to_flat_state(nnx.state(fresh, nnx.Param)):
        value = weights[key][...]
        if "position_embeddings" in key:
            value = widen_positions(value, fresh.config.max_position_embeddings)
        variable.set_value(value)


FAMILIES: dict[str, Family] = {
    "t5": Family(T5, T5TranslationConfig, eos_fields, lambda config: config.num_languages),
    "prophetnet": Family(ProphetNet, ProphetNetTranslationConfig, eos_fields, lambda config: 0,
                         stream_logits=_prophetnet_streams),
    "xlm": Family(XLMTranslation, XLMTranslationRunConfig, xlm_fields,
                  lambda config: config.n_langs, pretrained_class=XLM,
                  free_fields=frozenset({"causal", "is_decoder"}),
                  load_pretrained=load_both_sides),
    "unilm": Family(PrefixLM, PrefixLMRunConfig, prefix_lm_fields, lambda config: 0,
                    pretrained_class=Bert, free_fields=frozenset({"max_position_embeddings"}),
                    load_pretrained=load_bert, positions=lambda source, target: source + target + 1,
                    summary_fields=prefix_lm_fields),
}


def languages(ids: jax.Array, use: bool) -> dict[str, jax.Array]:
    """The `language_ids` keyword, for a model with language embeddings only."""
    return {"language_ids": ids} if use else {}


def teacher_forced_loss(model: Any, batch: Batch, rng: jax.Array | None, *, family: Family,
                        label_smoothing: float = 0.0, all_streams: bool = False
                        ) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the target tokens (and EOS) given the source, the decoder reading the
    targets shifted right after `model.config.decoder_start_token_id`; the mean over target
    tokens, smoothed by `label_smoothing` (`losses.smoothed_nll`). `all_streams`: every
    predicting stream of a family that has several (ProphetNet) predicts the targets, the mean
    over all of them (its fine-tuning criterion; HF's loss); else the next-token stream only.
    `rng=None` is evaluation."""
    targets, inputs, input_mask = batch["targets"], batch["inputs"], batch["input_mask"]
    start = jnp.full((targets.shape[0], 1), model.config.decoder_start_token_id, targets.dtype)
    decoder_inputs = jnp.concatenate([start, targets[:, :-1]], axis=1)
    use = family.languages(model.config) > 0
    streams = (family.stream_logits if all_streams and family.stream_logits
               else _single_stream)
    logits = streams(model, inputs, input_mask, decoder_inputs, rng,
                     languages(batch["source_language_ids"], use),
                     languages(batch["target_language_ids"], use))  # [B, S, T, V]
    weights = jnp.broadcast_to(batch["target_mask"][:, None], logits.shape[:3])
    labels = jnp.broadcast_to(targets[:, None], logits.shape[:3])
    loss, metrics = label_smoothed_cross_entropy(logits, labels, weights, label_smoothing,
                                                 epsilon=1e-6)
    return loss, {**metrics, "target_tokens": (
        jnp.sum(batch["target_mask"].astype(jnp.float32)), jnp.float32(targets.shape[0]))}


def pretrained_start(config: Any, seed: int, load: Callable[[str], nnx.Module], *,
                     family: Family) -> Any | None:
    """The model of `config.init` (read by `load`) with this run's settings (dropout, dtype),
    or None for a random start. Its architecture must be the run's: a difference is a
    UserError naming the setting."""
    if not config.init:
        return None
    if not Path(config.init).is_dir():
        raise UserError(f"model.init={config.init} is not a directory; pass a pretext workdir or "
                        "model directory of an encoder-decoder")
    loaded = load(config.init)
    if type(loaded) not in family.starts_from:
        raise UserError(f"{config.init} holds a {type(loaded).__name__}, not the "
                        f"{' or '.join(c.__name__ for c in family.starts_from)} this method "
                        "fine-tunes")
    own = type(loaded) is family.model_class
    check_same_architecture(config, loaded.config, config.init,
                            frozenset() if own else family.free_fields)
    fresh = family.build_model(config, seed)
    if own:
        nnx.update(fresh, nnx.state(loaded, nnx.Param))
    else:
        family.load_pretrained(fresh, loaded)
    return fresh


def family_of(model: Any, families: dict[str, Family], task: str) -> str:
    """The key of `families` whose family fine-tunes `model` (e.g. a MASS run's `T5`)."""
    for name, family in families.items():
        if type(model) in family.starts_from:
            return name
    known = sorted(c.__name__ for family in families.values() for c in family.starts_from)
    raise UserError(f"no {task} method fine-tunes a {type(model).__name__}; start from one "
                    f"of {', '.join(known)}")


def decode_rows(model: Any, records: dict[str, np.ndarray], count: int, search: BeamSearch,
                max_new_tokens: int, family: Family, pad_id: int) -> list[list[int]]:
    """The best output of `search` for each of the first `count` held-out `records` (`inputs`,
    `input_mask`, the language ids), its tokens up to EOS (left out). Batches of `DECODE_BATCH`
    rows (the last padded with copies), so every batch reuses one compilation."""
    use = family.languages(model.config) > 0
    eos = model.config.eos_token_id
    outputs: list[list[int]] = []
    for start in range(0, count, DECODE_BATCH):
        rows = np.minimum(np.arange(start, start + DECODE_BATCH), count - 1)
        tokens = beam_search(
            model, records["inputs"][rows], records["input_mask"][rows],
            max_new_tokens=max_new_tokens, search=search,
            source_language_ids=records["source_language_ids"][rows] if use else None,
            target_language_ids=records["target_language_ids"][rows, 0] if use else None,
            pad_id=pad_id).sequences[:, 0]
        for row in tokens[:min(DECODE_BATCH, count - start)]:
            row = row.tolist()
            outputs.append(row[:row.index(eos)] if eos in row else row)
    return outputs
