"""Unicoder pre-training (Huang et al. 2019, EMNLP, §3): on one XLM-structured model
(`models.unicoder.Unicoder`), XLM's masked LM (MLM) and translation LM (TLM) plus the three
cross-lingual tasks the paper adds: word recovery (§3.1), paraphrase classification (§3.2) and
masked LM over cross-lingual documents (§3.3).

Data (`input_pipeline.examples.unicoder`): a line-aligned parallel corpus of two languages in
`data.source` (e.g. Multi30K's `train.en,train.de`); held out: the parallel corpus
`data.eval_source`, or without one `data.held_out_fraction` of the aligned lines (fixed seed).
One shared sentencepiece vocabulary (XLM §3.1), language ids in sorted order (a checkpoint's own,
below). Every record holds
every task's fields, so each batch trains all five tasks (see `unicoder_loss`).

Start (§4: Unicoder continues XLM-15's MLM + TLM model): `model.init` names an XLM (an HF folder
such as xlm-mlm-tlm-xnli15-1024, or a pretext XLM or Unicoder run) whose weights start the
Transformer, with `data.tokenizer` its tokenizer (the HF folder: XLM's Moses + BPE tokenizer and
its language table for the language ids, `tokenizer_language_ids`; a workdir's `tokenizer/`);
W and the paraphrase layer start at random.

Loss: the sum of the five task losses (`objective.*_weight`, 1 each), each a mean over its own
targets: MLM, TLM and
cross-lingual MLM, cross-entropy at the masked positions (XLM's `mlm_step`); word recovery,
cross-entropy of the original source word at every source position; paraphrase
classification, two-class cross-entropy on the first token's state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import unicoder as unicoder_examples
from pretext_jax.input_pipeline.examples.bert import MaskingVocab, majority_baseline_accuracy
from pretext_jax.input_pipeline.examples.xlm import (
    LineSplit,
    mask_weights,
    parallel_tokenizer,
    tokenizer_language_ids,
)
from pretext_jax.input_pipeline.prepare import DataConfig
from pretext_jax.models.layers import split_rng
from pretext_jax.models.unicoder import Unicoder
from pretext_jax.models.xlm import XLM, XLMConfig
from pretext_jax.objectives.common.held_out import MAX_EVAL_EXAMPLES, mask_records
from pretext_jax.objectives.common.losses import weighted_cross_entropy
from pretext_jax.objectives.common.preset_parts import XLM_BASE, XLM_TINY
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
    summary_of,
)

TASKS = ("mlm", "tlm", "xmlm", "wr", "pc")
"""The loss terms: masked LM, translation LM, cross-lingual masked LM (§3.3), word recovery
(§3.1), paraphrase classification (§3.2)."""


@dataclasses.dataclass(frozen=True)
class UnicoderConfig(XLMConfig):
    """XLM's structure (`models.xlm.XLMConfig`), and the XLM the run may start from."""

    init: str = ""
    """Start from this XLM (§4: XLM-15's MLM + TLM model): an HF folder (the paper's:
    xlm-mlm-tlm-xnli15-1024), a pretext XLM or Unicoder workdir or model directory of the same
    architecture, with data.tokenizer its tokenizer (the HF folder itself, a workdir's
    `tokenizer/`); '' = random initialisation."""


@dataclasses.dataclass(frozen=True)
class UnicoderLossSettings:
    """Each task's weight in the summed loss (1 each: the five tasks counted alike; 0 leaves a
    task out, for ablations)."""

    mlm_weight: float = 1.0
    """Masked LM on the monolingual streams."""
    tlm_weight: float = 1.0
    """Translation LM."""
    xmlm_weight: float = 1.0
    """Cross-lingual masked LM (§3.3)."""
    wr_weight: float = 1.0
    """Cross-lingual word recovery (§3.1)."""
    pc_weight: float = 1.0
    """Cross-lingual paraphrase classification (§3.2)."""

    def __post_init__(self) -> None:
        weights = [getattr(self, f"{task}_weight") for task in TASKS]
        if min(weights) < 0 or not any(weights):
            raise UserError("objective.*_weight must be >= 0 with at least one above 0")


def task_losses(model: Unicoder, batch: Batch, rng: jax.Array | None
                ) -> dict[str, tuple[jax.Array, Metrics]]:
    """Each task's (loss, {"loss", "accuracy"}) on the batch's fields of that task; `rng=None`
    disables dropout."""
    rngs = dict(zip(TASKS, split_rng(rng, len(TASKS)), strict=True))
    out = {}
    for group in unicoder_examples.MASKED:
        logits = model.transformer(
            batch[f"{group}_input_ids"], batch[f"{group}_input_mask"],
            langs=batch[f"{group}_langs"], position_ids=batch[f"{group}_positions"],
            masked_positions=batch[f"{group}_masked_lm_positions"], rng=rngs[group]).logits
        out[group] = weighted_cross_entropy(logits, batch[f"{group}_masked_lm_ids"],
                                            batch[f"{group}_masked_lm_weights"])
    logits = model.recover(batch["wr_source"], batch["wr_source_mask"], batch["wr_target"],
                           batch["wr_target_mask"], batch["wr_langs"][:, 0], rng=rngs["wr"])
    out["wr"] = weighted_cross_entropy(logits, batch["wr_source"], batch["wr_source_mask"])
    logits = model.paraphrase_logits(batch["pc_input_ids"], batch["pc_input_mask"],
                                     batch["pc_langs"], batch["pc_positions"], rng=rngs["pc"])
    labels = batch["pc_label"][:, 0]
    out["pc"] = weighted_cross_entropy(logits, labels, jnp.ones(labels.shape, jnp.float32), 0.0)
    return out


def unicoder_loss(model: Unicoder, batch: Batch, rng: jax.Array | None, *,
                  objective: UnicoderLossSettings = UnicoderLossSettings()
                  ) -> tuple[jax.Array, Metrics]:
    """The weighted sum of the five task losses (`task_losses`; weights 1 by default), with
    each task's loss and accuracy."""
    terms = task_losses(model, batch, rng)
    loss = sum(getattr(objective, f"{name}_weight") * term[0] for name, term in terms.items())
    metrics: Metrics = {"loss": (loss, jnp.ones((), jnp.float32))}
    for name, (_, parts) in terms.items():
        metrics[f"{name}_loss"] = parts["loss"]
        metrics[f"{name}_accuracy"] = parts["accuracy"]
    return loss, metrics


def build_unicoder(config: XLMConfig, seed: int) -> Unicoder:
    return Unicoder(config, rngs=nnx.Rngs(seed))


def pretrained_unicoder(config: UnicoderConfig, seed: int, load: Callable[[str], nnx.Module]
                        ) -> Unicoder | None:
    """The run's model with the Transformer of the XLM at `config.init` (a Unicoder's: every
    weight), or None for a random start. The data's tokenizer must be the checkpoint's (its
    ids and language table); another architecture is a UserError naming the setting."""
    if not config.init:
        return None
    if not Path(config.init).is_dir():
        raise UserError(f"model.init={config.init} is not a directory; download the XLM to start "
                        "from (the paper: xlm-mlm-tlm-xnli15-1024, e.g. huggingface-cli download "
                        "FacebookAI/xlm-mlm-tlm-xnli15-1024 --local-dir FOLDER) and pass "
                        "model.init=FOLDER data.tokenizer=FOLDER")
    loaded = load(config.init)
    if type(loaded) not in (XLM, Unicoder):
        raise UserError(f"{config.init} holds a {type(loaded).__name__}, not the XLM that "
                        "Unicoder continues from")
    recorded = Path(config.init) / "tokenizer"  # a pretext workdir's own
    own = recorded if recorded.is_dir() else Path(config.init)
    for field, what in (("vocab_size", "token ids"), ("n_langs", "languages")):
        ours, theirs = getattr(config, field), getattr(loaded.config, field)
        if ours != theirs:
            raise UserError(f"the data's tokenizer gives {ours} {what} but {config.init} has "
                            f"{theirs}; pass data.tokenizer={own} (its vocabulary and "
                            "language table)")
    check_same_architecture(config, loaded.config, config.init)
    fresh = build_unicoder(config, seed)
    nnx.update(fresh if type(loaded) is Unicoder else fresh.transformer,
               nnx.state(loaded, nnx.Param))
    return fresh


def held_out_split(data: DataConfig, seed: int) -> tuple[LineSplit | None, str, LineSplit | None]:
    """(training split, held-out corpus, held-out split): all of `data.source` and
    `data.eval_source`, or without one a fixed-seed `data.held_out_fraction` of the lines."""
    if data.eval_source:
        return None, data.eval_source, None
    split = functools.partial(LineSplit, data.held_out_fraction, seed)
    return split(held_out=False), data.source, split(held_out=True)


def prepare_unicoder(data: DataConfig, examples: unicoder_examples.UnicoderExampleConfig,
                     cache_dir: Path, seed: int) -> PreparedData:
    """The records of every task from the parallel corpus `data.source`, shuffled; the MLM /
    TLM / cross-lingual MLM masks drawn at every load with count^-alpha weights of the training
    tokens, the held-out ones once with a fixed seed. The data sets the vocabulary, the
    languages and the padding id."""
    languages = unicoder_examples.parallel_languages(data.source)
    train_split, held_spec, held_split = held_out_split(data, seed)
    if held_spec != data.source:
        unicoder_examples.parallel_languages(held_spec)
    tokenizer = parallel_tokenizer(data.source, data, examples, cache_dir, seed, train_split)
    ids, language_count = tokenizer_language_ids(languages, tokenizer)
    train, held = (unicoder_examples.prepare_unicoder_records(
        spec, tokenizer, examples, ids, cache_dir, seed + offset, split)
        for spec, split, offset in ((data.source, train_split, 0),
                                    (held_spec, held_split, 1)))
    if not len(held):
        raise UserError("nothing was held out for evaluation; raise data.held_out_fraction or "
                        "set data.eval_source")
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    masking = unicoder_examples.UnicoderMasking(
        vocab, mask_weights(unicoder_examples.token_counts(train, tokenizer.vocab_size),
                            examples.mask_alpha, vocab), examples)
    held_out = mask_records(held.examples(range(min(len(held), MAX_EVAL_EXAMPLES))), masking,
                            seed + 2)
    baseline = majority_baseline_accuracy({"masked_lm_ids": held_out["xmlm_masked_lm_ids"],
                                           "masked_lm_weights": held_out["xmlm_masked_lm_weights"]})
    return PreparedData(
        train=train, eval=held_out, transforms=(masking,), tokenizer=tokenizer,
        report={"majority_baseline_xmlm_accuracy": baseline,
                "paraphrase_negative_rate": examples.paraphrase_negative_rate},
        model_fields={"vocab_size": tokenizer.vocab_size, "n_langs": language_count,
                      "pad_token_id": tokenizer.pad_id})


def check_unicoder(model: UnicoderConfig, examples: unicoder_examples.UnicoderExampleConfig,
                   objective: Any = None) -> None:
    """Every position of a record has an embedding; the encoder is bidirectional and not a
    decoder; the languages have embeddings. No `objective` setting bears on it."""
    if examples.stream_length > model.max_position_embeddings:
        raise UserError(f"examples.stream_length={examples.stream_length} exceeds "
                        f"model.max_position_embeddings={model.max_position_embeddings}; lower "
                        "the first or raise the second")
    if model.causal or model.is_decoder:
        raise UserError("Unicoder pre-trains a bidirectional encoder: set model.causal=false "
                        "and model.is_decoder=false")
    if not model.use_lang_emb:
        raise UserError("Unicoder keeps XLM's language embeddings: set model.use_lang_emb=true")


# Unicoder (Huang et al. 2019 §4) starts from XLM's 15-language MLM + TLM model and keeps its
# structure (facebookresearch/XLM README, the XNLI-15 command: 12 layers of 1024, 8 heads);
# the rest is XLM's recipe (`preset_parts.XLM_BASE`). docs/methods/seq2seq.md's card says what
# the paper gives and what could not be re-checked.
PRESETS = {
    "unicoder_tiny": XLM_TINY,
    "unicoder_base": {**XLM_BASE, "model": {**XLM_BASE["model"], "num_layers": 12}},
}


register(Method(
    name="unicoder",
    model_config=UnicoderConfig,
    example_config=unicoder_examples.UnicoderExampleConfig,
    objective_config=UnicoderLossSettings,
    build_model=build_unicoder,
    loss=unicoder_loss,
    prepare=prepare_unicoder,
    units_per_example=lambda examples: examples.stream_length,
    description="Unicoder: XLM's MLM and TLM plus cross-lingual word recovery, paraphrase "
                "classification and cross-lingual MLM on parallel text (Huang et al. 2019)",
    presets=PRESETS,
    resolution=Resolution(check=check_unicoder),
    start=Start(pretrained=pretrained_unicoder),
    evaluation=Evaluation(summarize=summary_of(
        accuracy="xmlm", metrics=("pc_accuracy", "wr_accuracy", "tlm_accuracy", "loss"))),
))
