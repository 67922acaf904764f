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
`model.config.decoder_start_token_id` (`encoder_decoders.teacher_forced_loss`, the mean over
target tokens). The model starts from `model.init` (a pretext workdir or model directory of the same
architecture, e.g. a MASS run, T5's or XLM's encoder-decoder (`mass_xlm`); `Start.pretrained`),
or at random with an empty `init`.

Every evaluation decodes the first `examples.bleu_sentences` held-out sources
(`models.beam_search`, at most `max_target_length` tokens): greedily with `examples.num_beams`
1, else by beam search with `examples.length_penalty` (HF's and XLM's `early_stopping=False`),
reported beside the greedy score (`bleu_greedy`); detokenises them and scores them against the
corpus's reference sentences with `sacrebleu.corpus_bleu` (its defaults: 13a tokenisation,
mixed case, exponential smoothing; the signature is in the run's report).

Families: the encoder-decoders of `objectives.common.encoder_decoders` (their protocol, loss,
pre-trained start and batched decoding are shared with summarisation); each registers the
method `translation` (T5) or `translation_<family>` (`FAMILIES`).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pretext_jax.errors import UserError, require
from pretext_jax.input_pipeline.examples import translation as te
from pretext_jax.input_pipeline.examples.xlm import language_ids
from pretext_jax.input_pipeline.parallel import open_parallel
from pretext_jax.input_pipeline.prepare import DataConfig, load_tokenizer, tokenizer_identity
from pretext_jax.input_pipeline.token_batches import TokenBudgetBatches, cut_rows
from pretext_jax.models.beam_search import GREEDY, BeamSearch
from pretext_jax.objectives.common import encoder_decoders as ed
from pretext_jax.objectives.common.encoder_decoders import Family
from pretext_jax.objectives.common.preset_parts import T5_OPTIM, TINY_T5_MODEL
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Loader,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    budget_batches,
    register,
)

FAMILIES: dict[str, Family] = {"translation": ed.FAMILIES["t5"],
                                "translation_prophetnet": ed.FAMILIES["prophetnet"],
                                "translation_xlm": ed.FAMILIES["xlm"]}


def translation_loss(model: Any, batch: Batch, rng: jax.Array | None, *, family: Family
                     ) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the target tokens (and EOS) given the source, teacher-forced through the
    decoding protocol (`encoder_decoders.teacher_forced_loss`, the next-token stream);
    `rng=None` is evaluation."""
    return ed.teacher_forced_loss(model, batch, rng, family=family)


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
    train = te.prepare_pairs(data.source, tokenizer, tokenizer_identity(data), examples, ids,
                             cache_dir)
    held_out, references = te.held_out_pairs(data.eval_source, tokenizer, examples, ids)
    # corpus_bleu's defaults; the signature exists once a score was computed (its references).
    metric = sacrebleu.metrics.BLEU()
    metric.corpus_score(references[:1], [references[:1]])
    signature = str(metric.get_signature())
    segments = None
    if examples.tokens_per_batch:
        sides = train.token_lengths("input_mask"), train.token_lengths("target_mask")

        def source(multiple: int, config: Any) -> TokenBudgetBatches:
            return TokenBudgetBatches(train, np.maximum(*sides), budget=examples.tokens_per_batch,
                                      length_buckets=examples.length_buckets, multiple=multiple,
                                      seed=config.train.seed, fit=cut_rows, units=sum(sides))

        segments = budget_batches(source)
    return PreparedData(
        train=train, eval=held_out, tokenizer=tokenizer, segments=segments,
        model_fields=family.data_fields(tokenizer),
        report={"bleu_signature": signature, "held_out_pairs": len(references),
                "language_ids": ids, "decoding": decoding_name(examples)},
        monitor_data=HeldOut(references, tokenizer))


def check_languages(data: PreparedData, model_config: Any, objective: Any = None,
                    load: Loader | None = None, *, family: Family) -> PreparedData:
    """A model with language embeddings has a row for both languages of the direction (ids:
    the corpus's languages in sorted order, as MASS's bilingual pre-training numbers them)."""
    del load
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
    (default: the settings', `decoding`), detokenised up to EOS; their references)."""
    held: HeldOut = data.monitor_data
    count = examples.bleu_sentences or len(held.references)
    count = min(count, len(held.references))
    outputs = ed.decode_rows(model, data.eval, count, search or decoding(examples),
                             examples.max_target_length, family, held.tokenizer.pad_id)
    return [held.tokenizer.decode(row) for row in outputs], held.references[:count]


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
    return ed.family_of(model, FAMILIES, "translation")


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
        start=Start(pretrained=functools.partial(ed.pretrained_start, family=family)),
    )


for _name, _family in FAMILIES.items():
    register(translation_method(_name, _family, PRESETS if _name == "translation" else {}))
