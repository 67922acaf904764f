"""word2vec: skip-gram with negative sampling (Mikolov et al. 2013b, "Distributed
Representations of Words and Phrases and their Compositionality"; reference tmikolov/word2vec
word2vec.c `TrainModelThread`, `InitUnigramTable`).

Everything random is drawn on device inside the jitted step, from the batch of word-id windows
(`input_pipeline.examples.word2vec`) and the step's key, so the step is sharded over the batch
like every other method and is the same for a seed:

1. Subsampling (§2.3): each word w is kept with probability min(1, sqrt(t / f(w))), f(w) its
   share of the training words (the paper's 1 - P(discard)); `subsampling=code` uses
   word2vec.c's (sqrt(f / t) + 1) t / f instead. t = 0 keeps every word.
2. Discarded words are removed before windowing, as word2vec.c drops them while reading a
   sentence: a stable compaction (a stable argsort of the discard flags) moves each window's
   kept words to its front in their order, so contexts span kept words.
3. Dynamic window (word2vec.c `b = next_random % window`): every centre word draws an effective
   window b uniform in 1..C and pairs with the kept words at distance 1..b on either side within
   its record.
4. Negatives (§2.2): k per (centre, context) pair from the noise distribution
   P_n(w) ∝ count(w)^0.75 over the vocabulary, by inverse-CDF search of the cumulative table
   (word2vec.c's unigram table of 1e8 cells, resolved here to float32's 2^-24). A negative equal
   to the pair's context word is left out, as word2vec.c skips a draw equal to its target.
5. Loss per pair: -log σ(u_o · v_c) - Σ_k log σ(-u_k · v_c), v the input (centre) table, u the
   output (context) table. The step minimises its mean over the batch's pairs
   (`reduction=mean`) or their sum (`reduction=sum`: every pair's gradient counts as in
   word2vec.c's per-pair SGD step, so lr 0.025 is word2vec.c's alpha; the batch's updates are
   applied together). The reported `loss` is always the mean per pair.

word2vec.c gives the context word's input vector and the centre word's output vector to each
pair; the pairs of a window are the same set either way (up to the window draw), and this module
follows the paper (v for the centre word). Held-out evaluation draws with a fixed key, so its
numbers compare across runs; the monitor reports the analogy accuracy of the input vectors on
`ANALOGY_CATEGORIES` (`analogy_accuracy`), and `nearest_neighbours` lists cosine neighbours.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline import corpus
from pretext_jax.input_pipeline.examples import word2vec as we
from pretext_jax.input_pipeline.prepare import (
    LOADER_ONLY_FIELDS,
    DataConfig,
    fingerprint,
    held_out_sentences,
    source_fingerprint,
    training_sentences,
)
from pretext_jax.input_pipeline.records import SPEC_FILE, RecordDirectory, write_records
from pretext_jax.models.word2vec import SkipGram, Word2VecConfig
from pretext_jax.objectives.common.contrastive import l2_normalize
from pretext_jax.objectives.common.held_out import held_out_examples
from pretext_jax.objectives.registry import (
    Batch,
    Evaluation,
    Loader,
    Method,
    Metrics,
    PreparedData,
    Resolution,
    register,
)

EVAL_KEY = 2  # the fixed key of held-out subsampling, windows and negatives
SUBSAMPLING = ("paper", "code")
REDUCTIONS = ("mean", "sum")


@dataclasses.dataclass(frozen=True)
class Word2VecSettings:
    """Skip-gram with negative sampling: window, negatives, subsampling."""

    window: int = 5
    """Largest context distance C; each centre draws its window from 1..C (word2vec.c 5)."""
    negatives: int = 5
    """Negative words k per (centre, context) pair (the paper: 5-20 small data, 2-5 large)."""
    subsample: float = 1e-5
    """Subsampling threshold t (the paper 1e-5; word2vec.c's default 1e-3); 0 = keep all."""
    subsampling: str = "paper"
    """Keep probability: paper, min(1, sqrt(t/f)); code, word2vec.c's (sqrt(f/t)+1) t/f."""
    noise_power: float = 0.75
    """Exponent of the unigram noise distribution (the paper's 3/4)."""
    reduction: str = "mean"
    """The minimised loss: mean over the batch's pairs, or sum (word2vec.c's per-pair step)."""

    def __post_init__(self) -> None:
        if self.window < 1 or self.negatives < 1:
            raise UserError(f"objective.window={self.window} and objective.negatives="
                            f"{self.negatives} must be >= 1; e.g. 5 and 5")
        if self.subsample < 0:
            raise UserError(f"objective.subsample={self.subsample} must be >= 0 (0 = off); "
                            "e.g. 1e-5")
        if self.subsampling not in SUBSAMPLING:
            raise UserError(f"objective.subsampling={self.subsampling!r} must be one of "
                            f"{SUBSAMPLING}")
        if self.reduction not in REDUCTIONS:
            raise UserError(f"objective.reduction={self.reduction!r} must be one of "
                            f"{REDUCTIONS}")


# --- On-device construction -------------------------------------------------------------------

def keep_probability(frequency: jax.Array, threshold: float, formula: str = "paper"
                     ) -> jax.Array:
    """The probability of keeping a word of relative frequency `frequency` (> 0): the paper's
    min(1, sqrt(t / f)) or word2vec.c's min(1, (sqrt(f / t) + 1) t / f); 1 when t = 0."""
    if threshold <= 0:
        return jnp.ones_like(frequency)
    f = jnp.maximum(frequency, 1e-30)
    if formula == "paper":
        keep = jnp.sqrt(threshold / f)
    else:
        keep = (jnp.sqrt(f / threshold) + 1.0) * threshold / f
    return jnp.minimum(keep, 1.0)


def subsample(key: jax.Array, ids: jax.Array, real: jax.Array, counts: jax.Array,
              objective: Word2VecSettings) -> jax.Array:
    """Which real words of `ids` [B, T] are kept: each with `keep_probability` of its share of
    the vocabulary's `counts` [V]."""
    frequency = counts[ids] / jnp.sum(counts)
    return real & (jax.random.uniform(key, ids.shape)
                   < keep_probability(frequency, objective.subsample, objective.subsampling))


def compact(ids: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's kept ids moved to its front in their order (a stable argsort of the discard
    flags), and the mask of the front: ([B, T], [B, T])."""
    order = jnp.argsort(jnp.logical_not(keep).astype(jnp.int32), axis=-1, stable=True)
    return (jnp.take_along_axis(ids, order, axis=-1),
            jnp.take_along_axis(keep, order, axis=-1))


def window_pairs(valid: jax.Array, spans: jax.Array, window: int
                 ) -> tuple[jax.Array, jax.Array]:
    """For every position i of [B, T] and offset d in -C..-1, 1..C: the context position i + d
    (clipped into the row) and whether (i, i + d) is a pair: both valid and |d| <= spans[i]."""
    offsets = jnp.concatenate([jnp.arange(-window, 0), jnp.arange(1, window + 1)])
    length = valid.shape[-1]
    position = jnp.arange(length)[:, None] + offsets  # [T, 2C]
    inside = (position >= 0) & (position < length)
    position = jnp.clip(position, 0, length - 1)
    context_valid = jnp.take_along_axis(
        valid, position.reshape(1, -1).repeat(valid.shape[0], 0), axis=-1
    ).reshape(*valid.shape, 2 * window)
    pairs = (inside & (jnp.abs(offsets) <= spans[..., None]) & valid[..., None]
             & context_valid)
    return jnp.broadcast_to(position, pairs.shape), pairs


def noise_cdf(counts: jax.Array, power: float = 0.75) -> jax.Array:
    """The cumulative (unnormalised) noise weights count^power, [V] (float32)."""
    return jnp.cumsum(jnp.power(counts.astype(jnp.float32), power))


def draw_negatives(rng: jax.Array, cdf: jax.Array, shape: Sequence[int]) -> jax.Array:
    """Word ids drawn with probability (cdf[i] - cdf[i - 1]) / cdf[-1] (inverse-CDF search)."""
    u = jax.random.uniform(rng, tuple(shape)) * cdf[-1]
    return jnp.minimum(jnp.searchsorted(cdf, u, side="right"), cdf.shape[0] - 1)


def pair_losses(centre: jax.Array, context: jax.Array, negatives: jax.Array,
                negative_mask: jax.Array) -> jax.Array:
    """-log σ(u_o · v_c) - Σ_k m_k log σ(-u_k · v_c) per pair: `centre` [..., D], `context`
    [..., D], `negatives` [..., K, D], `negative_mask` [..., K] (float32)."""
    positive = jnp.sum(centre * context, axis=-1)
    negative = jnp.einsum("...d,...kd->...k", centre, negatives)
    return (-jax.nn.log_sigmoid(positive)
            - jnp.sum(negative_mask * jax.nn.log_sigmoid(-negative), axis=-1))


class Draws(NamedTuple):
    """One batch's on-device draws: `keep` [B, T] (subsampling, before compaction), the
    compacted `ids` and their `valid` mask [B, T], the `spans` b [B, T] of the compacted
    positions, the `context_ids` and `pairs` mask [B, T, 2C] (offsets -C..-1, 1..C), and the
    `negative_ids` with their `negative_mask` [B, T, 2C, K]."""

    keep: jax.Array
    ids: jax.Array
    valid: jax.Array
    spans: jax.Array
    context_ids: jax.Array
    pairs: jax.Array
    negative_ids: jax.Array
    negative_mask: jax.Array


def draw(key: jax.Array, ids: jax.Array, real: jax.Array, counts: jax.Array,
         objective: Word2VecSettings) -> Draws:
    """Subsampling, compaction, dynamic windows, pairs and negatives of a batch of windows
    `ids` / `real` [B, T], given the vocabulary's `counts` [V] (see the module docstring)."""
    keep_key, window_key, negative_key = jax.random.split(key, 3)
    keep = subsample(keep_key, ids, real, counts, objective)
    compacted, valid = compact(ids, keep)
    spans = jax.random.randint(window_key, ids.shape, 1, objective.window + 1)
    position, pairs = window_pairs(valid, spans, objective.window)
    context_ids = jnp.take_along_axis(compacted, position.reshape(ids.shape[0], -1), axis=-1
                                      ).reshape(position.shape)
    negative_ids = draw_negatives(negative_key, noise_cdf(counts, objective.noise_power),
                                  (*position.shape, objective.negatives))
    negative_mask = pairs[..., None] & (negative_ids != context_ids[..., None])
    return Draws(keep, compacted, valid, spans, context_ids, pairs, negative_ids, negative_mask)


def sgns_sum(inputs: jax.Array, outputs: jax.Array, centre_ids: jax.Array,
             context_ids: jax.Array, negative_ids: jax.Array, pairs: jax.Array,
             negative_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of `pair_losses` over the pairs, number of pairs): `centre_ids` [B, T],
    `context_ids` / `pairs` [B, T, 2C], `negative_ids` / `negative_mask` [B, T, 2C, K], rows of
    the input table `inputs` and the output table `outputs` (float32)."""
    weights = pairs.astype(jnp.float32)
    losses = pair_losses(inputs[centre_ids][:, :, None, :], outputs[context_ids],
                         outputs[negative_ids], negative_mask.astype(jnp.float32))
    return jnp.sum(weights * losses), jnp.sum(weights)


def skipgram_loss(model: SkipGram, batch: Batch, rng: jax.Array | None, *,
                  objective: Word2VecSettings) -> tuple[jax.Array, Metrics]:
    """Skip-gram negative-sampling loss of a batch of windows `ids` / `mask` [B, T] (see the
    module docstring); `rng=None` (evaluation) draws with the fixed key `EVAL_KEY`."""
    real = batch["mask"] > 0
    d = draw(rng if rng is not None else jax.random.key(EVAL_KEY), batch["ids"], real,
             model.word_counts[...], objective)
    total, count = sgns_sum(model.input_embeddings[...].astype(jnp.float32),
                            model.output_embeddings[...].astype(jnp.float32), d.ids,
                            d.context_ids, d.negative_ids, d.pairs, d.negative_mask)
    loss = total if objective.reduction == "sum" else total / jnp.maximum(count, 1.0)
    words = jnp.sum(real.astype(jnp.float32))
    return loss, {"loss": (total, count),
                  "kept_fraction": (jnp.sum(d.keep.astype(jnp.float32)), words),
                  "pairs_per_word": (count, words)}


# --- Evaluation of the word vectors -----------------------------------------------------------

# A small hand-made analogy set in the style of word2vec's questions-words.txt: within a category
# every ordered couple of distinct pairs (a, b), (c, d) asks a : b :: c : ?, answer d.
ANALOGY_CATEGORIES: dict[str, tuple[tuple[str, str], ...]] = {
    "capital-country": (("Athens", "Greece"), ("Berlin", "Germany"), ("Paris", "France"),
                        ("Rome", "Italy"), ("Madrid", "Spain"), ("Moscow", "Russia"),
                        ("Tokyo", "Japan"), ("Beijing", "China"), ("London", "England"),
                        ("Cairo", "Egypt"), ("Ottawa", "Canada"), ("Dublin", "Ireland")),
    "male-female": (("king", "queen"), ("man", "woman"), ("boy", "girl"),
                    ("brother", "sister"), ("father", "mother"), ("son", "daughter"),
                    ("husband", "wife"), ("he", "she"), ("his", "her"), ("prince", "princess"),
                    ("uncle", "aunt"), ("men", "women")),
    "singular-plural": (("city", "cities"), ("year", "years"), ("game", "games"),
                        ("song", "songs"), ("album", "albums"), ("player", "players"),
                        ("church", "churches"), ("ship", "ships"), ("team", "teams"),
                        ("film", "films"), ("building", "buildings"), ("road", "roads")),
}


def analogy_questions(words: Sequence[str],
                      categories: dict[str, tuple[tuple[str, str], ...]] = ANALOGY_CATEGORIES
                      ) -> np.ndarray:
    """The questions [N, 4] of `categories` as word ids, only those whose four words are all in
    `words`."""
    index = {w: i for i, w in enumerate(words)}
    rows = [[index[a], index[b], index[c], index[d]]
            for pairs in categories.values()
            for (a, b), (c, d) in itertools.permutations(pairs, 2)
            if all(w in index for w in (a, b, c, d))]
    return np.array(rows, np.int64).reshape(-1, 4)


def analogy_accuracy(vectors: np.ndarray, questions: np.ndarray) -> float:
    """The share of questions a : b :: c : d whose nearest word by cosine to b - a + c (unit
    vectors, a, b and c excluded) is d (word2vec's compute-accuracy)."""
    unit = np.asarray(l2_normalize(jnp.asarray(vectors, jnp.float32)))
    a, b, c, d = questions.T
    scores = (unit[b] - unit[a] + unit[c]) @ unit.T
    rows = np.arange(len(questions))
    for excluded in (a, b, c):
        scores[rows, excluded] = -np.inf
    return float(np.mean(np.argmax(scores, axis=1) == d))


def nearest_neighbours(vectors: np.ndarray, words: Sequence[str], queries: Sequence[str],
                       k: int = 5) -> dict[str, list[tuple[str, float]]]:
    """The k words of highest cosine similarity to each query word in `words` (itself
    excluded)."""
    unit = np.asarray(l2_normalize(jnp.asarray(vectors, jnp.float32)))
    index = {w: i for i, w in enumerate(words)}
    out = {}
    for query in (q for q in queries if q in index):
        similarity = unit @ unit[index[query]]
        similarity[index[query]] = -np.inf
        best = np.argsort(-similarity)[:k]
        out[query] = [(words[i], float(similarity[i])) for i in best]
    return out


def word_vectors(model: SkipGram) -> np.ndarray:
    """The input table, [V, D]: the word vectors (as word2vec.c saves `syn0`)."""
    return np.asarray(jax.device_get(model.input_embeddings[...]), np.float32)


def analogy_monitor(model: SkipGram, data: PreparedData, examples: Any, objective: Any
                    ) -> dict[str, float]:
    """The analogy accuracy of the input vectors over `ANALOGY_CATEGORIES`' questions whose
    words are in the vocabulary (`PreparedData.monitor_data`); nothing if there are none."""
    questions = analogy_questions(data.monitor_data)
    if not len(questions):
        return {}
    return {"analogy_accuracy": analogy_accuracy(word_vectors(model), questions),
            "analogy_questions": float(len(questions))}


def summarize_word2vec(evaluation: dict[str, float], report: dict[str, Any],
                       untrained: Callable[[], dict[str, float]]) -> list[str]:
    """The held-out loss beside the untrained one ((1 + k) ln 2: the output table starts at
    zero), and the analogy accuracy beside the untrained vectors'."""
    lines = [f"  held-out SGNS loss {evaluation['loss']:.3f} vs untrained "
             f"{report['untrained_loss']:.3f}"] if "loss" in evaluation else []
    if "analogy_accuracy" in evaluation:
        lines.append(f"  analogy accuracy {evaluation['analogy_accuracy']:.3f} on "
                     f"{int(evaluation['analogy_questions'])} questions vs untrained "
                     f"{untrained()['analogy_accuracy']:.3f}")
    return lines


# --- Data -------------------------------------------------------------------------------------

def prepare_word2vec(data: DataConfig, examples: we.Word2VecExampleConfig, cache_dir: Path,
                     seed: int) -> PreparedData:
    """Corpus -> word vocabulary counted from the training split -> windows of the training and
    held-out word streams, cached by a fingerprint of the data and settings."""
    if data.tokenizer:
        raise UserError("word2vec counts its own word vocabulary from the corpus; leave "
                        "data.tokenizer empty")
    shards = corpus.plan_shards(data.source, data)
    settings = {k: v for k, v in dataclasses.asdict(data).items()
                if k not in LOADER_ONLY_FIELDS + ("tokenizer", "vocab_size",
                                                  "tokenizer_sentences")}
    base = Path(cache_dir) / fingerprint(
        "word2vec", settings, dataclasses.asdict(examples), seed,
        source_fingerprint(data.source, data.tfds_data_dir),
        source_fingerprint(data.eval_source, data.tfds_data_dir) if data.eval_source else "")
    base.mkdir(parents=True, exist_ok=True)
    vocabulary = base / "vocabulary.tsv"
    if not vocabulary.is_file():
        counts = we.count_words(training_sentences(shards, data, seed))
        we.write_vocabulary(vocabulary, *we.vocabulary_from_counts(counts, examples.min_count))
    words, counts = we.read_vocabulary(vocabulary)
    splits = {"train": lambda: training_sentences(shards, data, seed),
              "eval": lambda: held_out_sentences(shards, data, seed)}
    for split, sentences in splits.items():
        if not (base / split / SPEC_FILE).is_file():
            write_records(we.windows(sentences(), words, examples), base / split,
                          metadata={"source": data.source})
    train, held_out = RecordDirectory(base / "train"), RecordDirectory(base / "eval")
    return PreparedData(
        train=train, eval=held_out_examples(held_out),
        model_fields={"vocab_size": len(words)},
        report={"train_windows": len(train), "vocabulary": len(words),
                "training_words": int(counts.sum()), "vocabulary_file": str(vocabulary)},
        monitor_data=words,
        model_variables={"word_counts": counts.astype(np.float32)})


def complete_report(data: PreparedData, model: Word2VecConfig, objective: Word2VecSettings,
                    load: Loader | None = None) -> PreparedData:
    """Adds the untrained held-out loss, (1 + k) ln 2 per pair (σ(0) = 1/2 for every score:
    the output table starts at zero), up to the negatives that equal their pair's context."""
    del load
    report = {**data.report, "untrained_loss": (1 + objective.negatives) * float(np.log(2))}
    return dataclasses.replace(data, report=report)


def build_skipgram(config: Word2VecConfig, seed: int) -> SkipGram:
    return SkipGram(config, rngs=nnx.Rngs(seed))


def check_word2vec(model: Word2VecConfig, examples: we.Word2VecExampleConfig,
                   objective: Word2VecSettings) -> None:
    """A record must hold a centre and a context word within the window."""
    del model
    if examples.max_seq_length <= objective.window:
        raise UserError(f"examples.max_seq_length={examples.max_seq_length} must exceed "
                        f"objective.window={objective.window}; raise the first or lower the "
                        "second")


# word2vec.c's SGD: no momentum, decay or clipping; alpha falls linearly from its start to
# start x 1e-4 (word2vec.c clamps it there; here the linear schedule ends there).
SGD = {"optimizer": "sgd", "momentum": 0.0, "weight_decay": 0.0, "clip_norm": 0.0,
       "schedule": "linear", "warmup_steps": 0, "learning_rate": 0.025,
       "end_learning_rate": 2.5e-6}
PRESETS = {
    # word2vec at the test size: 16-dimensional vectors on the demo corpus, a small window and
    # word2vec.c's threshold 1e-3 (a small corpus has few words above the paper's 1e-5); the
    # summed loss with word2vec.c's alpha 0.025.
    "word2vec_tiny": {
        "model": {"vocab_size": 0, "embedding_dim": 16},
        "examples": {"max_seq_length": 32, "min_count": 2},
        "objective": {"window": 3, "negatives": 5, "subsample": 1e-3, "subsampling": "code",
                      "reduction": "sum"},
        "optim": SGD,
        "train": {"steps": 300, "batch_size": 16, "log_every": 25, "eval_every": 100,
                  "checkpoint_every": 100},
    },
    # The paper's skip-gram (Mikolov et al. 2013b §3-4) with word2vec.c's defaults where the
    # paper is silent: 300 dimensions, k = 5 negatives, min_count 5, window 5 (word2vec.c's
    # default; the paper's phrase runs used 5 and 10), t = 1e-5 with the paper's keep
    # probability (the paper's threshold, which it reports as the one that works on its
    # billions-word corpora; word2vec.c's 1e-3 suits small ones), SGD from alpha 0.025
    # decaying linearly, applied per pair (reduction sum). The batch is small because the
    # batch's pair updates are applied at once, not one after another as in word2vec.c: on
    # WikiText-2, 64 windows of 128 words per step at alpha 0.025 diverged within 40 steps, 8
    # trained (docs/benchmarks.md). 5M steps (5B words, word2vec.c's 5 passes over 1B) are our
    # choice.
    "word2vec_original": {
        "model": {"vocab_size": 0, "embedding_dim": 300},
        "examples": {"max_seq_length": 128, "min_count": 5},
        "objective": {"window": 5, "negatives": 5, "subsample": 1e-5, "subsampling": "paper",
                      "reduction": "sum"},
        "optim": SGD,
        "train": {"steps": 5000000, "batch_size": 8},
    },
}

register(Method(
    name="word2vec",
    model_config=Word2VecConfig,
    example_config=we.Word2VecExampleConfig,
    objective_config=Word2VecSettings,
    build_model=build_skipgram,
    loss=skipgram_loss,
    prepare=prepare_word2vec,
    units_per_example=lambda examples: examples.max_seq_length,
    unit="words",
    description="word2vec: skip-gram with negative sampling (Mikolov et al. 2013b)",
    presets=PRESETS,
    resolution=Resolution(check=check_word2vec, complete_data=complete_report),
    evaluation=Evaluation(monitor=analogy_monitor, summarize=summarize_word2vec),
))
