"""Fine-tuning on token classification (named entities), as a method of the one trainer (`tag`):
a linear layer over the encoder's final states (`models.classifier.TokenClassifier`, HF
`*ForTokenClassification`), cross-entropy on the first word piece of every word (Devlin et al.
2019 §5.3, the fine-tuning approach), entity-level precision / recall / F1 on the whole dev
set at every evaluation, beside the all-O baseline (F1 0).

Data: CoNLL-style files (`input_pipeline.conll`; `--data` a folder with train/dev files, e.g.
WNUT-17's, or `TRAIN,DEV`). The families that fine-tune an encoder (BERT, ELECTRA, RoBERTa,
ALBERT, MPNet, XLNet, XLM) give their recipes for task `ner` through `claims_encoders`, as for
GLUE.

Metric: the CoNLL-2000 `conlleval` script's chunking, which `seqeval`'s default mode follows:
a chunk starts at B-/S-, at an I-/E- after O, E- or S-, or where the type changes; it ends before
a B-/S-/O, after E-/S-, or where the type changes. An entity is correct when its type and both
ends match a gold entity; precision, recall and F1 are micro-averaged over all entities.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import conll, prepare
from pretext_jax.input_pipeline.prepare import (
    DataConfig,
    fingerprint,
    source_fingerprint,
    tokenizer_identity,
)
from pretext_jax.input_pipeline.records import RecordDirectory, write_records
from pretext_jax.models.classifier import TokenClassifier, from_pretrained
from pretext_jax.objectives.common.classifier_recipes import (
    FinetuneModelConfig,
    check_input_length,
    layout_of,
    load_encoder,
)
from pretext_jax.objectives.registry import (
    Batch,
    DownstreamTask,
    Evaluation,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    Start,
    register,
    register_task,
)

TAG = "tag"
NER_METRICS = ("f1", "precision", "recall")


@dataclasses.dataclass(frozen=True)
class TagExampleConfig:
    """The task (`ner`), `max_seq_length` (pieces per window incl. the 2 special tokens),
    `stride` (pieces between window starts; 0 = half a window), `max_train_examples` (0 = all
    sentences) and `layout` (as GLUE's: bert, roberta, xlnet or xlm)."""

    task: str = "ner"
    """Downstream task: ner (CoNLL-style files, BIO or BIOES)."""
    max_seq_length: int = 128
    """Pieces per window incl. special tokens; longer sentences are windowed."""
    stride: int = 0
    """Pieces between the starts of a long sentence's windows; 0 = half a window."""
    max_train_examples: int = 0
    """Train on the first n training sentences only; 0 = all."""
    layout: str = "bert"
    """Input layout: bert ([CLS] A [SEP]), roberta (<s> A </s>), xlnet (A <sep> <cls>,
    left-padded) or xlm."""


# ---------------------------------------------------------------------------- entity metrics
def _split(tag: str) -> tuple[str, str]:
    return ("O", "") if tag == "O" else (tag[0], tag[2:])


def _ends(prev: str, prev_type: str, tag: str, kind: str) -> bool:
    """conlleval `endOfChunk`: does the chunk holding the previous tag end before this one?"""
    if prev in ("E", "S"):
        return True
    if prev in ("B", "I"):
        return tag in ("B", "S", "O") or kind != prev_type
    return False


def _starts(prev: str, prev_type: str, tag: str, kind: str) -> bool:
    """conlleval `startOfChunk`: does a chunk start at this tag?"""
    if tag in ("B", "S"):
        return True
    if tag in ("I", "E"):
        return prev in ("O", "E", "S") or kind != prev_type
    return False


def entities(tags: Sequence[str]) -> set[tuple[str, int, int]]:
    """The (type, first, last) chunks of one sentence's BIO or BIOES tags (conlleval)."""
    found = set()
    prev, prev_type, begin = "O", "", 0
    for position, tag in enumerate([*tags, "O"]):
        kind_tag, kind = _split(tag)
        if prev != "O" and _ends(prev, prev_type, kind_tag, kind):
            found.add((prev_type, begin, position - 1))
        if _starts(prev, prev_type, kind_tag, kind):
            begin = position
        prev, prev_type = kind_tag, kind
    return found


def entity_scores(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]
                  ) -> dict[str, float]:
    """Micro precision, recall and F1 of the predicted entities over all sentences (0 where
    undefined, as seqeval)."""
    correct = guessed = actual = 0
    for gold_tags, predicted_tags in zip(gold, predicted, strict=True):
        truth, guess = entities(gold_tags), entities(predicted_tags)
        correct += len(truth & guess)
        guessed += len(guess)
        actual += len(truth)
    precision = correct / guessed if guessed else 0.0
    recall = correct / actual if actual else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"f1": f1, "precision": precision, "recall": recall}


# ---------------------------------------------------------------------------- the method
def tagging_loss(model: TokenClassifier, batch: Batch, rng: jax.Array | None
                 ) -> tuple[jax.Array, Metrics]:
    """Mean cross-entropy over the labelled positions (each word's first piece) of the batch."""
    logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                   rng=rng).astype(jnp.float32)
    labels = batch["labels"].astype(jnp.int32)
    mask = (labels != conll.IGNORE).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(log_probs, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    count = jnp.sum(mask)
    loss = -jnp.sum(picked * mask) / jnp.maximum(count, 1.0)
    correct = jnp.sum((jnp.argmax(logits, -1) == labels) * mask)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), "token_accuracy": (correct, count)}


@nnx.jit
def _logits(model: TokenClassifier, input_ids: jax.Array, token_type_ids: jax.Array,
            attention_mask: jax.Array) -> jax.Array:
    return model(input_ids, token_type_ids, attention_mask)


def predict_tags(model: TokenClassifier, features: dict[str, np.ndarray], sentences:
                 conll.TaggedSentences, labels: Sequence[str], batch_size: int = 64
                 ) -> list[list[str]]:
    """Every word's predicted tag, read at its first piece in the window that predicts it."""
    predicted = [["O"] * len(words) for words in sentences.words]
    for start in range(0, len(features["input_ids"]), batch_size):
        ids = np.asarray(_logits(model, *(features[k][start:start + batch_size] for k in (
            "input_ids", "token_type_ids", "attention_mask")))).argmax(-1)
        for row, sentence in enumerate(features["sentence"][start:start + batch_size]):
            words = features["word"][start + row]
            for position in np.flatnonzero(words >= 0):
                predicted[sentence][words[position]] = labels[ids[row, position]]
    return predicted


def score_file(model: TokenClassifier, path: str | Path, labels: Sequence[str],
               tokenizer: Any, examples: TagExampleConfig) -> dict[str, float]:
    """Entity precision, recall and F1 of `model` on the CoNLL-style file `path` (e.g. a test
    split), encoded as the run encodes its dev file."""
    sentences = conll.read_conll(path)
    features = conll.encode_tagged(sentences, tuple(labels), tokenizer, examples.max_seq_length,
                                   examples.layout, examples.stride)
    return entity_scores(sentences.tags, predict_tags(model, features, sentences, labels))


def ner_monitor(model: TokenClassifier, data: PreparedData, examples: TagExampleConfig,
                objective: Any = None) -> dict[str, float]:
    """Entity precision, recall and F1 on the whole dev set."""
    gold = data.report["dev_sentences"]
    return entity_scores(gold.tags, predict_tags(model, data.eval, gold,
                                                 data.report["labels"]))


def prepare_ner(data: DataConfig, examples: TagExampleConfig, cache_dir: Path,
                seed: int) -> PreparedData:
    """Training sentences -> encoded windows (cached under a fingerprint of the file,
    tokenizer and settings); the dev file encoded in memory; the label set from the training
    file; the all-O baseline's dev metrics."""
    if not data.tokenizer:
        raise UserError("fine-tuning needs the starting point's tokenizer: set data.tokenizer "
                        "(run.py finetune sets it from --init)")
    tokenizer = prepare.load_tokenizer(data)
    train_file = conll.split_file(data.source, "train")
    train_sentences = conll.read_conll(train_file)
    labels = conll.label_set(train_sentences)
    key = fingerprint("conll", dataclasses.asdict(examples), source_fingerprint(str(train_file)),
                      *tokenizer_identity(data))
    train_dir = Path(cache_dir) / key / "train"
    if not (train_dir / "features.json").is_file():
        if examples.max_train_examples:
            train_sentences = conll.TaggedSentences(
                train_sentences.words[:examples.max_train_examples],
                train_sentences.tags[:examples.max_train_examples])
        train = conll.encode_tagged(train_sentences, labels, tokenizer, examples.max_seq_length,
                                    examples.layout, examples.stride)
        train = {k: v for k, v in train.items() if k not in ("word", "sentence")}
        write_records(({k: v[i] for k, v in train.items()} for i in range(len(train["labels"]))),
                      train_dir, metadata={"labels": list(labels), "source": str(train_file)})
    dev_sentences = conll.read_conll(conll.split_file(data.source, "dev"))
    dev = conll.encode_tagged(dev_sentences, labels, tokenizer, examples.max_seq_length,
                              examples.layout, examples.stride)
    all_o = entity_scores(dev_sentences.tags, [["O"] * len(t) for t in dev_sentences.tags])
    return PreparedData(train=RecordDirectory(train_dir), eval=dev,
                        model_fields={"num_labels": len(labels)},
                        report={"all_o_baseline": all_o, "labels": labels,
                                "dev_sentences": dev_sentences}, tokenizer=tokenizer)


def check_ner(model: FinetuneModelConfig, examples: TagExampleConfig,
              objective: Any = None) -> None:
    """The layout suits the head; windows fit the positions."""
    wanted = layout_of(model.head)
    if examples.layout != wanted:
        raise UserError(f"examples.layout={examples.layout} does not suit model.head="
                        f"{model.head}; use examples.layout={wanted}")
    check_input_length(model, examples.max_seq_length)


def build_tagger(config: FinetuneModelConfig, seed: int) -> TokenClassifier:
    with nnx.use_eager_sharding(False):
        return TokenClassifier(config, rngs=nnx.Rngs(seed))


def pretrained_tagger(config: FinetuneModelConfig, seed: int,
                      load: Callable[[str], nnx.Module]) -> TokenClassifier | None:
    """The encoder of `config.init` under a fresh linear layer (None: random init)."""
    if not config.init:
        return None
    encoder = load_encoder(config.init, load, config.head, config.init_layers)
    return from_pretrained(encoder, config, nnx.Rngs(seed), TokenClassifier)


def ner_train_rows(data: str, config: Any) -> int:
    """Training windows an epoch holds: the training file encoded as the run encodes it."""
    sentences = conll.read_conll(conll.split_file(data, "train"))
    count = config.examples.max_train_examples or len(sentences.words)
    sentences = conll.TaggedSentences(sentences.words[:count], sentences.tags[:count])
    tokenizer = prepare.load_tokenizer(config.data)
    return len(conll.encode_tagged(sentences, conll.label_set(sentences), tokenizer,
                                   config.examples.max_seq_length, config.examples.layout,
                                   config.examples.stride)["sentence"])


def ner_train_text(data: str, config: Any) -> list[list[str]]:
    """The training sentences the run reads, words joined by spaces, each its own document."""
    words = conll.read_conll(conll.split_file(data, "train")).words
    return [[" ".join(sentence)] for sentence in
            words[:config.examples.max_train_examples or len(words)]]


register_task(DownstreamTask(  # `run.py finetune --task ner`
    name="ner", method=TAG, num_labels=0, train_rows=ner_train_rows, metrics=NER_METRICS,
    main_metric="f1", baseline="all_o_baseline", baseline_name="all-O",
    aliases=("conll", "wnut17"), train_text=ner_train_text))


METHOD = register(Method(
    name=TAG,
    model_config=FinetuneModelConfig,
    example_config=TagExampleConfig,
    build_model=build_tagger,
    loss=tagging_loss,
    prepare=prepare_ner,
    units_per_example=lambda examples: examples.max_seq_length,
    description="Fine-tuning: token classification (named entities, CoNLL-style files)",
    resolution=Resolution(check=check_ner),
    evaluation=Evaluation(monitor=ner_monitor),
    start=Start(hf_models=(TokenClassifier,), pretrained=pretrained_tagger),
))
