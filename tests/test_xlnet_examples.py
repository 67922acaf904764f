"""XLNet data: stream layout, span targets and factorisation orders as properties, the
device-side attention mask, and the memory carried by the loss."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import XLNET_LM

from pretext_jax.input_pipeline.examples.bert import MaskingVocab
from pretext_jax.input_pipeline.examples.xlnet import (
    PermutationSampling,
    XLNetExampleConfig,
    batchify,
    create_training_examples,
    sample_span_mask,
    token_stream,
)
from pretext_jax.models.xlnet import XLNet, XLNetConfig
from pretext_jax.objectives.xlnet import permutation_mask, xlnet_loss

CONTINUATION = np.zeros(500, bool)
CONTINUATION[300:] = True  # ids >= 300 continue a word
VOCAB = MaskingVocab(vocab_size=500, pad_id=0, cls_id=2, sep_id=3, mask_id=4,
                     continuation=CONTINUATION)
CONFIG = XLNetExampleConfig(max_seq_length=48, reuse_len=24, perm_size=8, num_predict=9,
                            num_streams=4)


def documents(seed: int, count: int = 30) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(10, 500, size=rng.integers(3, 25)).tolist()
             for _ in range(rng.integers(2, 10))] for _ in range(count)]


def examples(config=CONFIG, seed=0):
    return list(create_training_examples(documents(seed), VOCAB, config, seed))


def row_streams(config, seed=0):
    """The parallel rows the builder cuts, recomputed from the corpus (same document order)."""
    docs = documents(seed)
    order = np.random.default_rng(seed).permutation(len(docs))
    return batchify(*token_stream([docs[i] for i in order]), config.num_streams,
                    config.bi_data)[0]


def test_records_continue_their_stream_batch_after_batch():
    records = examples()
    rows, reuse = CONFIG.num_streams, CONFIG.reuse_len
    assert len(records) % rows == 0 and len(records) >= 3 * rows
    streams = row_streams(CONFIG)
    for index, record in enumerate(records):
        step, row = divmod(index, rows)
        # Row b of batch k reuses the next reuse_len tokens of stream b.
        np.testing.assert_array_equal(record["input_ids"][:reuse],
                                      streams[row, step * reuse:(step + 1) * reuse])
    for record in records:
        ids, segments = record["input_ids"], record["segment_ids"]
        assert ids.shape == (48,) and ids[-1] == VOCAB.cls_id and segments[-1] == 2
        new = ids[reuse:]
        seps = np.flatnonzero(new == VOCAB.sep_id)
        assert seps[-1] == len(new) - 2  # [A | SEP | B | SEP | CLS]
        assert (segments[:reuse] == 0).all()
        assert (segments[reuse:reuse + seps[0] + 1] == 0).all()
        assert (segments[reuse + seps[0] + 1:-1] == 1).all()
        assert record["is_masked"].sum() == CONFIG.num_predict


def test_span_mask_has_exactly_the_goal_in_short_spans_at_word_starts():
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 500, size=1000)
    is_word_start = ~CONTINUATION
    lengths = []
    for seed in range(30):
        mask = sample_span_mask(is_word_start[tokens], 60, CONFIG, np.random.default_rng(seed))
        assert mask.sum() == 60
        edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        lengths.extend(ends - starts)
        assert all(is_word_start[tokens[s]] for s in starts)  # long segment: no top-up needed
    counts = np.bincount(lengths, minlength=6)[1:]
    assert counts.sum() and max(lengths) <= CONFIG.max_span
    # P(n) ~ 1/n: single tokens are the most frequent span length, 5-token spans the rarest.
    assert counts[0] > counts[1] > counts[4] > 0


def test_short_segment_is_topped_up_to_the_goal():
    mask = sample_span_mask((~CONTINUATION)[np.full(12, 400)], 7, CONFIG,
                            np.random.default_rng(1))  # no word start at all
    assert mask.sum() == 7


def sampled_batch(seed: int = 0):
    records = examples(seed=seed)[:4]
    sampling = PermutationSampling(VOCAB, CONFIG)
    rng = np.random.default_rng(seed)
    rows = [sampling.random_map(r, rng) for r in records]
    return records, {k: np.stack([row[k] for row in rows]) for k in rows[0]}


def test_attention_pattern_is_the_one_implied_by_a_sampled_order():
    records, batch = sampled_batch()
    blocked = np.asarray(permutation_mask(*(jnp.asarray(batch[k]) for k in
                                            ("perm_rank", "perm_target", "perm_hidden")),
                                          CONFIG.reuse_len)) > 0
    reuse = CONFIG.reuse_len
    for row, record in enumerate(records):
        ids, masked = record["input_ids"], record["is_masked"].astype(bool)
        functional = (ids == VOCAB.sep_id) | (ids == VOCAB.cls_id)
        target = masked & ~functional
        rank = batch["perm_rank"][row]
        # Targets are exactly the sampled, non-functional positions, in the target slots.
        weights = batch["target_weights"][row] > 0
        np.testing.assert_array_equal(np.sort(batch["target_positions"][row][weights]),
                                      np.flatnonzero(target))
        np.testing.assert_array_equal(batch["target_ids"][row][weights],
                                      ids[batch["target_positions"][row][weights]])
        for half in (slice(0, reuse), slice(reuse, None)):
            order = rank[half]
            ordered = order[order >= 0]
            assert len(set(ordered.tolist())) == len(ordered)  # a permutation of positions
            # One shared order of offsets inside every perm_size block.
            blocks = np.arange(len(order)) // CONFIG.perm_size
            assert (order[order >= 0] // CONFIG.perm_size == blocks[order >= 0]).all()
        for i in range(len(ids)):
            for j in range(len(ids)):
                if (i < reuse) != (j < reuse):
                    assert blocked[row, i, j] == (i < reuse), (i, j)  # halves
                    continue
                if rank[j] < 0:
                    expected = False  # unmasked context: visible to everyone
                elif target[i]:
                    expected = not rank[j] < rank[i]  # strictly earlier in the order only
                elif rank[i] < 0:
                    expected = True  # context never sees what is predicted
                else:
                    expected = not rank[j] <= rank[i]  # functional: earlier or itself
                assert blocked[row, i, j] == expected, (row, i, j)
        assert all(blocked[row, i, i] for i in np.flatnonzero(target))
        for half in (np.arange(len(ids)) < reuse, np.arange(len(ids)) >= reuse):
            context = np.flatnonzero(~masked & ~functional & half)
            assert blocked[row][np.ix_(context, np.flatnonzero(target & half))].all()


def test_loss_carries_memory_only_in_training():
    config = XLNetConfig(vocab_size=500, hidden_size=16, num_layers=2, num_heads=2,
                         intermediate_size=32, mem_len=20, reuse_len=CONFIG.reuse_len,
                         memory_batch_size=4, hidden_dropout=0.0, attention_dropout=0.0)
    model = XLNet(config, rngs=nnx.Rngs(0))
    _, batch = sampled_batch(1)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    assert not np.asarray(model.memory[...]).any()
    eval_loss, metrics = xlnet_loss(model, batch, None)
    assert not np.asarray(model.memory[...]).any()  # evaluation leaves the memory alone
    assert float(metrics["targets_per_example"][0]) == float(batch["target_weights"].sum())
    loss, _ = xlnet_loss(model, batch, jax.random.key(0))
    memory = np.asarray(model.memory[...])
    assert memory.shape == (2, 4, 20, 16) and np.abs(memory[:, :, -CONFIG.reuse_len:]).sum() > 0
    xlnet_loss(model, batch, jax.random.key(0))
    # Same batch, same weights: the new memory differs only because the step attended to the
    # previous memory (the deeper layers' inputs depend on it).
    again = np.asarray(model.memory[...])
    np.testing.assert_array_equal(again[0, :, -CONFIG.reuse_len:],
                                  memory[0, :, -CONFIG.reuse_len:])  # embeddings: unchanged
    assert not np.array_equal(again[1], memory[1])
    assert np.isfinite(float(loss)) and np.isfinite(float(eval_loss))


def test_bi_data_rows_are_reversed_copies():
    config = dataclasses.replace(CONFIG, bi_data=True)
    streams = row_streams(config)
    half = config.num_streams // 2
    np.testing.assert_array_equal(streams[half:], streams[:half, ::-1])
    records = examples(config)
    for index, record in enumerate(records[: config.num_streams]):
        np.testing.assert_array_equal(record["input_ids"][:config.reuse_len],
                                      streams[index, :config.reuse_len])
    assert all(r["is_masked"].sum() == config.num_predict for r in records)


def test_trained_workdir_loads_with_its_memory_and_converts_to_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from pretext_jax import run
    from pretext_jax.pretrain.loading import load_model

    overrides = ["model.hidden_size=16", "model.num_layers=1", "model.num_heads=2",
                 "model.intermediate_size=32", "model.mem_len=12", "model.reuse_len=8",
                 "examples.max_seq_length=16", "examples.reuse_len=8", "examples.perm_size=8",
                 "examples.num_predict=3", "examples.num_streams=8", "data.vocab_size=600",
                 f"data.cache_dir={tmp_path / 'cache'}", "train.steps=2", "train.batch_size=8",
                 "train.eval_every=2", "train.eval_batches=1", "train.progress=false"]
    workdir = tmp_path / "w"
    assert run.main(["pretrain", "--preset", "xlnet_tiny", "--workdir", str(workdir),
                     *overrides]) == 0
    model = load_model(workdir)
    assert model.memory[...].shape == (1, 8, 12, 16) and np.asarray(model.memory[...]).any()
    assert run.main(["convert", str(workdir), str(tmp_path / "hf"), "--to", "hf"]) == 0
    reference = transformers.XLNetLMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = np.arange(20).reshape(2, 10) % model.config.vocab_size
    XLNET_LM.assert_parity(model, reference, {"input_ids": ids})
