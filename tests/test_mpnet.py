"""MPNet: parity with HF `MPNetForMaskedLM` and the HF round trip, the two-stream masks against
the reference's `make_query_and_content_mask`, invariants of the two-stream forward, the
permutation / prediction-split data, and a tiny model trained through the Trainer."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import Parity, assert_close, converted, random_model

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples.bert import MaskingVocab
from pretext_jax.input_pipeline.examples.mpnet import (
    MaskedPermutation,
    MPNetExampleConfig,
    create_training_examples,
)
from pretext_jax.models.mpnet import MPNet, MPNetConfig, two_stream_visibility
from pretext_jax.objectives.mpnet import check_mpnet
from pretext_jax.pretrain import hf

HF_CONFIG = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=48, max_position_embeddings=64, layer_norm_eps=1e-5)
SMALL = MPNetConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4,
                    intermediate_size=40, max_position_embeddings=40, hidden_dropout=0.0,
                    attention_dropout=0.0)

CONTINUATION = np.zeros(500, bool)
CONTINUATION[300:] = True  # ids >= 300 continue a word
VOCAB = MaskingVocab(vocab_size=500, pad_id=0, cls_id=2, sep_id=3, mask_id=4,
                     continuation=CONTINUATION)


@functools.partial(nnx.jit, static_argnames="pred_size")
def forward(model: MPNet, ids, positions=None, pred_size: int = 0, mask=None):
    return model(ids, mask, position_ids=positions, pred_size=pred_size)


def padded_batch(vocab_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[3, 60] ids (never HF's padding id 1 among the tokens) padded with id 1 at the end of
    two rows: offsets up to 59 reach the log-spaced relative-position buckets."""
    rng = np.random.default_rng(seed)
    mask = np.ones((3, 60), np.int64)
    mask[1, 41:] = 0
    mask[2, 7:] = 0
    ids = np.where(mask == 1, rng.integers(2, vocab_size, (3, 60)), 1)
    return ids, mask


def hf_logits(model, ids, mask):
    return {"logits": model(input_ids=ids, attention_mask=mask).logits}


def our_logits(model: MPNet, ids, mask):
    return {"logits": model(ids, mask).logits}


MPNET = Parity("MPNetForMaskedLM", hf_logits, our_logits)


@pytest.mark.usefixtures("deterministic_torch")
def test_parity_with_hf_on_padded_batches(tmp_path):
    pytest.importorskip("transformers")
    reference = MPNET.reference(0, **HF_CONFIG)
    model = converted(reference, tmp_path)
    assert isinstance(model, MPNet) and model.config.layer_norm_eps == 1e-5
    ids, mask = padded_batch(61)
    MPNET.assert_parity(model, reference, ids, mask)
    looped = hf.load(tmp_path, scan_layers=False, remat="full")
    assert_close(MPNET.our_outputs(looped, ids, mask), MPNET.our_outputs(model, ids, mask),
                 atol=1e-6)


@pytest.mark.usefixtures("deterministic_torch")
def test_round_trip_through_transformers(tmp_path):
    pytest.importorskip("transformers")
    config = dataclasses.replace(SMALL, vocab_size=45, max_position_embeddings=64,
                                 hidden_act="gelu_tanh")
    ours = random_model(MPNet, config, 3)
    _, saved = MPNET.round_trip(ours, tmp_path, *padded_batch(45, 1), hidden_dropout=0.0,
                                attention_dropout=0.0)
    assert saved["model_type"] == "mpnet"


def reference_visibility(n: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(content, query) allowed-attention matrices rebuilt from `make_query_and_content_mask`
    (kind MPLM) in the reference's own layout [non-predicted | predicted tokens | masks], then
    reordered to ours [non-predicted | masks | predicted tokens]."""
    upper = np.triu(np.ones((b, b)))
    query = np.concatenate([np.ones((b, n - b)), 1 - upper, upper], axis=1)
    block = np.concatenate([np.zeros((n - b, b)), np.tril(np.ones((b, b))), np.zeros((b, b))])
    content = np.concatenate([np.ones((n + b, n - b)), block, 1 - block], axis=1)
    ours_to_reference = np.concatenate([np.arange(n - b), n + np.arange(b),
                                        n - b + np.arange(b)])
    return (content[np.ix_(ours_to_reference, ours_to_reference)] == 1,
            query[:, ours_to_reference] == 1)


@pytest.mark.parametrize(("n", "b"), [(7, 3), (10, 1), (12, 6), (20, 3)])
def test_visibility_equals_the_reference_masks(n, b):
    content, query = reference_visibility(n, b)
    allowed = np.asarray(two_stream_visibility(n, b))
    np.testing.assert_array_equal(allowed[:n + b], content)
    np.testing.assert_array_equal(allowed[n + b:], query)
    if (n, b) == (7, 3):  # the reference docstring's picture, query rows (ours: x1-4 m5-7 x5-7)
        np.testing.assert_array_equal(allowed[n + b:].astype(int), [
            [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 1, 1, 1, 0]])


def two_stream_case(seed: int = 0, n: int = 12, b: int = 4):
    """A random content stream of n + b rows (non-predicted | masks | predicted) with a random
    permutation of positions."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    ids = rng.integers(5, SMALL.vocab_size, (2, n + b))
    ids[:, n - b:n] = 4  # [MASK]
    positions = np.broadcast_to(np.concatenate([perm, perm[n - b:]]), (2, n + b)).copy()
    return jnp.asarray(ids), jnp.asarray(positions), n, b


@pytest.fixture(scope="module")
def small_model():
    return random_model(MPNet, SMALL, 5)


def test_content_stream_is_the_plain_forward_on_the_masked_sentence(small_model):
    """Non-predicted tokens and masks see exactly [non-predicted | masks]: their content states
    equal the plain forward on those n tokens at the same positions (the whole sentence, masks
    at the predicted positions). Query 0 sees the same and starts from mask 0, so it equals it."""
    ids, positions, n, b = two_stream_case()
    out = forward(small_model, ids, positions, b)
    assert out.hidden_states.shape == (2, n + b, 32) and out.logits.shape == (2, b, 50)
    plain = forward(small_model, ids[:, :n], positions[:, :n])
    np.testing.assert_allclose(out.hidden_states[:, :n], plain.hidden_states, atol=1e-5)
    np.testing.assert_allclose(out.query_states[:, 0], plain.hidden_states[:, n - b], atol=1e-5)
    assert np.abs(np.asarray(out.query_states[:, 1] - plain.hidden_states[:, n - b + 1])
                  ).max() > 1e-3  # query 1 also sees predicted token 0


def test_query_does_not_see_its_own_or_later_targets(small_model):
    ids, positions, n, b = two_stream_case(1)
    base = np.asarray(forward(small_model, ids, positions, b).logits)
    for k in range(b):
        changed = ids.at[:, n + k].set((ids[:, n + k] + 7) % SMALL.vocab_size)
        logits = np.asarray(forward(small_model, changed, positions, b).logits)
        np.testing.assert_allclose(logits[:, :k + 1], base[:, :k + 1], atol=1e-5,
                                   err_msg=f"target {k}")
        if k + 1 < b:  # later queries do depend on it
            assert np.abs(logits[:, k + 1:] - base[:, k + 1:]).max() > 1e-3


def test_outputs_follow_positions_not_slot_order(small_model):
    """Shuffling the non-predicted slots (tokens with their positions) changes nothing but the
    order of their states; moving a token to another position changes the predictions."""
    ids, positions, n, b = two_stream_case(2)
    out = forward(small_model, ids, positions, b)
    order = np.concatenate([np.random.default_rng(0).permutation(n - b), np.arange(n - b, n + b)])
    shuffled = forward(small_model, ids[:, order], positions[:, order], b)
    np.testing.assert_allclose(shuffled.logits, out.logits, atol=1e-5)
    np.testing.assert_allclose(shuffled.hidden_states, out.hidden_states[:, order], atol=1e-5)
    swapped = positions.at[:, [0, 1]].set(positions[:, [1, 0]])
    moved = forward(small_model, ids, swapped, b)
    assert np.abs(np.asarray(moved.logits - out.logits)).max() > 1e-3


def documents(seed: int, count: int = 40) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(10, 500, size=rng.integers(3, 25)).tolist()
             for _ in range(rng.integers(2, 8))] for _ in range(count)]


def test_blocks_are_the_document_stream_after_cls():
    config = MPNetExampleConfig(max_seq_length=32)
    docs = documents(0)
    records = list(create_training_examples(docs, VOCAB, config, 0))
    order = np.random.default_rng(0).permutation(len(docs))
    stream = [t for i in order for t in [*(t for s in docs[i] for t in s), VOCAB.sep_id]]
    assert len(records) == len(stream) // 31
    for index, record in enumerate(records):
        assert record["input_ids"][0] == VOCAB.cls_id
        np.testing.assert_array_equal(record["input_ids"][1:], stream[31 * index:31 * (index + 1)])
    assert not list(create_training_examples(docs[:1], VOCAB,
                                             MPNetExampleConfig(max_seq_length=512), 0))


def sampled(config: MPNetExampleConfig, draws: int, seed: int = 0):
    record = next(create_training_examples(documents(seed), VOCAB, config, seed))
    transform = MaskedPermutation(VOCAB, config)
    rng = np.random.default_rng(seed)
    return record["input_ids"], [transform.random_map(record, rng) for _ in range(draws)]


@pytest.mark.parametrize("whole_word_mask", [False, True])
def test_permutation_split_and_position_compensation(whole_word_mask):
    config = MPNetExampleConfig(max_seq_length=64, whole_word_mask=whole_word_mask)
    n, b = 64, 10  # round(64 * 0.15) = round(9.6)
    assert config.pred_size == b
    ids, outs = sampled(config, 300 if whole_word_mask else 1500)
    predicted_count = np.zeros(n)
    for out in outs:
        positions, tokens = out["position_ids"], out["input_ids"]
        assert tokens.shape == positions.shape == (n + b,) and out["target_ids"].shape == (b,)
        perm = positions[:n]
        np.testing.assert_array_equal(np.sort(perm), np.arange(n))  # a permutation
        # Position compensation: the masks sit at the predicted positions, so the content
        # stream [non-predicted | masks] covers every position of the sentence once.
        np.testing.assert_array_equal(positions[n:], positions[n - b:n])
        # Tokens follow their positions; the targets are the last b of the order.
        np.testing.assert_array_equal(tokens[:n - b], ids[perm[:n - b]])
        np.testing.assert_array_equal(tokens[n:], ids[perm[n - b:]])
        np.testing.assert_array_equal(out["target_ids"], ids[perm[n - b:]])
        predicted_count[perm[n - b:]] += 1
        if whole_word_mask:  # non-predicted words are whole, pieces in order; one may be cut
            starts = ~CONTINUATION[ids]
            starts[0] = True
            word = np.cumsum(starts) - 1
            cut = [w for w in np.unique(word) if len(np.unique(np.isin(
                np.flatnonzero(word == w), perm[n - b:]))) == 2]
            assert len(cut) <= 1
            kept = perm[:n - b]
            for w in np.unique(word[kept]):
                pieces = kept[word[kept] == w]
                assert np.all(np.diff(pieces) == 1)
                where = np.flatnonzero(word[kept] == w)
                assert np.all(np.diff(where) == 1)
    if not whole_word_mask:  # every position is predicted with probability b / n
        assert np.abs(predicted_count / len(outs) - b / n).max() < 0.05


def test_predicted_inputs_are_masked_80_10_10():
    config = MPNetExampleConfig(max_seq_length=64, whole_word_mask=False)
    _, outs = sampled(config, 2000, seed=1)
    inputs = np.concatenate([out["input_ids"][54:64] for out in outs])
    targets = np.concatenate([out["target_ids"] for out in outs])
    masked = inputs == VOCAB.mask_id
    kept = inputs == targets
    replaced = ~masked & ~kept
    assert masked.mean() == pytest.approx(0.8, abs=0.02)
    assert kept.mean() == pytest.approx(0.1, abs=0.015)  # a random draw may hit the target
    assert replaced.mean() == pytest.approx(0.1, abs=0.015)
    assert not np.isin(inputs[replaced], [VOCAB.pad_id, VOCAB.cls_id, VOCAB.sep_id]).any()


def test_bad_settings_are_user_errors():
    with pytest.raises(UserError, match="pred_prob"):
        MPNetExampleConfig(max_seq_length=8, pred_prob=0.01)
    with pytest.raises(UserError, match="max_position_embeddings >= 130"):
        check_mpnet(MPNetConfig(max_position_embeddings=129), MPNetExampleConfig(128))


def test_tiny_model_trains_on_a_mixed_mesh(tmp_path):
    """120 steps of the two-stream loss (with dropout) through the Trainer on data=2, fsdp=2,
    tensor=2: from near-uniform to well below it."""
    from pretext_jax.pretrain.config import make_config
    from pretext_jax.pretrain.trainer import Trainer

    overrides = {"model.intermediate_size": 128, "examples.max_seq_length": 32,
                 "data.vocab_size": 1000, "data.cache_dir": str(tmp_path / "cache"),
                 "train.steps": 120, "train.batch_size": 32, "train.log_every": 10,
                 "train.eval_every": 120, "train.eval_batches": 2,
                 "train.checkpoint_every": 120, "train.progress": False,
                 "optim.warmup_steps": 10, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                 "model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}
    summary = Trainer(make_config("mpnet_tiny", overrides), tmp_path / "w").run()
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text()
            .splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    assert len(losses) == 12
    assert losses[0] > math.log(1000) - 0.3  # starts near uniform over the vocabulary
    assert max(losses[-3:]) < losses[0] - 1.0, losses
    assert summary["eval"]["plm_loss"] < losses[0] - 1.0
    assert "unigram_baseline_plm_loss" in summary["report"]
    # The trained workdir converts to a HF checkpoint that computes the same logits.
    transformers = pytest.importorskip("transformers")
    from pretext_jax import run
    from pretext_jax.pretrain.loading import load_model

    assert run.main(["convert", str(tmp_path / "w"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    reference = transformers.MPNetForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    MPNET.assert_parity(load_model(tmp_path / "w"), reference, *padded_batch(1000, 2), atol=1e-4)
