"""XLM pre-training (Lample & Conneau 2019, §3): causal LM (CLM, §3.1), masked LM on streams of
monolingual text (MLM, §3.2), translation LM on sentence pairs (TLM, §3.3), or MLM and TLM
alternating step by step as the paper trains them (§3.3, §5: "we alternate between MLM and
TLM"), on one XLM model with language embeddings; `examples.task` picks one (the records
differ, so it is a data setting, as t5's `examples.noise`; the model is causal exactly for CLM,
set from the data).

Data (`input_pipeline.examples.xlm`): CLM / MLM read `data.source` = `en=PATH,de=PATH` (any text
sources), one shared sentencepiece vocabulary sampled by q ~ p^0.5, 256-token streams per
language; held-out = `data.held_out_fraction` of every language. TLM reads a parallel corpus
(`input_pipeline.parallel`) in `data.source`, one record set per direction, and holds out the
parallel corpus `data.eval_source`, or without one `data.held_out_fraction` of the aligned
lines. MLM + TLM (`mlm_tlm`) reads both: the streams of `data.source` and the pairs of
`examples.tlm_source` (held out by the fraction). Every step reads one language or one
direction (`StepSchedule`, the reference's `shuf_order` cycles over `--mlm_steps`), so the
batches keep one shape and the step stays one compiled function. MLM/TLM masks are drawn at
every load by count^-0.5 weights (`XLMMasking`); held-out masks are drawn once with a fixed
seed (`text.mask_records`).

Losses (facebookresearch/XLM src/trainer.py `clm_step`, `mlm_step`): CLM = next-token
cross-entropy over the real tokens of a stream; MLM / TLM = cross-entropy at the masked
positions (`text.weighted_cross_entropy`), with the records' positions (reset for a TLM
translation) and per-token language ids.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import xlm as xlm_examples
from pretext_jax.input_pipeline.examples.bert import MaskingVocab, majority_baseline_accuracy
from pretext_jax.input_pipeline.parallel import open_parallel
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.input_pipeline.records import RecordDirectory
from pretext_jax.models.xlm import XLM, XLMConfig
from pretext_jax.objectives.common.classifier_recipes import ClassifierSettings, claims_encoders
from pretext_jax.objectives.common.held_out import MAX_EVAL_EXAMPLES, mask_records, stacked_records
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.preset_parts import XLM_BASE, XLM_TINY
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    Summarize,
    per_step_source,
    register,
    summary_of,
)


def xlm_loss(model: XLM, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """CLM loss on a causal model, else the masked-LM loss (MLM and TLM); `rng=None` disables
    dropout."""
    ids, mask = batch["input_ids"], batch["input_mask"]
    inputs = {"langs": batch["langs"], "position_ids": batch["positions"], "rng": rng}
    if model.config.causal:
        logits = model(ids, mask, **inputs).logits[:, :-1]
        loss, lm = weighted_cross_entropy(logits, ids[:, 1:], mask[:, 1:])
        kind = "clm"
    else:
        logits = model(ids, mask, masked_positions=batch["masked_lm_positions"], **inputs).logits
        loss, lm = weighted_cross_entropy(logits, batch["masked_lm_ids"],
                                          batch["masked_lm_weights"])
        kind = "mlm"
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), f"{kind}_loss": lm["loss"],
                  f"{kind}_accuracy": lm["accuracy"]}


def build_xlm(config: XLMConfig, seed: int) -> XLM:
    return XLM(config, rngs=nnx.Rngs(seed))


def held_out_examples(directories: list[RecordDirectory]) -> dict[str, np.ndarray]:
    """The first held-out records of each directory, at most `MAX_EVAL_EXAMPLES` in all,
    interleaved (a record of each set in turn), so the first evaluation batches cover every
    language and pair."""
    share = MAX_EVAL_EXAMPLES // max(len(directories), 1)
    kept = stacked_records([d.examples(range(min(len(d), share))) for d in directories
                            if len(d)])
    turn = np.concatenate([np.arange(min(len(d), share)) for d in directories if len(d)])
    return {key: values[np.argsort(turn, kind="stable")] for key, values in kept.items()}


@dataclasses.dataclass
class XLMSets:
    """The prepared record sets: training and held-out streams per language (`mono`, CLM /
    MLM) and TLM records per direction (`pairs`, "en-de"), the shared tokenizer and the
    language ids."""

    tokenizer: Any
    ids: dict[str, int]
    language_count: int
    """Language embeddings: the tokenizer's checkpoint table's size, else len(ids)."""
    mono: dict[str, tuple[RecordDirectory, RecordDirectory]] = dataclasses.field(
        default_factory=dict)
    pairs: dict[str, tuple[RecordDirectory, RecordDirectory]] = dataclasses.field(
        default_factory=dict)


def tlm_splits(spec: str, eval_spec: str, fraction: float, seed: int
               ) -> tuple[xlm_examples.LineSplit | None, tuple[str, xlm_examples.LineSplit | None]]:
    """Where TLM's training and held-out pairs come from: all of the parallel corpus `spec` and
    the parallel corpus `eval_spec`, or without one, `fraction` of `spec`'s aligned lines held
    out (fixed seed) and the rest trained on."""
    if eval_spec:
        return None, (eval_spec, None)
    split = functools.partial(xlm_examples.LineSplit, fraction, seed)
    return split(held_out=False), (spec, split(held_out=True))


def prepare_pairs(sets: XLMSets, spec: str, eval_spec: str, data: DataConfig,
                  examples: xlm_examples.XLMExampleConfig, cache_dir: Path, seed: int) -> None:
    """Adds each TLM direction's (training, held-out) records (`tlm_splits`) to `sets`."""
    train_split, (held_spec, held_split) = tlm_splits(spec, eval_spec, data.held_out_fraction,
                                                      seed)
    for first, second in xlm_examples.tlm_directions(open_parallel(spec).languages, examples):
        direction = dataclasses.replace(examples, tlm_pairs=f"{first}-{second}")
        train, held = (xlm_examples.prepare_tlm(source, sets.tokenizer, direction, sets.ids,
                                                cache_dir, split)
                       for source, split in ((spec, train_split), (held_spec, held_split)))
        sets.pairs[f"{first}-{second}"] = (train, held)


def prepare_sets(data: DataConfig, examples: xlm_examples.XLMExampleConfig, cache_dir: Path,
                 seed: int) -> XLMSets:
    """CLM / MLM: the streams of `data.source`'s languages; TLM: the pairs of the parallel
    corpus `data.source` (held out: `data.eval_source` or a fraction of its lines), tokenizer
    trained on its training lines; MLM + TLM: both, the pairs from `examples.tlm_source`."""
    if examples.task == "tlm":
        split = tlm_splits(data.source, data.eval_source, data.held_out_fraction, seed)[0]
        tokenizer = xlm_examples.parallel_tokenizer(data.source, data, examples, cache_dir,
                                                    seed, split)
        sets = XLMSets(tokenizer, *xlm_examples.tokenizer_language_ids(
            open_parallel(data.source).languages, tokenizer))
        prepare_pairs(sets, data.source, data.eval_source, data, examples, cache_dir, seed)
        return sets
    corpora = xlm_examples.parse_corpora(data.source)
    mono, tokenizer = xlm_examples.prepare_streams(corpora, data, examples, cache_dir, seed)
    sets = XLMSets(tokenizer, *xlm_examples.tokenizer_language_ids(corpora, tokenizer),
                   mono=mono)
    if examples.task == "mlm_tlm":
        prepare_pairs(sets, examples.tlm_source, "", data, examples, cache_dir, seed)
    return sets


def step_schedule(sets: XLMSets, examples: xlm_examples.XLMExampleConfig, seed: int
                  ) -> tuple[xlm_examples.StepSchedule, np.ndarray]:
    """(The training steps' schedule, the training token counts of every set): languages
    sampled by q ~ p^alpha over their sentence counts, pairs by q over their pair counts."""
    vocab_size, eos = sets.tokenizer.vocab_size, sets.tokenizer.eos_id
    counts = {name: xlm_examples.stream_statistics(train, vocab_size)
              for name, (train, _) in {**sets.mono, **sets.pairs}.items()}
    alpha = examples.language_alpha
    q_mono = (xlm_examples.language_probabilities(
        {language: int(counts[language][eos]) for language in sets.mono}, alpha)
        if sets.mono else [])
    q_pairs = (xlm_examples.language_probabilities(
        {pair: len(train) for pair, (train, _) in sets.pairs.items()}, alpha)
        if sets.pairs else [])
    schedule = xlm_examples.StepSchedule(
        {name: train for name, (train, _) in sets.mono.items()}, q_mono,
        {name: train for name, (train, _) in sets.pairs.items()}, q_pairs, seed)
    return schedule, sum(counts.values())


def prepare_xlm(data: DataConfig, examples: xlm_examples.XLMExampleConfig, cache_dir: Path,
                seed: int) -> PreparedData:
    """Records of `examples.task`, read one language or pair per step (`StepSchedule`); MLM /
    TLM masks drawn while loading with count^-alpha weights of the training tokens, the
    held-out ones once with a fixed seed. The data sets the model's vocabulary, languages,
    padding id and whether it is causal."""
    sets = prepare_sets(data, examples, cache_dir, seed)
    schedule, counts = step_schedule(sets, examples, seed)
    held_out = held_out_examples([held for _, held in (*sets.mono.values(),
                                                       *sets.pairs.values())])
    transforms: tuple[Any, ...] = ()
    if examples.task == "clm":
        targets = held_out["input_ids"][:, 1:][held_out["input_mask"][:, 1:] > 0]
        baseline = float(np.bincount(targets).max() / max(len(targets), 1))
        report = {"majority_baseline_clm_accuracy": baseline}
    else:
        vocab = MaskingVocab.from_tokenizer(sets.tokenizer)
        transforms = (xlm_examples.XLMMasking(
            vocab, xlm_examples.mask_weights(counts, examples.mask_alpha, vocab), examples),)
        held_out = mask_records(held_out, transforms[0], seed + 2)
        report = {"majority_baseline_mlm_accuracy": majority_baseline_accuracy(held_out)}
    tokenizer = sets.tokenizer
    return PreparedData(
        train=schedule, segments=per_step_source(schedule.for_global_batch), eval=held_out,
        transforms=transforms, report=report, tokenizer=tokenizer,
        model_fields={"vocab_size": tokenizer.vocab_size, "n_langs": sets.language_count,
                      "pad_token_id": tokenizer.pad_id, "causal": examples.task == "clm"})


def check_xlm(model: XLMConfig, examples: xlm_examples.XLMExampleConfig,
              objective: Any = None) -> None:
    """Every position of a record has an embedding; a causal model is CLM's; no decoder is
    pre-trained. No `objective` setting bears on it."""
    if examples.stream_length > model.max_position_embeddings:
        raise UserError(f"examples.stream_length={examples.stream_length} exceeds "
                        f"model.max_position_embeddings={model.max_position_embeddings}; lower "
                        "the first or raise the second")
    if model.is_decoder:
        raise UserError("model.is_decoder is the translation decoder (models.xlm.XLMTranslation);"
                        " XLM pre-trains the encoder: set model.is_decoder=false")
    if model.causal and examples.task != "clm":
        raise UserError(f"model.causal=true is XLM's CLM, not {examples.task}; set "
                        "examples.task=clm or model.causal=false")


def summarize_xlm(evaluation: dict[str, float], report: dict[str, Any], untrained: Any
                  ) -> list[str]:
    """The held-out CLM or MLM accuracy beside its majority-token baseline, and the loss."""
    kind = "clm" if "clm_accuracy" in evaluation else "mlm"
    summarize: Summarize = summary_of(accuracy=kind)
    return summarize(evaluation, report, untrained)


PRESETS = {"xlm_tiny": XLM_TINY, "xlm_base": XLM_BASE}



def glue_settings(hidden_size: int, task: str) -> ClassifierSettings:
    """XLM's GLUE fine-tuning (facebookresearch/XLM README, GLUE with glue-xnli.py): Adam at a
    constant lr 2.5e-5 (`--optimizer_e adam,lr=0.000025`, from its sweep {0.5, 2.5,
    12.5}e-5), no warmup or weight decay, epsilon 1e-8 (torch's Adam), batch 8 (of {4, 8}),
    inputs `</s> A </s> B </s>`. The reference runs 250 "epochs" of 20,000 sentences and keeps
    the best dev score; here 3 epochs of the task, as BERT's.

    SQuAD (`squad`, `squad2`): facebookresearch/XLM has no SQuAD fine-tuning, so BERT's SQuAD
    schedule (google-research/bert README: lr 3e-5, batch 24, 2 epochs, 10% warmup, linear
    decay) with XLM's Adam (epsilon 1e-8, no weight decay), at SQuAD's length 384."""
    del hidden_size
    if task in ("squad", "squad2"):
        return ClassifierSettings(learning_rate=3e-5, epochs=2, weight_decay=0.0,
                                  batch_size=24, eps=1e-8)
    return ClassifierSettings(learning_rate=2.5e-5, epochs=3, weight_decay=0.0,
                              schedule="constant", batch_size=8, warmup=0.0, eps=1e-8)


register(Method(
    name="xlm",
    model_config=XLMConfig,
    example_config=xlm_examples.XLMExampleConfig,
    build_model=build_xlm,
    loss=xlm_loss,
    prepare=prepare_xlm,
    units_per_example=lambda examples: examples.stream_length,
    description="XLM: causal, masked or translation LM with language embeddings on a shared "
                "vocabulary (Lample & Conneau 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_xlm),
    evaluation=Evaluation(summarize=summarize_xlm),
    start=Start(hf_models=(XLM,), finetunes=claims_encoders("xlm", glue_settings)),
))
