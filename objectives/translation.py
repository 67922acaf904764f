"""Supervised translation fine-tuning of an encoder-decoder (method `translation` for T5 and MASS
models, `translation_prophetnet` for ProphetNet, `translation_xlm` for an XLM encoder-decoder
whose two sides start from a pre-trained XLM, Lample & Conneau 2019 §5.2), with greedy or beam
search decoding of the held-out pairs scored by BLEU (sacrebleu, Post 2018): the
Multi30K check of MASS (Song et al. 2019 §4.1 fine-tunes its pre-trained model on translation).

Data (`input_pipeline.examples.translation`): `data.source` a parallel corpus
(`input_pipeline.parallel`: `train.en,train.de`), `data.eval_source` the held-out one
(`val.en,val.de`), `examples.source_language` -> `examples.target_language`, the tokenizer
`data.tokenizer` (the pre-trained run's). Loss: teacher-forced cross-entropy on the target's
tokens and EOS, the decoder reading the targets shifted right after
`model.config.decoder_start_token_id` (`text.weighted_cross_entropy`, the mean over target
tokens). The model starts from `model.init` (a pretext workdir or model directory of the same
architecture, e.g. a MASS run, T5's or XLM's encoder-decoder (`mass_xlm`); `Start.pretrained`),
or at random with an empty `init`.

Every evaluation decodes the first `examples.bleu_sentences` held-out sources
(`models.beam_search`, at most `max_target_length` tokens): greedily with `examples.num_beams`
1, else by beam search with `examples.length_penalty` (HF's and XLM's `early_stopping=False`),
reported beside the greedy score (`bleu_greedy`); detokenises them and scores them against the
corpus's reference sentences with `sacrebleu.corpus_bleu` (its defaults: 13a tokenisation,
mixed case, exponential smoothing; the signature is in the run's report).

Families: any encoder-decoder following the shared protocol (`encode`, `decode`, `logits` for
the loss; `prefill_decoder`, `decode_step` for decoding; `config.decoder_start_token_id`,
`config.eos_token_id`; `language_ids` for models with language embeddings) joins with one
`Family` entry in `FAMILIES`, which registers the method `translation` (T5) or
`translation_<family>`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError, require
from pretext_jax.input_pipeline.examples import translation as te
from pretext_jax.input_pipeline.examples.xlm import language_ids
from pretext_jax.input_pipeline.parallel import open_parallel
from pretext_jax.input_pipeline.prepare import DataConfig, load_tokenizer, source_fingerprint
from pretext_jax.models.beam_search import GREEDY, BeamSearch, beam_search
from pretext_jax.models.layers import split_rng
from pretext_jax.models.prophetnet import ProphetNet, ProphetNetConfig
from pretext_jax.models.t5 import T5, T5Config
from pretext_jax.models.xlm import XLM, XLMTranslation, XLMTranslationConfig, load_both_sides
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.preset_parts import T5_OPTIM, TINY_T5_MODEL
from pretext_jax.objectives.common.starts import check_same_architecture
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
)

DECODE_BATCH = 128


@dataclasses.dataclass(frozen=True)
class T5TranslationConfig(T5Config):
    """A T5 (or MASS) encoder-decoder to fine-tune, and where its weights come from."""

    init: str = ""
    """Start from this pretext workdir or model directory (same architecture); '' = random."""


@dataclasses.dataclass(frozen=True)
class Family:
    """An encoder-decoder family that translation fine-tunes: its model class (built as
    `model_class(config, rngs=nnx.Rngs(seed))`, following the decoding protocol), its config
    type for this method (the model's config plus an `init` field), the config fields its data
    decides from the tokenizer, and its number of language embeddings (0: the model takes no
    `language_ids`)."""

    model_class: type
    model_config: type
    data_fields: Callable[[Any], dict[str, Any]]
    languages: Callable[[Any], int]
    pretrained_class: type | None = None
    """A pre-trained model it also starts from, besides `model_class` (XLM's encoder)."""
    free_fields: frozenset[str] = frozenset()
    """Fields of `pretrained_class`'s config that the translation model sets itself."""
    load_pretrained: Callable[[Any, Any], None] | None = None
    """(fresh model, pre-trained `pretrained_class` model) -> None: puts the pre-trained weights
    into the fresh model. A `model_class` start has every parameter copied."""

    @property
    def starts_from(self) -> tuple[type, ...]:
        """The classes of the models it starts from: its own (e.g. a MASS run's encoder-decoder)
        and `pretrained_class`."""
        return (self.model_class,) + ((self.pretrained_class,) if self.pretrained_class else ())

    def build_model(self, config: Any, seed: int) -> Any:
        return self.model_class(config, rngs=nnx.Rngs(seed))


@dataclasses.dataclass(frozen=True)
class ProphetNetTranslationConfig(ProphetNetConfig):
    """A ProphetNet encoder-decoder to fine-tune (decoding and the loss use stream 0, the
    next-token stream), and where its weights come from."""

    init: str = ""
    """Start from this pretext workdir or model directory (same architecture); '' = random."""


@dataclasses.dataclass(frozen=True)
class XLMTranslationRunConfig(XLMTranslationConfig):
    """An XLM encoder-decoder to fine-tune (§5.2), both sides from a pre-trained XLM."""

    eos_token_id: int = 0
    """End of sentence, which also starts the decoder; 0 = the tokenizer's EOS (the data's)."""
    init: str = ""
    """Start from this pretext XLM workdir or model directory; '' = random."""


def eos_fields(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's vocabulary and its EOS ([SEP]) as end of sequence (T5/MASS, ProphetNet)."""
    return {"vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_id}


def xlm_fields(tokenizer: Any) -> dict[str, Any]:
    """XLM also takes the tokenizer's padding id (its embeddings zero it)."""
    return {**eos_fields(tokenizer), "pad_token_id": tokenizer.pad_id}


FAMILIES: dict[str, Family] = {
    "translation": Family(T5, T5TranslationConfig, eos_fields,
                          lambda config: config.num_languages),
    "translation_prophetnet": Family(ProphetNet, ProphetNetTranslationConfig, eos_fields,
                                     lambda config: 0),
    "translation_xlm": Family(XLMTranslation, XLMTranslationRunConfig, xlm_fields,
                              lambda config: config.n_langs, pretrained_class=XLM,
                              free_fields=frozenset({"causal", "is_decoder"}),
                              load_pretrained=load_both_sides),
}


def _languages(ids: jax.Array, use: bool) -> dict[str, jax.Array]:
    return {"language_ids": ids} if use else {}


def translation_loss(model: Any, batch: Batch, rng: jax.Array | None, *, family: Family
                     ) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the target tokens (and EOS) given the source, teacher-forced through the
    decoding protocol; `rng=None` is evaluation."""
    targets, inputs, input_mask = batch["targets"], batch["inputs"], batch["input_mask"]
    start = jnp.full((targets.shape[0], 1), model.config.decoder_start_token_id, targets.dtype)
    decoder_inputs = jnp.concatenate([start, targets[:, :-1]], axis=1)
    use = family.languages(model.config) > 0
    encoder_rng, decoder_rng = split_rng(rng, 2)
    encoded = model.encode(inputs, input_mask, encoder_rng,
                           **_languages(batch["source_language_ids"], use))
    hidden = model.decode(decoder_inputs, encoded, input_mask, None, decoder_rng,
                          **_languages(batch["target_language_ids"], use))
    weights = batch["target_mask"]
    loss, metrics = weighted_cross_entropy(model.logits(hidden), targets, weights, epsilon=1e-6)
    return loss, {**metrics, "target_tokens": (jnp.sum(weights.astype(jnp.float32)),
                                               jnp.float32(targets.shape[0]))}


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """What the BLEU monitor reads: the references (corpus text) and the tokenizer."""

    references: list[str]
    tokenizer: Any


def prepare_translation(data: DataConfig, examples: te.TranslationExampleConfig,
                        cache_dir: Path, seed: int, *, family: Family) -> PreparedData:
    """Training pairs of `data.source`, held-out pairs and references of `data.eval_source`,
    encoded with `data.tokenizer`; the BLEU signature in the report."""
    del seed
    if not data.tokenizer:
        raise UserError("translation needs the pre-trained model's tokenizer: set data.tokenizer "
                        "(run.py translate sets it from --init)")
    if not data.eval_source:
        raise UserError("translation holds out a separate parallel corpus; set "
                        "data.eval_source (e.g. val.en,val.de)")
    sacrebleu = require("sacrebleu", "translation", "BLEU of the translation check")
    tokenizer = load_tokenizer(data)
    ids = language_ids(open_parallel(data.source).languages)
    tokenizer_key = (source_fingerprint(data.tokenizer), data.lowercase)
    train = te.prepare_pairs(data.source, tokenizer, tokenizer_key, examples, ids, cache_dir)
    held_out, references = te.held_out_pairs(data.eval_source, tokenizer, examples, ids)
    # corpus_bleu's defaults; the signature exists once a score was computed (its references).
    metric = sacrebleu.metrics.BLEU()
    metric.corpus_score(references[:1], [references[:1]])
    signature = str(metric.get_signature())
    return PreparedData(
        train=train, eval=held_out, tokenizer=tokenizer,
        model_fields=family.data_fields(tokenizer),
        report={"bleu_signature": signature, "held_out_pairs": len(references),
                "language_ids": ids, "decoding": decoding_name(examples)},
        monitor_data=HeldOut(references, tokenizer))


def check_languages(data: PreparedData, model_config: Any, objective: Any = None, *,
                    family: Family) -> PreparedData:
    """A model with language embeddings has a row for both languages of the direction (ids:
    the corpus's languages in sorted order, as MASS's bilingual pre-training numbers them)."""
    count = family.languages(model_config)
    ids = data.report["language_ids"]
    used = max(int(data.eval["source_language_ids"].max()),
               int(data.eval["target_language_ids"].max()))
    if count and used >= count:
        raise UserError(f"the corpus's languages are numbered {ids} but the model has "
                        f"{count} language embeddings; use a corpus of the pre-training's "
                        "languages only (e.g. train.en,train.de)")
    return data


def decoding(examples: te.TranslationExampleConfig) -> BeamSearch:
    """The BLEU check's search: greedy for one beam, else beam search with the settings'
    length penalty and HF's (and XLM's) `early_stopping=False`."""
    if examples.num_beams == 1:
        return GREEDY
    return BeamSearch(num_beams=examples.num_beams, length_penalty=examples.length_penalty)


def decoding_name(examples: te.TranslationExampleConfig) -> str:
    if examples.num_beams == 1:
        return "greedy"
    return f"beam {examples.num_beams}, length penalty {examples.length_penalty:g}"


def translate_held_out(model: Any, data: PreparedData, examples: te.TranslationExampleConfig,
                       family: Family, search: BeamSearch | None = None
                       ) -> tuple[list[str], list[str]]:
    """(translations of the first `examples.bleu_sentences` held-out sources by `search`
    (default: the settings', `decoding`), detokenised up to EOS; their references). Batches of
    `DECODE_BATCH` rows (the last padded with copies), so every batch reuses one
    compilation."""
    held: HeldOut = data.monitor_data
    count = examples.bleu_sentences or len(held.references)
    count = min(count, len(held.references))
    use = family.languages(model.config) > 0
    eos = model.config.eos_token_id
    outputs = []
    for start in range(0, count, DECODE_BATCH):
        rows = np.minimum(np.arange(start, start + DECODE_BATCH), count - 1)
        tokens = beam_search(
            model, data.eval["inputs"][rows], data.eval["input_mask"][rows],
            max_new_tokens=examples.max_target_length, search=search or decoding(examples),
            source_language_ids=data.eval["source_language_ids"][rows] if use else None,
            target_language_ids=data.eval["target_language_ids"][rows, 0] if use else None,
            pad_id=held.tokenizer.pad_id).sequences[:, 0]
        outputs.extend(tokens[:min(DECODE_BATCH, count - start)])
    hypotheses = []
    for row in outputs:
        row = list(row)
        hypotheses.append(held.tokenizer.decode(row[:row.index(eos)] if eos in row else row))
    return hypotheses, held.references[:count]


def bleu_monitor(model: Any, data: PreparedData, examples: te.TranslationExampleConfig,
                 objective: Any = None, *, family: Family) -> dict[str, float]:
    """Corpus BLEU of the held-out sources' translations (sacrebleu defaults): `bleu` by the
    settings' decoding and, with beam search, `bleu_greedy` beside it."""
    sacrebleu = require("sacrebleu", "translation", "BLEU of the translation check")
    searches = {"bleu": decoding(examples)}
    if examples.num_beams > 1:
        searches["bleu_greedy"] = GREEDY
    scores = {}
    for name, search in searches.items():
        hypotheses, references = translate_held_out(model, data, examples, family, search)
        scores[name] = float(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    return scores


def pretrained_translator(config: Any, seed: int, load: Callable[[str], nnx.Module], *,
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


def summarize_translation(evaluation: dict[str, float], report: dict[str, Any],
                          untrained: Any) -> list[str]:
    """The held-out BLEU with sacrebleu's signature, and the held-out loss."""
    del untrained
    lines = []
    if "bleu" in evaluation:
        greedy = (f", greedy {evaluation['bleu_greedy']:.2f}" if "bleu_greedy" in evaluation
                  else "")
        lines.append(f"  held-out BLEU {evaluation['bleu']:.2f} on {report['held_out_pairs']} "
                     f"pairs ({report['decoding']}{greedy}; sacrebleu "
                     f"{report['bleu_signature']})")
    if "loss" in evaluation:
        lines.append(f"  held-out loss: {evaluation['loss']:.3f}")
    return lines


def method_of(model: Any) -> str:
    """The translation method that fine-tunes `model` (e.g. a MASS run's `T5`)."""
    for name, family in FAMILIES.items():
        if type(model) in family.starts_from:
            return name
    known = sorted(c.__name__ for family in FAMILIES.values() for c in family.starts_from)
    raise UserError(f"no translation method fine-tunes a {type(model).__name__}; start from one "
                    f"of {', '.join(known)}")


# Small enough for the suite and CPU checks: mass_tiny's model (from the pre-trained run when
# model.init is set) and T5's optimiser at a lower rate for fine-tuning; sentences fit 48 tokens.
PRESETS = {
    "translation_tiny": {
        "model": {**TINY_T5_MODEL, "feed_forward_proj": "gelu"},
        "examples": {"max_source_length": 48, "max_target_length": 48},
        "optim": {**T5_OPTIM, "learning_rate": 0.005, "warmup_steps": 100},
        "train": {"steps": 600, "batch_size": 64, "log_every": 25, "eval_every": 600,
                  "checkpoint_every": 200},
    },
}


def translation_method(name: str, family: Family, presets: dict[str, Any]) -> Method:
    """The fine-tuning method of one family."""
    return Method(
        name=name,
        model_config=family.model_config,
        example_config=te.TranslationExampleConfig,
        build_model=family.build_model,
        loss=functools.partial(translation_loss, family=family),
        prepare=functools.partial(prepare_translation, family=family),
        units_per_example=lambda examples: (examples.max_source_length
                                            + examples.max_target_length),
        description=f"Translation fine-tuning with a BLEU check, greedy or beam search ({name})",
        presets=presets,
        resolution=Resolution(complete_data=functools.partial(check_languages, family=family)),
        evaluation=Evaluation(monitor=functools.partial(bleu_monitor, family=family),
                              summarize=summarize_translation),
        start=Start(pretrained=functools.partial(pretrained_translator, family=family)),
    )


for _name, _family in FAMILIES.items():
    register(translation_method(_name, _family, PRESETS if _name == "translation" else {}))
