"""word2vec (skip-gram with negative sampling): the loss and its gradient against numpy, the
on-device draws against the paper's and word2vec.c's definitions over many draws (subsampling,
dynamic window, unigram^0.75 noise, order-keeping compaction), the vocabulary and windows, the
analogy and neighbour evaluation, CLI training with a killed run resuming, one step on a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    final_params,
    mesh_overrides,
    read_log,
    small_corpus,
    train_losses,
)
from scipy import stats

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import word2vec as we
from pretext_jax.objectives import word2vec as w2v
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

DRAWS = 200_000


def settings(**changes) -> w2v.Word2VecSettings:
    return w2v.Word2VecSettings(**{"window": 3, "negatives": 4, "subsample": 0.0, **changes})


def numpy_sgns(inputs, outputs, centre, context, negatives, pairs, negative_mask):
    """Mean loss over pairs and its gradients w.r.t. both tables, by hand."""
    sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    loss, g_in, g_out = 0.0, np.zeros_like(inputs), np.zeros_like(outputs)
    count = pairs.sum()
    for b, t, j in zip(*np.nonzero(pairs), strict=True):
        v, o = inputs[centre[b, t]], context[b, t, j]
        s = outputs[o] @ v
        loss -= np.log(sigmoid(s))
        g_in[centre[b, t]] -= (1 - sigmoid(s)) * outputs[o] / count
        g_out[o] -= (1 - sigmoid(s)) * v / count
        for k, n in enumerate(negatives[b, t, j]):
            if negative_mask[b, t, j, k]:
                s = outputs[n] @ v
                loss -= np.log(sigmoid(-s))
                g_in[centre[b, t]] += sigmoid(s) * outputs[n] / count
                g_out[n] += sigmoid(s) * v / count
    return loss / count, g_in, g_out


def test_loss_and_gradient_against_numpy():
    """Fixed pairs and negatives (one negative equal to its context, masked): the mean SGNS loss
    and its gradients w.r.t. the input and output tables equal a hand computation."""
    rng = np.random.default_rng(0)
    vocab, dim, b, t, c, k = 9, 5, 2, 4, 2, 3
    inputs, outputs = rng.normal(size=(2, vocab, dim)).astype(np.float32) * 0.7
    centre = rng.integers(0, vocab, (b, t))
    context = rng.integers(0, vocab, (b, t, 2 * c))
    negatives = rng.integers(0, vocab, (b, t, 2 * c, k))
    negatives[0, 0, 0, 0] = context[0, 0, 0]
    pairs = rng.random((b, t, 2 * c)) < 0.6
    pairs[0, 0, 0] = True
    negative_mask = pairs[..., None] & (negatives != context[..., None])

    def mean_loss(tables):
        total, count = w2v.sgns_sum(*tables, centre, context, negatives, pairs, negative_mask)
        return total / count

    loss, (g_in, g_out) = jax.jit(jax.value_and_grad(mean_loss))((jnp.asarray(inputs),
                                                        jnp.asarray(outputs)))
    want, want_in, want_out = numpy_sgns(inputs, outputs, centre, context, negatives, pairs,
                                         negative_mask)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(g_in, want_in, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_out, want_out, rtol=1e-4, atol=1e-6)


def test_skipgram_loss_end_to_end_with_determined_draws():
    """Window 1, no subsampling and a noise distribution on one word leave nothing random: the
    loss is the mean over every adjacent pair of real words (both directions) with that word as
    the negatives (left out where it is the context)."""
    from flax import nnx

    from pretext_jax.models.word2vec import SkipGram, Word2VecConfig

    model = SkipGram(Word2VecConfig(vocab_size=6, embedding_dim=4), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    model.output_embeddings[...] = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    model.word_counts[...] = jnp.asarray([0, 0, 7, 0, 0, 0], jnp.float32)
    ids = np.array([[1, 2, 3, 4, 5, 0], [5, 2, 2, 0, 0, 0]], np.int32)
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], np.int32)
    loss, metrics = nnx.jit(lambda m, batch: w2v.skipgram_loss(
        m, batch, jax.random.key(3), objective=settings(window=1, negatives=2)))(
        model, {"ids": ids, "mask": mask})
    inputs, outputs = np.asarray(model.input_embeddings[...]), np.asarray(
        model.output_embeddings[...])
    pairs = [(row[i], row[i + d]) for row, n in zip(ids, mask.sum(1), strict=True)
             for i in range(n) for d in (-1, 1) if 0 <= i + d < n]
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    want = np.mean([-np.log(sig(outputs[o] @ inputs[c]))
                    - (o != 2) * 2 * np.log(sig(-outputs[2] @ inputs[c])) for c, o in pairs])
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert float(metrics["loss"][1]) == len(pairs) == 12


def test_compaction_keeps_the_order_of_kept_words():
    ids = jnp.asarray(np.arange(1, 41).reshape(4, 10))
    keep = jnp.asarray(np.random.default_rng(0).random((4, 10)) < 0.5)
    compacted, valid = w2v.compact(ids, keep)
    for row in range(4):
        kept = np.asarray(ids[row])[np.asarray(keep[row])]
        assert list(np.asarray(compacted[row])[np.asarray(valid[row])]) == list(kept)
        assert np.asarray(valid[row]).sum() == len(kept)
        assert not np.asarray(valid[row])[len(kept):].any()


def test_dynamic_window_is_uniform_and_pairs_reach_exactly_b_words():
    """Each centre's window b is uniform in 1..C (chi-square), and its pairs are exactly the
    valid words at distance 1..b on either side (also across a discarded word, which the
    compaction removed)."""
    window, length = 4, 24
    ids = jnp.asarray(np.arange(2 * length).reshape(2, length) % 10)
    real = jnp.ones(ids.shape, bool).at[1, 20:].set(False)
    draw = jax.jit(lambda key, ids, real: w2v.draw(key, ids, real, jnp.ones(10),
                                                   settings(window=window)))
    d = draw(jax.random.key(0), ids, real)
    spans = np.asarray(d.spans)
    observed = np.bincount(spans.ravel(), minlength=window + 1)[1:]
    assert spans.min() >= 1
    assert stats.chisquare(observed).pvalue > 1e-3
    offsets = np.r_[-window:0, 1:window + 1]
    valid, pairs = np.asarray(d.valid), np.asarray(d.pairs)
    for b, t in np.ndindex(*valid.shape):
        want = [valid[b, t] and 0 <= t + o < length and valid[b, t + o] and abs(o) <= spans[b, t]
                for o in offsets]
        assert list(pairs[b, t]) == want, (b, t)
    # over many draws: a pair at distance d exists with probability P(b >= d) = (C - d + 1) / C
    many = jax.jit(jax.vmap(lambda key: draw(key, ids[:1], real[:1]).pairs[0, 10]))(
        jax.random.split(jax.random.key(1), 4000))
    np.testing.assert_allclose(np.asarray(many).mean(0),
                               (window - np.abs(offsets) + 1) / window, atol=0.03)


@pytest.mark.parametrize("formula", ["paper", "code"])
def test_keep_probability_follows_the_formula_over_many_draws(formula):
    """Words of frequencies from 1e-5 to 0.5 are kept at the rate of the paper's
    min(1, sqrt(t/f)) (word2vec.c's min(1, (sqrt(f/t)+1) t/f)) within sampling error."""
    counts = np.array([5e4, 1e4, 2e3, 500, 100, 1, 84399], np.float64)
    t = 1e-3
    f = counts / counts.sum()
    want = (np.minimum(1, np.sqrt(t / f)) if formula == "paper"
            else np.minimum(1, (np.sqrt(f / t) + 1) * t / f))
    assert want.min() < 0.1 and want.max() == 1.0  # both regimes are exercised
    np.testing.assert_allclose(w2v.keep_probability(jnp.asarray(f), t, formula), want,
                               rtol=1e-5)
    ids = jnp.asarray(np.tile(np.arange(len(counts)), (400, 50 // len(counts) + 1))[:, :50])
    keep = np.asarray(jax.jit(w2v.subsample, static_argnums=4)(
        jax.random.key(2), ids, jnp.ones(ids.shape, bool), jnp.asarray(counts),
        settings(subsample=t, subsampling=formula)))
    ids = np.asarray(ids)
    for word, p in enumerate(want):
        rate, n = keep[ids == word].mean(), (ids == word).sum()
        assert abs(rate - p) < 5 * np.sqrt(p * (1 - p) / n) + 1e-9, (word, rate, p)


def test_negatives_follow_the_unigram_distribution_to_the_three_quarters():
    counts = np.array([1000, 300, 50, 7, 1, 0, 120], np.float64)
    cdf = w2v.noise_cdf(jnp.asarray(counts))
    drawn = np.asarray(w2v.draw_negatives(jax.random.key(4), cdf, (DRAWS,)))
    observed = np.bincount(drawn, minlength=len(counts))
    assert observed[5] == 0  # a word of count 0 is never drawn
    p = counts ** 0.75 / (counts ** 0.75).sum()
    nonzero = counts > 0
    assert stats.chisquare(observed[nonzero], p[nonzero] * DRAWS).pvalue > 1e-3
    # the plain unigram distribution is rejected by the same test
    q = counts / counts.sum()
    assert stats.chisquare(observed[nonzero], q[nonzero] * DRAWS).pvalue < 1e-6


def test_vocabulary_and_windows():
    counts = we.count_words(["a b a c", "b a d d d d d"])
    words, n = we.vocabulary_from_counts(counts, min_count=2)
    assert words == ["d", "a", "b"] and list(n) == [5, 3, 2]
    records = list(we.windows(["a b a c", "b a d d d d d"], words,
                              we.Word2VecExampleConfig(max_seq_length=4, min_count=2)))
    ids = np.concatenate([r["ids"][r["mask"] > 0] for r in records])
    assert list(ids) == [1, 2, 1, 2, 1, 0, 0, 0, 0, 0]  # "c" dropped, order kept
    assert [int(r["mask"].sum()) for r in records] == [4, 4, 2]
    with pytest.raises(UserError, match="min_count"):
        we.vocabulary_from_counts(counts, min_count=9)


def test_analogy_and_neighbours_on_constructed_vectors():
    """Vectors built so that b - a + c = d for the capital-country pairs answer every such
    question; shuffled vectors answer (almost) none."""
    pairs = w2v.ANALOGY_CATEGORIES["capital-country"][:4]
    words = [w for pair in pairs for w in pair] + ["filler"]
    rng = np.random.default_rng(0)
    country = rng.normal(size=16)
    vectors = np.stack([rng.normal(size=16) + (i % 2) * country * 3 for i in range(8)]
                       + [rng.normal(size=16)])
    for i in range(0, 8, 2):  # country = capital + the shared offset exactly
        vectors[i + 1] = vectors[i] + country * 3
    questions = w2v.analogy_questions(words)
    assert len(questions) == 4 * 3  # ordered couples of the 4 pairs; other words are absent
    assert w2v.analogy_accuracy(vectors, questions) == 1.0
    assert w2v.analogy_accuracy(rng.normal(size=vectors.shape), questions) < 0.5
    neighbours = w2v.nearest_neighbours(vectors, words, ["Athens", "absent"], k=2)
    assert list(neighbours) == ["Athens"] and len(neighbours["Athens"]) == 2
    assert all(word != "Athens" for word, _ in neighbours["Athens"])


def test_bad_settings_are_user_errors():
    with pytest.raises(UserError, match="subsampling"):
        w2v.Word2VecSettings(subsampling="other")
    with pytest.raises(UserError, match="window"):
        w2v.Word2VecSettings(window=0)
    with pytest.raises(UserError, match="max_seq_length"):
        w2v.check_word2vec(None, we.Word2VecExampleConfig(max_seq_length=3), settings(window=3))


def overrides_for(tmp_path) -> dict:
    return {**small_corpus(tmp_path), "train.steps": 8, "train.checkpoint_every": 3,
            "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 2,
            "train.progress": False, "optim.learning_rate": 0.2, "data.held_out_fraction": 0.2}


def test_cli_training_resumes_exactly_after_a_kill_and_the_loss_falls(tmp_path, capsys):
    """`run.py pretrain --preset word2vec_tiny` trains (the held-out loss below the untrained
    (1 + k) ln 2); a run killed at step 5 and resumed from the step-3 checkpoint ends with the
    same losses and, bit for bit, the same parameters."""
    overrides = overrides_for(tmp_path)
    reference = tmp_path / "reference"
    assert run.main(["pretrain", "--preset", "word2vec_tiny", "--workdir", str(reference),
                     *(f"{k}={v}" for k, v in overrides.items())]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "held-out SGNS loss" in line)
    loss, untrained = float(line.split()[3]), float(line.split()[-1])
    assert loss < untrained - 0.1, line
    ours = abort_and_resume("word2vec_tiny", overrides, tmp_path, step=5)
    executed = read_log(ours[1])
    assert len(executed) > 8 and sorted(dict(executed)) == list(range(1, 9))
    assert train_losses(ours[0]) == train_losses(reference)
    mine, theirs = (final_params("word2vec_tiny", overrides, w) for w in (ours[0], reference))
    assert all(np.array_equal(mine[k], theirs[k]) for k in theirs) and mine.keys() == theirs.keys()


def test_same_step_on_one_device_and_a_mixed_mesh(tmp_path):
    """The sharded step (batch over data and fsdp, tables over fsdp and tensor) equals the
    one-device step; the vocabulary's counts reach the model on every mesh."""
    base = {**small_corpus(tmp_path), **GRADIENT_STEP, "objective.reduction": "mean"}

    def trainer_at(workdir, mesh, devices):
        trainer = Trainer(make_config("word2vec_tiny", {**base, **mesh_overrides(mesh),
                                                        "model.embedding_dim": 8}),
                          workdir, devices=devices)
        counts = trainer.init_state().model_state["word_counts"][...]
        assert float(jnp.sum(counts)) == trainer.data.report["training_words"]
        return trainer

    assert_same_step_on_every_mesh(trainer_at, tmp_path, moved=1e-4)
