"""Abstractive summarisation fine-tuning of an encoder-decoder (`run.py finetune --task
summarize`): method `summarize` for T5 models (T5, and the MASS and BART objectives on them),
`summarize_prophetnet` for ProphetNet, `summarize_xlm` for XLM's encoder-decoder (a `mass_xlm`
run, or both sides from an XLM), `summarize_unilm` for a `unilm` run's BERT as a prefix LM
(Dong et al. 2019 §3.2: its masked-target loss, `objectives.common.masked_targets`, in place of
teacher forcing); the families and their shared parts are `objectives.common.encoder_decoders`'.

Data (`input_pipeline.summaries`): `--data` a folder of line-aligned `SPLIT.source` /
`SPLIT.target` files or `SPLIT.tsv` (document<TAB>summary) for train and dev; the tokenizer is the
starting point's. Loss: teacher-forced cross-entropy of the summary's tokens and EOS with label
smoothing `objective.label_smoothing` (0.1 in every recipe: fairseq's
`label_smoothed_cross_entropy` for MASS and BART, ProphetNet's `ngram_language_loss`, whose
every predicting stream is trained here too); UniLM's masked summary tokens instead.

Every evaluation decodes the first `examples.rouge_examples` dev documents by beam search
(`models.beam_search`: `num_beams`, `length_penalty`, `min_length`, `max_length`,
`no_repeat_ngram_size`, `early_stopping`, HF `generate`'s meanings) and scores the detokenised
summaries against the dev summaries with Google's `rouge-score` package: ROUGE-1, ROUGE-2,
ROUGE-L (one LCS over the whole text) and ROUGE-Lsum (the union LCS over sentences, what
ROUGE-1.5.5 reports as ROUGE-L for sentence-split summaries), the mean F1 over documents x 100,
beside the lead-3 baseline (the document's first three sentences) on the same documents. How
these differ from the papers' ROUGE-1.5.5: docs/methods/seq2seq.md.

The recipes (MASS, BART, T5, ProphetNet; their cards in docs/methods/seq2seq.md) are presets;
`Start.finetunes` gives a starting point its family's, by the method it was pre-trained with.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pretext_jax.errors import UserError, require
from pretext_jax.input_pipeline import summaries
from pretext_jax.input_pipeline.prepare import (
    DataConfig,
    fingerprint,
    load_tokenizer,
    tokenizer_identity,
)
from pretext_jax.input_pipeline.records import SPEC_FILE, RecordDirectory, write_records
from pretext_jax.models.beam_search import BeamSearch
from pretext_jax.objectives import registry
from pretext_jax.objectives.common import encoder_decoders as ed
from pretext_jax.objectives.common.encoder_decoders import Family
from pretext_jax.objectives.common.masked_targets import MaskedTargetSettings, masked_target_loss
from pretext_jax.objectives.common.preset_parts import NO_DROPOUT
from pretext_jax.objectives.common.starts import RUN_FIELDS
from pretext_jax.objectives.registry import (
    Batch,
    DownstreamTask,
    Evaluation,
    FinetuneRecipe,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
    register_task,
)

SUMMARIZE = "summarize"
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


@dataclasses.dataclass(frozen=True)
class SummaryExampleConfig:
    """The lengths, the source prefix, the language, and how the dev documents are decoded
    (beam search, HF `generate`'s settings) and scored (ROUGE)."""

    task: str = SUMMARIZE
    """Downstream task: summarize (document-summary pairs)."""
    max_source_length: int = 512
    """Document tokens incl. EOS; longer documents are cut (BART's --truncate-source)."""
    max_target_length: int = 256
    """Summary tokens incl. EOS in training; longer summaries are cut."""
    source_prefix: str = ""
    """Text put before every document (T5: 'summarize: ')."""
    language_id: int = 0
    """The language embedding of documents and summaries (models with language embeddings)."""
    num_beams: int = 4
    """Beams of the dev decoding (1 = greedy)."""
    length_penalty: float = 1.0
    """A hypothesis scores sum(log p) / length ** this (> 0 favours longer ones)."""
    min_length: int = 0
    """Decoded summaries hold at least this many tokens, EOS included (fairseq --min-len + 1)."""
    max_length: int = 0
    """Decoded tokens at most, EOS included (fairseq --max-len-b + 1); 0 = max_target_length."""
    no_repeat_ngram_size: int = 0
    """Never repeat an n-gram of this size in a summary (3 in the papers); 0 = off."""
    early_stopping: bool = False
    """Close a document once it has num_beams finished summaries (fairseq's rule); false:
    once no running beam can beat them (HF's default)."""
    rouge_examples: int = 0
    """Dev documents decoded and scored at each evaluation: the first n; 0 = all."""
    rouge_stemmer: bool = True
    """Porter-stem words of more than 3 letters before matching (ROUGE-1.5.5's -m)."""

    def __post_init__(self) -> None:
        if min(self.max_source_length, self.max_target_length) < 2:
            raise UserError("examples.max_source_length and examples.max_target_length must be "
                            ">= 2 (a token and EOS)")
        if self.max_length < 0 or self.rouge_examples < 0 or self.language_id < 0:
            raise UserError("examples.max_length, examples.rouge_examples and "
                            "examples.language_id must be >= 0")
        _ = self.search  # BeamSearch refuses bad decoding settings
        if self.min_length > self.decoded_length:
            raise UserError(f"examples.min_length={self.min_length} exceeds the decoded length "
                            f"{self.decoded_length}; lower it or raise examples.max_length")

    @property
    def decoded_length(self) -> int:
        """Tokens decoded at most (EOS included)."""
        return self.max_length or self.max_target_length

    @property
    def search(self) -> BeamSearch:
        return BeamSearch(num_beams=self.num_beams, length_penalty=self.length_penalty,
                          early_stopping=self.early_stopping,
                          no_repeat_ngram_size=self.no_repeat_ngram_size,
                          min_length=self.min_length)

    def describe_search(self) -> str:
        if self.num_beams == 1:
            return "greedy"
        parts = [f"beam {self.num_beams}", f"length penalty {self.length_penalty:g}"]
        if self.min_length:
            parts.append(f"min length {self.min_length}")
        if self.no_repeat_ngram_size:
            parts.append(f"no repeated {self.no_repeat_ngram_size}-grams")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class SummaryLossSettings:
    """The fine-tuning loss's settings."""

    label_smoothing: float = 0.1
    """Label smoothing eps in [0, 1) (MASS, BART and ProphetNet fine-tune with 0.1)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"objective.label_smoothing={self.label_smoothing} must be in [0, 1)")


# ---------------------------------------------------------------------------- ROUGE
def rouge(predictions: Sequence[str], references: Sequence[str], *, stemmer: bool = True
          ) -> dict[str, float]:
    """Mean ROUGE F1 x 100 of `predictions` against `references` (one each) with
    `rouge_score.rouge_scorer` (ROUGE_TYPES). ROUGE-Lsum reads sentences one per line, so both
    sides are split into sentences first (`summaries.sentences`)."""
    scorer_module = require("rouge_score.rouge_scorer", "summarize",
                            "ROUGE of the summarisation task")
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    scorer = scorer_module.RougeScorer(list(ROUGE_TYPES), use_stemmer=stemmer)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for prediction, reference in zip(predictions, references, strict=True):
        scores = scorer.score("\n".join(summaries.sentences(reference)),
                              "\n".join(summaries.sentences(prediction)))
        for name in ROUGE_TYPES:
            totals[name] += scores[name].fmeasure
    return {name: 100.0 * total / len(predictions) for name, total in totals.items()}


# ---------------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True)
class DevSet:
    """What the ROUGE monitor reads: the dev documents and summaries as written, and the
    tokenizer."""

    documents: list[str]
    references: list[str]
    tokenizer: Any


def _record_settings(examples: SummaryExampleConfig) -> dict[str, Any]:
    """The settings the records depend on (not the decoding's)."""
    return {"max_source_length": examples.max_source_length,
            "max_target_length": examples.max_target_length,
            "source_prefix": examples.source_prefix, "language_id": examples.language_id}


def _records(files: summaries.SummaryFiles, tokenizer: Any, examples: SummaryExampleConfig
             ) -> Iterator[tuple[str, str, dict[str, np.ndarray]]]:
    """(document, summary, record) of every pair whose two sides have tokens."""
    for document, summary, document_ids, summary_ids in summaries.encoded_pairs(
            files, tokenizer, examples.source_prefix):
        yield document, summary, summaries.summary_record(
            document_ids, summary_ids, examples.language_id, examples.max_source_length,
            examples.max_target_length, tokenizer.eos_id, tokenizer.pad_id)


def prepare_summaries(data: DataConfig, examples: SummaryExampleConfig, cache_dir: Path,
                      seed: int, *, family: Family) -> PreparedData:
    """Training pairs as records (cached under a key of the files, the tokenizer and the record
    settings), dev pairs in memory with their text, the lead-3 baseline's ROUGE on the dev
    documents the monitor scores, and the config fields the family takes from the tokenizer
    (`Family.summary_fields`)."""
    del seed
    if not data.tokenizer:
        raise UserError("summarisation needs the starting point's tokenizer: set data.tokenizer "
                        "(run.py finetune sets it from --init)")
    tokenizer = load_tokenizer(data)
    train_files = summaries.split_files(data.source, "train")
    dev_files = summaries.split_files(data.source, "dev")
    summaries.check_files(dev_files)  # before the training records are written
    key = fingerprint("summaries", train_files.fingerprint(), _record_settings(examples),
                      *tokenizer_identity(data))
    train_dir = Path(cache_dir) / f"summaries-{key}"
    if not (train_dir / SPEC_FILE).is_file():
        count = write_records((record for _, _, record in _records(train_files, tokenizer,
                                                                    examples)),
                              train_dir, metadata={"source": str(data.source)})
        if not count:
            raise UserError(f"{train_files.files[0]} has no pair with both sides non-empty")
    dev = list(_records(dev_files, tokenizer, examples))
    if not dev:
        raise UserError(f"{dev_files.files[0]} has no pair with both sides non-empty")
    documents, references = [d for d, _, _ in dev], [s for _, s, _ in dev]
    arrays = {k: np.stack([r[k] for _, _, r in dev]) for k in dev[0][2]}
    scored = examples.rouge_examples or len(references)
    lead3 = rouge([summaries.lead(d) for d in documents[:scored]], references[:scored],
                  stemmer=examples.rouge_stemmer)
    return PreparedData(
        train=RecordDirectory(train_dir), eval=arrays, tokenizer=tokenizer,
        model_fields=family.summary_fields(tokenizer) if family.summary_fields else {},
        report={"lead3_baseline": lead3, "dev_pairs": len(references),
                "rouge_examples": min(scored, len(references)),
                "decoding": examples.describe_search()},
        monitor_data=DevSet(documents, references, tokenizer))


def summarize_train_rows(data: str, config: Any) -> int:
    """Training pairs an epoch holds (both sides non-empty); checks the dev files too, so a
    malformed file is refused before the run writes anything."""
    summaries.check_files(summaries.split_files(data, "dev"))
    return sum(1 for _ in summaries.read_pairs(summaries.split_files(data, "train")))


# ---------------------------------------------------------------------------- the method
def summarization_loss(model: Any, batch: Batch, rng: jax.Array | None, *, family: Family,
                       objective: SummaryLossSettings) -> tuple[jax.Array, Metrics]:
    """Label-smoothed cross-entropy of the summary's tokens and EOS, every predicting stream of
    a family that has several (ProphetNet); `rng=None` is evaluation."""
    return ed.teacher_forced_loss(model, batch, rng, family=family,
                                  label_smoothing=objective.label_smoothing, all_streams=True)


def summarize_dev(model: Any, data: PreparedData, examples: SummaryExampleConfig,
                  family: Family) -> list[str]:
    """The summaries of the first `examples.rouge_examples` dev documents by the settings'
    beam search, detokenised up to EOS."""
    dev: DevSet = data.monitor_data
    count = data.report["rouge_examples"]
    outputs = ed.decode_rows(model, data.eval, count, examples.search, examples.decoded_length,
                             family, dev.tokenizer.pad_id)
    return [dev.tokenizer.decode(row) for row in outputs]


def rouge_monitor(model: Any, data: PreparedData, examples: SummaryExampleConfig,
                  objective: Any = None, *, family: Family) -> dict[str, float]:
    """ROUGE of the dev summaries the model writes (`summarize_dev`)."""
    dev: DevSet = data.monitor_data
    predictions = summarize_dev(model, data, examples, family)
    return rouge(predictions, dev.references[:len(predictions)], stemmer=examples.rouge_stemmer)


def summarize_rouge(evaluation: dict[str, float], report: dict[str, Any],
                    untrained: Any) -> list[str]:
    """The dev ROUGE beside lead-3's, and the held-out loss."""
    del untrained
    lines = []
    if "rouge1" in evaluation:
        lead3 = report["lead3_baseline"]
        scores = ", ".join(f"{name} {evaluation[name]:.2f} (lead-3 {lead3[name]:.2f})"
                           for name in ROUGE_TYPES)
        lines.append(f"  dev ROUGE F1 on {report['rouge_examples']} documents "
                     f"({report['decoding']}): {scores}")
    if "loss" in evaluation:
        lines.append(f"  held-out loss: {evaluation['loss']:.3f}")
    return lines


def check_summaries(model: Any, examples: SummaryExampleConfig,
                    objective: Any = None, *, family: Family) -> None:
    """Documents and summaries fit a model with learned positions (a prefix LM's both in one
    sequence); the language has an embedding."""
    limit = getattr(model, "max_length", None) or getattr(model, "max_position_embeddings",
                                                          None)
    target = max(examples.max_target_length, examples.decoded_length)
    longest = (family.positions(examples.max_source_length, target) if family.positions
               else max(examples.max_source_length, target))
    if limit is not None and longest > limit:
        raise UserError(f"the model has {limit} positions but examples.max_source_length / "
                        f"max_target_length / max_length reach {longest}; lower them")
    count = family.languages(model)
    if count and examples.language_id >= count:
        raise UserError(f"examples.language_id={examples.language_id} but the model has "
                        f"{count} language embeddings; use one of 0 .. {count - 1}")


# ---------------------------------------------------------------------------- recipes
# fairseq's Adam (bias-corrected, eps added before the correction, weight decay on every
# parameter) as MASS's, BART's and ProphetNet's fine-tuning use it.
FAIRSEQ_ADAM = {"optimizer": "adamw", "bias_correction": True,
                "eps_before_bias_correction": True, "decay_norms_and_biases": True,
                "b1": 0.9, "eps": 1e-8}
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
CNNDM_TRAIN_PAIRS = 287113  # See et al. 2017's non-anonymised CNN/DailyMail training split


def _epochs(epochs: int, batch_size: int) -> int:
    """Updates of `epochs` passes over CNN/DailyMail's training pairs at `batch_size`."""
    return epochs * math.ceil(CNNDM_TRAIN_PAIRS / batch_size)


PRESETS_T5 = {
    # microsoft/MASS MASS-summarization/README.md:102-123 (CNN/DailyMail), s2s_model.py:651-652.
    "mass_summarize": {
        "model": DROPOUT,
        "examples": {"max_source_length": 512, "max_target_length": 256, "num_beams": 5,
                     "length_penalty": 1.0, "min_length": 51, "max_length": 201,
                     "no_repeat_ngram_size": 3, "early_stopping": True},
        "objective": {"label_smoothing": 0.1},
        "optim": {**FAIRSEQ_ADAM, "b2": 0.98, "learning_rate": 5e-4,
                  "schedule": "inverse_sqrt_warmup", "warmup_steps": 4000,
                  "warmup_init_learning_rate": 1e-7, "weight_decay": 0.0, "clip_norm": 0.0},
        "train": {"batch_size": 64, "steps": _epochs(25, 64)},
    },
    # facebookresearch/fairseq examples/bart/README.summarization.md:48-75, summarize.py:11.
    "bart_summarize": {
        "model": DROPOUT,
        "examples": {"max_source_length": 1024, "max_target_length": 256, "num_beams": 4,
                     "length_penalty": 2.0, "min_length": 56, "max_length": 141,
                     "no_repeat_ngram_size": 3, "early_stopping": True},
        "objective": {"label_smoothing": 0.1},
        "optim": {**FAIRSEQ_ADAM, "b2": 0.999, "learning_rate": 3e-5,
                  "schedule": "linear_from_peak", "warmup_steps": 500, "weight_decay": 0.01,
                  "clip_norm": 0.1},
        "train": {"batch_size": 64, "steps": 20000},
    },
    # Raffel et al. 2020 §2.4 (the task prefix), §3.1.2 (fine-tuning), §3.7 (beam search).
    "t5_summarize": {
        "model": DROPOUT,
        "examples": {"max_source_length": 512, "max_target_length": 256,
                     "source_prefix": "summarize: ", "num_beams": 4, "length_penalty": 0.6},
        "objective": {"label_smoothing": 0.0},
        "optim": {"optimizer": "adafactor", "learning_rate": 1e-3, "schedule": "constant",
                  "warmup_steps": 0, "weight_decay": 0.0, "clip_norm": 0.0},
        "train": {"batch_size": 128, "steps": 262144},
    },
}
PRESETS_PROPHETNET = {
    # microsoft/ProphetNet ProphetNet/ProphetNet_En/README.md:47-90 (CNN/DailyMail).
    "prophetnet_summarize": {
        "model": DROPOUT,
        "examples": {"max_source_length": 510, "max_target_length": 256, "num_beams": 5,
                     "length_penalty": 1.2, "min_length": 46, "max_length": 111,
                     "no_repeat_ngram_size": 3, "early_stopping": True},
        "objective": {"label_smoothing": 0.1},
        "optim": {**FAIRSEQ_ADAM, "b2": 0.999, "learning_rate": 1e-4,
                  "schedule": "inverse_sqrt_warmup", "warmup_steps": 1000,
                  "warmup_init_learning_rate": 1e-7, "weight_decay": 0.01, "clip_norm": 0.1},
        "train": {"batch_size": 512, "steps": _epochs(10, 512)},
    },
}
# microsoft/unilm unilm-v1/README.md:186-205 (CNN/DailyMail fine-tuning), :210-227 (decoding);
# Dong et al. 2019 §3.2. The card (docs/methods/seq2seq.md) gives each value's line.
UNILM_STEPS = _epochs(30, 48)
PRESETS_UNILM = {
    "unilm_summarize": {
        "model": {**DROPOUT, "max_position_embeddings": 768},
        "examples": {"max_source_length": 566, "max_target_length": 201, "num_beams": 5,
                     "length_penalty": 1.0, "min_length": 0, "max_length": 128,
                     "no_repeat_ngram_size": 3, "early_stopping": False},
        "objective": {"label_smoothing": 0.1, "mask_prob": 0.7, "max_pred": 140,
                      "mask_source_words": False},
        "optim": {"optimizer": "adamw", "bias_correction": False, "b1": 0.9, "b2": 0.999,
                  "eps": 1e-8, "learning_rate": 3e-5, "schedule": "linear_from_peak",
                  "warmup_steps": round(0.1 * UNILM_STEPS), "weight_decay": 0.01,
                  "clip_norm": 1.0},
        "train": {"batch_size": 48, "steps": UNILM_STEPS},
    },
    # The test and demo size (`run.py finetune --recipe unilm_summarize_tiny`): short
    # documents and summaries, no dropout, a large rate and a short warmup.
    "unilm_summarize_tiny": {
        "model": {**NO_DROPOUT, "max_position_embeddings": 64},
        "examples": {"max_source_length": 40, "max_target_length": 12, "num_beams": 3,
                     "max_length": 12, "no_repeat_ngram_size": 3},
        "objective": {"label_smoothing": 0.1, "mask_prob": 0.7, "max_pred": 12},
        "optim": {"learning_rate": 2e-3, "schedule": "linear_from_peak", "warmup_steps": 10},
        "train": {"batch_size": 16, "steps": 200},
    },
}
# preset -> the epochs the recipe counts (None: it counts the preset's updates, train.steps)
RECIPE_EPOCHS = {"mass_summarize": 25, "bart_summarize": None, "t5_summarize": None,
                 "prophetnet_summarize": 10, "unilm_summarize": 30}
# preset -> its warmup as a share of the updates (run_seq2seq.py --warmup_proportion); others
# count warmup steps
RECIPE_WARMUP = {"unilm_summarize": 0.1}


def recipe_preset(model: Any, source_config: Mapping[str, Any]) -> str:
    """The recipe for a starting point: its family's, and for T5 models the pre-training
    objective's (`method` of the saved run config: MASS's; T5's text infilling is BART's; else
    T5's). XLM's encoder-decoder (a mass_xlm run, or an XLM) takes MASS's; a `unilm` run's
    BERT (or a fine-tuned prefix LM) UniLM's."""
    method = source_config.get("method", "")
    if type(model) in ed.FAMILIES["unilm"].starts_from:
        return "unilm_summarize"
    if isinstance(model, ed.FAMILIES["prophetnet"].model_class):
        return "prophetnet_summarize"
    if type(model) in ed.FAMILIES["xlm"].starts_from or method == "mass":
        return "mass_summarize"
    noise = source_config.get("examples", {}).get("noise", "")
    return "bart_summarize" if noise == "text_infilling" else "t5_summarize"


def summary_recipe(model: Any, task: DownstreamTask, source_config: Mapping[str, Any], *,
                   name: str, family: Family, recipes: tuple[str, ...] = ()
                   ) -> FinetuneRecipe | None:
    """The summarisation run of `model` when it is this family's (`Start.finetunes`): the
    model's architecture, the recipe preset's other sections and its dropout; `recipes`, the
    method's presets that `run.py finetune --recipe` may choose instead."""
    if task.name != SUMMARIZE or type(model) not in family.starts_from:
        return None
    preset_name = recipe_preset(model, source_config)
    preset = registry.preset(preset_name)
    skipped = RUN_FIELDS | family.free_fields
    values: dict[str, Any] = {f"model.{k}": v for k, v in dataclasses.asdict(model.config).items()
                              if k not in skipped}
    values.update({f"{section}.{k}": v for section, settings in preset.items()
                   if section != "method" for k, v in settings.items()})
    values["method"] = name
    epochs = RECIPE_EPOCHS[preset_name]
    return FinetuneRecipe(values, epochs=epochs or 0, warmup=RECIPE_WARMUP.get(preset_name, 0.0),
                          steps=0 if epochs else preset["train"]["steps"],
                          warmup_steps=preset["optim"]["warmup_steps"],
                          tokenizer_from_init=True, recipes=recipes)


register_task(DownstreamTask(  # `run.py finetune --task summarize`
    name=SUMMARIZE, method=SUMMARIZE, num_labels=0, train_rows=summarize_train_rows,
    metrics=ROUGE_TYPES, main_metric="rougeLsum", baseline="lead3_baseline",
    baseline_name="lead-3", aliases=("summarise", "summarization", "summarisation")))


def summarization_method(name: str, family: Family, presets: Mapping[str, Any], *,
                         objective_config: type = SummaryLossSettings,
                         loss: Callable[..., Any] | None = None) -> Method:
    """The fine-tuning method of one family: the teacher-forced `summarization_loss`, or
    `loss` with its settings `objective_config`."""
    return Method(
        name=name,
        model_config=family.model_config,
        example_config=SummaryExampleConfig,
        objective_config=objective_config,
        build_model=family.build_model,
        loss=loss or functools.partial(summarization_loss, family=family),
        prepare=functools.partial(prepare_summaries, family=family),
        units_per_example=lambda examples: (examples.max_source_length
                                            + examples.max_target_length),
        description=f"Summarisation fine-tuning with beam search and ROUGE ({name})",
        presets=presets,
        resolution=Resolution(check=functools.partial(check_summaries, family=family)),
        evaluation=Evaluation(monitor=functools.partial(rouge_monitor, family=family),
                              summarize=summarize_rouge),
        start=Start(pretrained=functools.partial(ed.pretrained_start, family=family),
                    finetunes=functools.partial(summary_recipe, name=name, family=family,
                                                recipes=tuple(presets))),
    )


for _name, _family, _presets in ((SUMMARIZE, ed.FAMILIES["t5"], PRESETS_T5),
                                 (f"{SUMMARIZE}_prophetnet", ed.FAMILIES["prophetnet"],
                                  PRESETS_PROPHETNET),
                                 (f"{SUMMARIZE}_xlm", ed.FAMILIES["xlm"], {})):
    register(summarization_method(_name, _family, _presets))
register(summarization_method(f"{SUMMARIZE}_unilm", ed.FAMILIES["unilm"], PRESETS_UNILM,
                              objective_config=MaskedTargetSettings, loss=masked_target_loss))
