"""MASS's span-masking data (Song et al. 2019 §2.2, §3.1), shared by the methods trained on it:
MASS itself (`objectives.mass`, on T5 or in the reference's layout on XLM's encoder-decoder)
and ProphetNet (`objectives.prophetnet`, whose paper trains with MASS-style span masking, Qi et
al. 2020 §2.3). Monolingual text, or a bilingual corpus (`data.source=en=SOURCE,de=SOURCE`)
whose training steps each read one language (`input_pipeline.examples.mass` docstring)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import mass as mass_examples
from pretext_jax.input_pipeline.examples import xlm as xlm_examples
from pretext_jax.input_pipeline.examples.bert import MaskingVocab
from pretext_jax.input_pipeline.prepare import DataConfig, prepare_text
from pretext_jax.input_pipeline.token_batches import ScheduledBatches, TokenBudgetBatches
from pretext_jax.objectives.common.held_out import (
    MAX_EVAL_EXAMPLES,
    held_out_examples,
    stacked_records,
)
from pretext_jax.objectives.registry import (
    PreparedData,
    Segments,
    budget_batches,
    per_step_source,
)


def build_segments(examples: mass_examples.MassExampleConfig, documents: Any, tokenizer: Any,
                   seed: int, language: int | None = None) -> Iterable[dict[str, np.ndarray]]:
    """`prepare_text`'s builder: the corpus's sentences as segments (nothing is random), tagged
    with their `language` id in a bilingual corpus."""
    del seed
    return mass_examples.create_training_examples(documents, examples, tokenizer.sep_id,
                                                  language)


def prepare_mass(data: DataConfig, examples: mass_examples.MassExampleConfig, cache_dir: Path,
                 seed: int, *, xlm_layout: bool = False) -> PreparedData:
    """Corpus -> tokenizer -> segments -> ArrayRecord; the fragment and its masks are drawn while
    loading, held-out records get one fixed draw. The model's vocabulary is the tokenizer's,
    its EOS the tokenizer's [SEP]; a bilingual corpus (`en=SOURCE,de=SOURCE`) also sets its
    number of languages. `xlm_layout`: the reference's inputs (`XLMMassMasking`) for XLM's
    encoder-decoder, whose fields `n_langs` (1 for one language) and `pad_token_id` the data
    sets too."""
    corpora = mass_examples.language_corpora(data.source)
    step_order = None
    if corpora is None:
        build = functools.partial(build_segments, examples)
        train, held_out_split, tokenizer = prepare_text(data, build, examples, cache_dir, seed)
        held_out, languages = [held_out_split], {}
    else:
        train, held_out, tokenizer = prepare_bilingual(corpora, data, examples, cache_dir, seed)
        languages = {"num_languages": xlm_examples.tokenizer_language_ids(corpora, tokenizer)[1]}
        step_order = per_step_source(train.for_global_batch)
    if xlm_layout:
        languages = {"n_langs": xlm_examples.tokenizer_language_ids(corpora, tokenizer)[1]
                     if corpora else 1, "pad_token_id": tokenizer.pad_id}
    masking = (mass_examples.XLMMassMasking if xlm_layout else mass_examples.MassMasking)(
        MaskingVocab.from_tokenizer(tokenizer), examples)
    if examples.tokens_per_batch:
        step_order = token_budget_batches(train, examples, masking, seed, extra=int(xlm_layout))
    share = MAX_EVAL_EXAMPLES // len(held_out)
    eval_examples = stacked_records([held_out_examples(part, masking, seed, share)
                                     for part in held_out if len(part)])
    return PreparedData(train=train, eval=eval_examples, transforms=(masking,),
                        model_fields={"vocab_size": tokenizer.vocab_size,
                                      "eos_token_id": tokenizer.sep_id, **languages},
                        segments=step_order, tokenizer=tokenizer)


def token_budget_batches(train: Any, examples: mass_examples.MassExampleConfig,
                         masking: Any, seed: int, *, extra: int) -> Segments:
    """The training segments of batches within `examples.tokens_per_batch` tokens
    (`token_batches.TokenBudgetBatches`): a segment's length with the layout's `extra`
    positions (the reference's leading </s>) is what the budget counts; each row is cut to its
    batch's length before it is masked. A bilingual corpus (`train` a step schedule) plans each
    language's batches and reads the next one of the language each step draws
    (`token_batches.ScheduledBatches`)."""
    fit = functools.partial(mass_examples.cut_segment, extra=extra)
    bilingual = isinstance(train, xlm_examples.StepSchedule)
    languages = train.records if bilingual else [train]

    def source(multiple: int, config: Any) -> Any:
        del config  # what the run decides is its row multiple
        sources = [TokenBudgetBatches(
            records, records.token_lengths("tokens") + extra, budget=examples.tokens_per_batch,
            length_buckets=examples.length_buckets, multiple=multiple, seed=seed, fit=fit,
            transforms=(masking,), stream=stream) for stream, records in enumerate(languages)]
        return ScheduledBatches(train, sources) if bilingual else sources[0]

    return budget_batches(source)


def prepare_bilingual(corpora: dict[str, str], data: DataConfig,
                      examples: mass_examples.MassExampleConfig, cache_dir: Path, seed: int
                      ) -> tuple[xlm_examples.StepSchedule, list[Any], Any]:
    """(the training steps, each of one language's segments, uniformly drawn; the held-out
    segments of each language; the shared tokenizer)."""
    eval_corpora = (mass_examples.language_corpora(data.eval_source) if data.eval_source
                    else None)
    if eval_corpora is not None and set(eval_corpora) != set(corpora):
        raise UserError(f"data.eval_source must name the languages of data.source "
                        f"({', '.join(sorted(corpora))}) as LANG=SOURCE, e.g. en=val.en,de=val.de")

    def build(language: int) -> Any:
        return functools.partial(build_segments, examples, language=language)

    prepared, tokenizer = xlm_examples.prepare_languages(
        corpora, dataclasses.replace(data, eval_source=""), build, examples, 1.0, cache_dir,
        seed, eval_corpora=eval_corpora)
    records = {language: prepared[language][0] for language in sorted(prepared)}
    train = xlm_examples.StepSchedule(records, np.full(len(records), 1 / len(records)), {}, [],
                                      seed)
    return train, [pair[1] for pair in prepared.values()], tokenizer
