"""ELMo (Peters et al. 2018): a bidirectional LSTM language model over character-CNN token
representations (`models.elmo`), and the task-specific scalar mix of its layers downstream.

Pre-training (`elmo`; allenai/bilm-tf bilm/training.py `LanguageModel._build_loss`): the
forward LM predicts the next token and the backward LM the previous one from the same window
(`input_pipeline.examples.elmo`), through one softmax shared by the directions. Each
direction's loss is the mean negative log-likelihood over its targets, and the loss is their
average, 0.5 (forward + backward), as bilm-tf's `total_loss` (the paper's objective is the sum of
the two log-likelihoods; the average halves its gradient). In training with
`objective.negative_samples` > 0 each direction uses a sampled softmax (Jean et al. 2015; TF
`sampled_softmax_loss` with its default log-uniform candidate sampler, P(k) = log((k + 2) /
(k + 1)) / log(V + 1) over frequency-ordered ids): the target's and the candidates' logits less
log of their expected counts, candidates equal to a row's target removed. The candidates are
drawn once per direction and step, with replacement (TF's sampler draws them without
replacement, `unique=True`; expected counts are then S P(k) instead of TF's 1 - (1 - P(k))^tries).
Evaluation uses the full softmax, as bilm-tf's test.

Downstream (`elmo_classify`; §3.2-3.3): ELMo_k = gamma sum_j softmax(s)_j h_kj over the L + 1
layers (`models.elmo.ScalarMix`), with the biLM frozen, pooled over the tokens (mean and max)
into a small classifier on GLUE. The paper adds ELMo to each task's own model (BCN for SST,
ESIM for SNLI, ...); this head is deliberately simple. The `classify` heads sit on a
Transformer's first token, so ELMo has its own method, with the same GLUE files, metrics and
majority baseline, which `run.py finetune` / `glue` choose for an ELMo starting point
(`Start.finetunes`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import corpus, glue
from pretext_jax.input_pipeline.examples import elmo as ee
from pretext_jax.input_pipeline.prepare import (
    DataConfig,
    fingerprint,
    held_out_sentences,
    source_fingerprint,
    training_sentences,
)
from pretext_jax.input_pipeline.records import SPEC_FILE, RecordDirectory, write_records
from pretext_jax.models.elmo import BiLM, ElmoClassifier, ElmoClassifierConfig, ElmoConfig, ElmoLM
from pretext_jax.objectives.common.glue_metrics import constant_baseline, task_metrics
from pretext_jax.objectives.common.held_out import MAX_EVAL_EXAMPLES, held_out_examples
from pretext_jax.objectives.common.losses import weighted_cross_entropy
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
    whole_run,
)
from pretext_jax.progress import progress


@dataclasses.dataclass(frozen=True)
class ElmoObjectiveConfig:
    """The LM loss's softmax."""

    negative_samples: int = 8192
    """Sampled-softmax candidates per direction and step (bilm-tf 8192); 0 = full softmax."""
    loss_scale: float = 1.0
    """The gradient is of loss_scale x the mean loss (bilm-tf training.py differentiates
    `loss * options['unroll_steps']`: 20); the logged loss is the mean."""

    def __post_init__(self) -> None:
        if self.negative_samples < 0:
            raise UserError(f"objective.negative_samples={self.negative_samples} must be >= 0 "
                            "(0 = full softmax); e.g. 8192")
        if not self.loss_scale > 0:
            raise UserError(f"objective.loss_scale={self.loss_scale} must be > 0 "
                            "(bilm-tf: its unroll_steps, 20)")


# --- Losses -----------------------------------------------------------------------------------

def log_uniform_probabilities(vocab_size: int) -> jax.Array:
    """TF's log-uniform (Zipfian) candidate distribution over ids 0..V-1."""
    ids = jnp.arange(vocab_size, dtype=jnp.float32)
    return (jnp.log(ids + 2.0) - jnp.log(ids + 1.0)) / math.log(vocab_size + 1.0)


def sample_log_uniform(rng: jax.Array, count: int, vocab_size: int) -> jax.Array:
    """`count` ids drawn with replacement from `log_uniform_probabilities` (inverse CDF, as TF's
    `LogUniformSampler`: floor(exp(u log(V + 1))) - 1)."""
    u = jax.random.uniform(rng, (count,))
    ids = jnp.floor(jnp.exp(u * math.log(vocab_size + 1.0))).astype(jnp.int32) - 1
    return jnp.clip(ids, 0, vocab_size - 1)


def full_softmax_nll(hidden: jax.Array, targets: jax.Array, kernel: jax.Array,
                     bias: jax.Array) -> jax.Array:
    """-log softmax(h W^T + b)[target] per row, float32: hidden [N, P], targets [N]."""
    logits = (hidden @ kernel.T.astype(hidden.dtype)).astype(jnp.float32) + bias
    log_probs = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(log_probs, targets[:, None], -1)[:, 0]


def sampled_softmax_nll(hidden: jax.Array, targets: jax.Array, kernel: jax.Array,
                        bias: jax.Array, candidates: jax.Array) -> jax.Array:
    """TF `sampled_softmax_loss` per row with the given log-uniform `candidates` [S] (drawn with
    replacement: expected count S P(k)), accidental hits removed."""
    log_q = jnp.log(candidates.shape[0] * log_uniform_probabilities(kernel.shape[0]))
    true_logits = (jnp.sum(hidden * kernel[targets].astype(hidden.dtype), -1).astype(jnp.float32)
                   + bias[targets] - log_q[targets])
    sampled_logits = ((hidden @ kernel[candidates].T.astype(hidden.dtype)).astype(jnp.float32)
                      + bias[candidates] - log_q[candidates])
    sampled_logits = jnp.where(candidates[None] == targets[:, None], -jnp.inf, sampled_logits)
    logits = jnp.concatenate([true_logits[:, None], sampled_logits], -1)
    return -jax.nn.log_softmax(logits, -1)[:, 0]


def elmo_loss(model: ElmoLM, batch: Batch, rng: jax.Array | None, *,
              objective: ElmoObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """0.5 (forward + backward) mean NLL of a batch of windows (`chars`, `ids`, `mask`), times
    `objective.loss_scale` for the gradient (the `loss` metric is the unscaled mean).

    A batch of stateful streams (`input_pipeline.examples.elmo.StreamWindows`) holds the
    backward LM's own window as `backward_chars`, `backward_ids`, `backward_mask`; in training
    both LMs then start from the states the previous step left in `model.carried_h` /
    `carried_c` and leave theirs there for the next step (bilm-tf training.py `train`: the
    final states fed back as the next batch's initial ones). The carried states are values, not
    functions of the parameters: no gradient crosses a step (truncated backpropagation through
    time, as bilm-tf's fed states). The held-out loss, and the independent windows, start from
    zero (`stateful_held_out` evaluates with carried states)."""
    carry = "backward_chars" in batch and rng is not None
    loss, metrics = bilm_nll(model, batch, rng, objective.negative_samples, carry)
    return loss * objective.loss_scale, metrics


def bilm_nll(model: ElmoLM, batch: Batch, rng: jax.Array | None, negative_samples: int,
             carry: bool) -> tuple[jax.Array, Metrics]:
    """(0.5 (forward + backward) mean NLL, metrics) of `batch` (`elmo_loss`'s layout); with
    `carry` both LMs start from `model.carried_h` / `carried_c` and leave their final states
    there; a sampled softmax of `negative_samples` candidates when `rng` is given, else the
    full softmax."""
    ids, mask = batch["ids"], batch["mask"]
    backward_ids, backward_mask = batch.get("backward_ids", ids), batch.get("backward_mask", mask)
    real, backward_real = mask[:, 1:-1], backward_mask[:, 1:-1]
    streams = "backward_chars" in batch
    if carry and not hasattr(model, "carried_h"):
        raise ValueError("stateful streams need the model's carried states: set "
                         "model.carried_state_rows to examples.stateful_streams")
    model_rng, *sample_rngs = (None, None, None) if rng is None else jax.random.split(rng, 3)
    outputs, final = model(  # [2, B, T, P]
        batch["chars"], real, model_rng,
        backward_chars=batch["backward_chars"] if streams else None,
        backward_mask=backward_real if streams else None,
        initial=(model.carried_h[...], model.carried_c[...]) if carry else None)
    if carry:
        model.carried_h[...] = jax.lax.stop_gradient(final[0]).astype(jnp.float32)
        model.carried_c[...] = jax.lax.stop_gradient(final[1]).astype(jnp.float32)
    kernel, bias = model.softmax_kernel[...], model.softmax_bias[...]
    vocab = kernel.shape[0]
    sampled = rng is not None and negative_samples > 0
    loss, metrics = jnp.zeros((), jnp.float32), {}
    for direction, (name, targets, present, inputs) in enumerate((
            ("forward", ids[:, 2:], mask[:, 2:], real),
            ("backward", backward_ids[:, :-2], backward_mask[:, :-2], backward_real))):
        hidden = outputs[direction].reshape(-1, outputs.shape[-1])
        targets = targets.reshape(-1)
        weights = (inputs * present).reshape(-1).astype(jnp.float32)
        if sampled:
            candidates = sample_log_uniform(sample_rngs[direction], negative_samples, vocab)
            nll = sampled_softmax_nll(hidden, targets, kernel, bias, candidates)
        else:
            nll = full_softmax_nll(hidden, targets, kernel, bias)
        total, count = jnp.sum(weights * nll), jnp.sum(weights)
        loss = loss + 0.5 * total / jnp.maximum(count, 1.0)
        metrics[f"{name}_loss"] = (total, count)
    return loss, {"loss": (loss, jnp.ones((), jnp.float32)), **metrics}


@nnx.jit
def _stream_step(model: ElmoLM, batch: Batch) -> Metrics:
    return bilm_nll(model, batch, None, 0, carry=True)[1]


def stateful_held_out(model: ElmoLM, data: PreparedData, examples: ee.ElmoExampleConfig,
                      objective: Any) -> dict[str, float]:
    """The held-out loss with LSTM states carried through the held-out stream (bilm-tf
    training.py `test`: `final_lstm_state` fed back as the next batch's initial state, the full
    softmax), so each token is predicted from everything before it in its stream rather than
    from its window alone: the held-out windows in stream order (at most `MAX_EVAL_EXAMPLES`)
    as `examples.stateful_streams` rows (fewer if the held-out set is smaller), read as
    training reads its streams (`ee.StreamWindows`), both directions from a zero state.
    `stateful_loss` is 0.5 (forward + backward) of the per-direction means over all tokens
    read (bilm-tf's `test` averages its batches' losses instead; the same up to padding)."""
    del objective
    held_out: RecordDirectory | None = data.monitor_data
    if held_out is None:  # independent windows: the held-out loss is the whole measure
        return {}
    order = held_out.written_order()[:MAX_EVAL_EXAMPLES]
    streams = min(examples.stateful_streams, len(order))
    per_row, rows = len(order) // streams, np.arange(streams)
    layers, cells, width = model.bilm.lstm_projection.shape[1:]
    model.carried_h.set_value(jnp.zeros((2, layers, streams, width), jnp.float32))
    model.carried_c.set_value(jnp.zeros((2, layers, streams, cells), jnp.float32))
    sums = {"forward_loss": np.zeros(2), "backward_loss": np.zeros(2)}
    for step in progress(range(per_row), "held-out streams", unit="batch"):
        forward, backward = (held_out.examples(order[windows])
                             for windows in ee.stream_windows(step, rows, per_row))
        batch = {**forward, **{f"backward_{k}": v for k, v in backward.items()}}
        for name, pair in jax.device_get(_stream_step(model, batch)).items():
            if name in sums:
                sums[name] += np.asarray(pair, np.float64)
    means = {name: total / max(count, 1.0) for name, (total, count) in sums.items()}
    return {"stateful_loss": 0.5 * (means["forward_loss"] + means["backward_loss"]),
            **{f"stateful_{name}": value for name, value in means.items()}}


# --- Data -------------------------------------------------------------------------------------

def unigram_baseline_loss(counts: dict[str, int], vocabulary: list[str],
                          eval_examples: dict[str, np.ndarray]) -> float:
    """The held-out loss of the training unigram distribution (words outside the vocabulary
    count as <UNK>), the average of both directions' mean NLL, as the LM loss."""
    index = {w: i for i, w in enumerate(vocabulary)}
    frequency = np.zeros(len(vocabulary))
    for word, n in counts.items():
        frequency[index.get(word, index[ee.UNK])] += n
    log_p = np.log(np.maximum(frequency, 0.5) / frequency.sum())
    ids, mask = eval_examples["ids"], eval_examples["mask"]
    real = mask[:, 1:-1]
    losses = [-(log_p[ids[:, s]] * real * mask[:, s]).sum() / (real * mask[:, s]).sum()
              for s in (slice(2, None), slice(None, -2))]
    return float(np.mean(losses))


def prepare_elmo(data: DataConfig, examples: ee.ElmoExampleConfig, cache_dir: Path,
                 seed: int) -> PreparedData:
    """Corpus -> word vocabulary (counted from the training sentences, or data.tokenizer: a
    bilm-tf vocab file) -> windows of the training and held-out streams, cached. With
    `examples.stateful_streams` = S the training windows are read as S stateful streams, in
    order (`ee.StreamWindows`: stored as one shard, so that a record's index is its place in
    the stream), and the model keeps S rows of LSTM states; the held-out windows are evaluated
    independently (the loss) and as S streams with carried states (`stateful_held_out`).
    The stream count only decides how windows are read, so it is no part of the cache's key."""
    shards = corpus.plan_shards(data.source, data)
    settings = {k: v for k, v in dataclasses.asdict(data).items()
                if k not in ("cache_dir", "worker_count", "prepare_workers")}
    windows = {k: v for k, v in dataclasses.asdict(examples).items() if k != "stateful_streams"}
    base = Path(cache_dir) / fingerprint(
        "elmo", settings, windows, seed,
        source_fingerprint(data.source, data.tfds_data_dir),
        source_fingerprint(data.eval_source, data.tfds_data_dir) if data.eval_source else "",
        source_fingerprint(data.tokenizer) if data.tokenizer else "")
    base.mkdir(parents=True, exist_ok=True)
    counts_path = base / "counts.tsv"
    if not counts_path.is_file():
        counts = ee.count_words(training_sentences(shards, data, seed))
        tmp = counts_path.with_suffix(f".{id(counts)}.tmp")
        tmp.write_text("".join(f"{w}\t{n}\n" for w, n in counts.most_common()), "utf-8")
        tmp.replace(counts_path)
    counts = {}
    for line in counts_path.read_text("utf-8").splitlines():
        word, n = line.rsplit("\t", 1)
        counts[word] = int(n)
    vocabulary = (ee.read_vocabulary(data.tokenizer) if data.tokenizer
                  else ee.vocabulary_from_counts(counts, data.vocab_size))
    streams = examples.stateful_streams
    train_split = "train-in-order" if streams else "train"
    splits = {train_split: (lambda: training_sentences(shards, data, seed), 1 if streams else 4),
              "eval": (lambda: held_out_sentences(shards, data, seed), 4)}
    for split, (sentences, shard_count) in splits.items():
        if not (base / split / SPEC_FILE).is_file():
            write_records(ee.windows(sentences(), vocabulary, examples), base / split,
                          num_shards=shard_count, metadata={"source": data.source})
    train, held_out = RecordDirectory(base / train_split), RecordDirectory(base / "eval")
    eval_examples = held_out_examples(held_out)
    return PreparedData(
        train=train, eval=eval_examples,
        model_fields={"vocab_size": len(vocabulary), "carried_state_rows": streams},
        monitor_data=held_out if streams else None,
        report={"train_windows": len(train), "vocabulary": len(vocabulary),
                "unigram_baseline_loss": unigram_baseline_loss(counts, vocabulary,
                                                               eval_examples)},
        segments=whole_run(ee.StreamWindows(train, streams), shuffle=False,
                           check=functools.partial(check_streams, streams=streams))
        if streams else None)


def check_streams(config: Any, streams: int) -> None:
    """Stateful streams fix the batch: one row per stream (the carried states' rows), and one
    micro-batch, since a micro-batch would see only some of the rows."""
    if config.train.batch_size != streams:
        raise UserError(f"train.batch_size={config.train.batch_size} must equal "
                        f"examples.stateful_streams={streams} (one batch row per stream); set "
                        "both to the same value, or examples.stateful_streams=0")
    if config.optim.grad_accum_steps != 1:
        raise UserError("examples.stateful_streams needs optim.grad_accum_steps=1 (the carried "
                        "LSTM states are the whole batch's); use a smaller batch or more devices")


def summarize_elmo(evaluation: dict[str, float], report: dict[str, Any],
                   untrained: Callable[[], dict[str, float]]) -> list[str]:
    """The held-out loss (and perplexity) beside the training unigram distribution's."""
    del untrained
    lines = []
    if "loss" in evaluation:
        baseline = report.get("unigram_baseline_loss", float("nan"))
        lines.append(f"  held-out loss {evaluation['loss']:.3f} (perplexity "
                     f"{math.exp(evaluation['loss']):.1f}) vs unigram baseline {baseline:.3f} "
                     f"(perplexity {math.exp(baseline):.1f})")
    if "stateful_loss" in evaluation:
        lines.append(f"  held-out loss with states carried through the stream "
                     f"{evaluation['stateful_loss']:.3f} (perplexity "
                     f"{math.exp(evaluation['stateful_loss']):.1f})")
    return lines


def check_elmo(model: ElmoConfig, examples: ee.ElmoExampleConfig, objective: Any = None
               ) -> None:
    if examples.max_characters_per_token < max(w for w, _ in model.filters):
        raise UserError(f"examples.max_characters_per_token={examples.max_characters_per_token}"
                        f" is narrower than the widest filter of model.char_filters="
                        f"{model.char_filters}; raise it (ELMo: 50)")


def build_elmo(config: ElmoConfig, seed: int) -> ElmoLM:
    return ElmoLM(config, rngs=nnx.Rngs(seed))


TINY_ELMO_MODEL = {"char_embedding_dim": 8, "char_filters": "1:8,2:8,3:16", "lstm_dim": 32,
                   "projection_dim": 16, "dropout": 0.0, "vocab_size": 0}

PRESETS = {
    # Test/demo size: 32 cells -> 16 projection, three small filters, no dropout, Adam.
    "elmo_tiny": {
        "model": TINY_ELMO_MODEL,
        "examples": {"max_seq_length": 20, "max_characters_per_token": 16},
        "objective": {"negative_samples": 0},
        "data": {"vocab_size": 2000},
        "optim": {"learning_rate": 3e-3, "warmup_steps": 20, "bias_correction": True,
                  "weight_decay": 0.0, "schedule": "constant"},
        "train": {"steps": 400, "batch_size": 32, "log_every": 25, "eval_every": 200,
                  "checkpoint_every": 200},
    },
    # bilm-tf bin/train_elmo.py, the original ELMo on the 1B Word Benchmark: 2 x 4096 -> 512
    # LSTMP layers, cell/proj clip 3, residual, 2 highway layers over 2,048 filters, dropout 0.1,
    # sampled softmax with 8,192 candidates over its 793,471-word vocabulary (give it as
    # data.tokenizer, a vocab file; else the corpus's most frequent 793,471 words), batch 128 per
    # GPU x 3 GPUs (384) x 20 unrolled steps, Adagrad lr 0.2 (initial accumulator 1) on the
    # gradient of 20 x the mean loss (training.py: loss * unroll_steps), gradients
    # clipped to global norm 10, 10 epochs of 768,648,884 tokens = 10 x int(768.6M / (384 x 20))
    # = 1,000,840 steps. Each of the 384 batch rows is a continuing stream whose LSTM states
    # carry from batch to batch (training.py `train`; input_pipeline/examples/elmo.py).
    "elmo_original": {
        "model": {"vocab_size": 0},
        "examples": {"max_seq_length": 20, "max_characters_per_token": 50,
                     "stateful_streams": 384},
        "objective": {"negative_samples": 8192, "loss_scale": 20.0},
        "data": {"vocab_size": 793471},
        "optim": {"optimizer": "adagrad", "learning_rate": 0.2, "schedule": "constant",
                  "warmup_steps": 0, "weight_decay": 0.0, "clip_norm": 10.0},
        "train": {"steps": 1000840, "batch_size": 384},
    },
}

register(Method(
    name="elmo",
    model_config=ElmoConfig,
    example_config=ee.ElmoExampleConfig,
    objective_config=ElmoObjectiveConfig,
    build_model=build_elmo,
    loss=elmo_loss,
    prepare=prepare_elmo,
    units_per_example=lambda examples: examples.max_seq_length,
    description="ELMo: bidirectional LSTM LM over character CNN tokens (Peters et al. 2018)",
    presets=PRESETS,
    resolution=Resolution(check=check_elmo),
    evaluation=Evaluation(monitor=stateful_held_out, summarize=summarize_elmo),
))


# --- Downstream: the scalar mix on GLUE -------------------------------------------------------
CLASSIFY_NAME = "elmo_classify"


@dataclasses.dataclass(frozen=True)
class ElmoGlueExampleConfig:
    """The GLUE `task`, tokens per example (`<S> A </S>` or `<S> A </S> <S> B </S>`, cut to
    `max_seq_length`), characters per token and `max_train_examples` (0 = all)."""

    task: str = "sst2"
    """GLUE task: sst2, cola, mrpc, rte or stsb."""
    max_seq_length: int = 64
    """Tokens per example, sentence boundaries included."""
    max_characters_per_token: int = 50
    """Characters per token (as in pre-training)."""
    max_train_examples: int = 0
    """Train on the first n training rows only; 0 = all."""


def encode_glue_words(rows: glue.GlueSplit, examples: ElmoGlueExampleConfig, limit: int = 0
                      ) -> dict[str, np.ndarray]:
    """Character ids [N, T, C], token mask [N, T] and labels of GLUE rows (the first `limit`;
    0 = all), words split on whitespace, as GLUE's files are tokenised."""
    count, length = len(rows.labels), examples.max_seq_length
    count = min(count, limit) if limit else count
    chars = np.zeros((count, length, examples.max_characters_per_token), np.int16)
    mask = np.zeros((count, length), np.int32)
    for row in range(count):
        texts = [rows.texts_a[row]] + ([rows.texts_b[row]] if rows.texts_b is not None else [])
        words = list(ee.token_stream(texts))[:length]
        for t, word in enumerate(words):
            chars[row, t] = ee.character_ids(word, examples.max_characters_per_token)
        mask[row, :len(words)] = 1
    return {"chars": chars, "mask": mask, "label": rows.labels[:count]}


def prepare_elmo_glue(data: DataConfig, examples: ElmoGlueExampleConfig, cache_dir: Path,
                      seed: int) -> PreparedData:
    """GLUE train rows -> records (cached); the dev split in memory."""
    task = glue.glue_task(examples.task)
    tfds_dir = data.tfds_data_dir or None
    directory = Path(cache_dir) / fingerprint(
        "elmo_glue", dataclasses.asdict(examples),
        glue.glue_fingerprint(data.source, task, tfds_dir)) / "train"
    if not (directory / SPEC_FILE).is_file():
        train = encode_glue_words(glue.read_glue(data.source, task, "train", tfds_dir), examples,
                                  examples.max_train_examples)
        labels, counts = np.unique(train["label"], return_counts=True)
        write_records(({k: v[i] for k, v in train.items()} for i in range(len(train["label"]))),
                      directory, metadata={"source": data.source, "label_counts": {
                          str(label): int(n) for label, n in zip(labels, counts, strict=True)
                          if not task.is_regression}})
    train = RecordDirectory(directory)
    dev = encode_glue_words(glue.read_glue(data.source, task, "dev", tfds_dir), examples)
    return PreparedData(train=train, eval=dev, model_fields={"num_labels": task.num_labels},
                        report={"majority_baseline": constant_baseline(
                            task, train.metadata["label_counts"], dev["label"])})


def elmo_classification_loss(model: ElmoClassifier, batch: Batch, rng: jax.Array | None
                             ) -> tuple[jax.Array, Metrics]:
    """Mean cross-entropy (mean squared error for one output) over the batch."""
    logits = model(batch["chars"], batch["mask"], rng).astype(jnp.float32)
    if model.config.num_labels == 1:
        loss = jnp.mean(jnp.square(logits[:, 0] - batch["label"].astype(jnp.float32)))
        return loss, {"loss": (loss, jnp.ones((), jnp.float32))}
    labels = batch["label"].astype(jnp.int32)
    return weighted_cross_entropy(logits, labels, jnp.ones_like(labels), epsilon=0.0)


@nnx.jit
def _logits(model: ElmoClassifier, chars: jax.Array, mask: jax.Array) -> jax.Array:
    return model(chars, mask)


def elmo_glue_monitor(model: ElmoClassifier, data: PreparedData,
                      examples: ElmoGlueExampleConfig, objective: Any = None
                      ) -> dict[str, float]:
    """GLUE's metrics for the task on the whole dev set."""
    outputs = []
    for start in range(0, len(data.eval["label"]), 128):
        logits = np.asarray(_logits(model, data.eval["chars"][start:start + 128],
                                    data.eval["mask"][start:start + 128]))
        outputs.append(logits[:, 0] if model.config.num_labels == 1 else logits.argmax(-1))
    return task_metrics(glue.glue_task(examples.task), np.concatenate(outputs),
                        data.eval["label"])


def pretrained_elmo_classifier(config: ElmoClassifierConfig, seed: int,
                               load: Callable[[str], nnx.Module]) -> ElmoClassifier | None:
    """A classifier whose biLM is `config.init`'s (its softmax is dropped); None: random."""
    if not config.init:
        return None
    if not Path(config.init).is_dir():
        raise UserError(f"model.init={config.init} is not a directory; pass an elmo workdir")
    bilm = load(config.init)
    if not isinstance(bilm, BiLM):
        raise UserError(f"{config.init} holds a {type(bilm).__name__}, not an ELMo biLM; pass "
                        "the workdir of an elmo run")
    theirs, ours = bilm.config, config.bilm_config()
    differ = [f"model.{f.name}={getattr(theirs, f.name)}" for f in dataclasses.fields(ElmoConfig)
              if f.name not in ("vocab_size", "dropout", "carried_state_rows")
              and getattr(theirs, f.name) != getattr(ours, f.name)]
    if differ:
        raise UserError(f"the biLM in {config.init} was trained with {', '.join(differ)}; "
                        "pass the same settings")
    model = ElmoClassifier(config, rngs=nnx.Rngs(seed))
    nnx.update(model.bilm, nnx.state(bilm, nnx.Param))
    return model


def elmo_finetune_recipe(model: Any, task: DownstreamTask, source_config: Mapping[str, Any]
                         ) -> FinetuneRecipe | None:
    """`run.py finetune --init <elmo run>` (and `glue`): this method on the biLM's own settings
    and the characters per token it was trained with; Adam at 1e-3 with warmup over 10% of 3
    epochs, batch 32, no weight decay. The paper trains each task's own model with its own
    recipe (§4, supplement); these settings are ours for this simple pooled head."""
    if not isinstance(model, BiLM) or not isinstance(task.spec, glue.GlueTask):
        return None  # not an ELMo biLM, or not a GLUE task (the scalar mix's only one)
    chars = source_config.get("examples", {}).get(
        "max_characters_per_token", ElmoGlueExampleConfig.max_characters_per_token)
    return FinetuneRecipe(values={
        "method": CLASSIFY_NAME,
        **{f"model.{f.name}": getattr(model.config, f.name) for f in dataclasses.fields(
            ElmoConfig) if f.name != "carried_state_rows"},  # pre-training's streams
        "model.num_labels": task.num_labels, "examples.max_characters_per_token": chars,
        "optim.learning_rate": 1e-3, "optim.weight_decay": 0.0, "optim.bias_correction": True,
        "train.batch_size": 32}, epochs=3, warmup=0.1)


def check_elmo_glue(model: ElmoClassifierConfig, examples: ElmoGlueExampleConfig,
                    objective: Any = None) -> None:
    glue.glue_task(examples.task)
    check_elmo(model, examples)


register(Method(
    name=CLASSIFY_NAME,
    model_config=ElmoClassifierConfig,
    example_config=ElmoGlueExampleConfig,
    build_model=lambda config, seed: ElmoClassifier(config, rngs=nnx.Rngs(seed)),
    loss=elmo_classification_loss,
    prepare=prepare_elmo_glue,
    units_per_example=lambda examples: examples.max_seq_length,
    description="ELMo downstream: scalar mix of a frozen biLM's layers, GLUE classifier",
    presets={
        # The elmo_tiny biLM (model.init=<its workdir>) under the scalar mix, on a GLUE task.
        "elmo_tiny_glue": {
            "model": TINY_ELMO_MODEL,
            "examples": {"max_seq_length": 40, "max_characters_per_token": 16},
            "optim": {"learning_rate": 1e-3, "warmup_steps": 10, "bias_correction": True,
                      "weight_decay": 0.0},
            "train": {"steps": 300, "batch_size": 32, "log_every": 25, "eval_every": 100,
                      "checkpoint_every": 100},
        },
    },
    resolution=Resolution(check=check_elmo_glue),
    evaluation=Evaluation(monitor=elmo_glue_monitor),
    start=Start(pretrained=pretrained_elmo_classifier, finetunes=elmo_finetune_recipe),
))
