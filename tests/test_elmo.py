"""ELMo: characters and windows, the LSTMP cell step by step, the character CNN and highway
layers, the full and sampled softmax losses against numpy, the log-uniform sampler's
distribution, CLI pre-training with a killed run resuming exactly, one step equal on every mesh,
and the scalar mix on GLUE SST-2 from the pre-trained workdir."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import (
    GRADIENT_STEP,
    abort_and_resume,
    assert_same_step_on_every_mesh,
    assert_same_training,
    flat_params,
    mesh_overrides,
    run_in_process,
    small_corpus,
    train_losses,
)

from pretext_jax import run
from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import elmo as ee
from pretext_jax.models.elmo import ElmoConfig, ElmoLM, lstm_layer
from pretext_jax.objectives import elmo
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.feed import open_loader
from pretext_jax.pretrain.loading import load_model
from pretext_jax.pretrain.trainer import Trainer

CONFIG = ElmoConfig(vocab_size=40, char_embedding_dim=4, char_filters="1:3,2:4,3:5",
                    lstm_dim=12, projection_dim=6, cell_clip=0.4, proj_clip=0.3, dropout=0.0)


def flat(module: nnx.Module) -> dict[str, np.ndarray]:
    """A module's parameters as {"a.b.0": array}."""
    return {".".join(map(str, path)): np.asarray(value) for path, value in
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(module, nnx.Param)),
                                                 is_leaf=lambda x: hasattr(x, "shape"))[0]
            for path in [[getattr(k, "key", getattr(k, "idx", k)) for k in path]]}


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def test_character_ids_and_windows():
    """allennlp's mapping (+1): bow 259, bytes + 1, eow 260, pad 261; <S> is 257 between them;
    a long word keeps C - 2 bytes. Windows: previous, T tokens, next, with the stream's ends
    masked."""
    assert ee.character_ids("ab", 6).tolist() == [259, 98, 99, 260, 261, 261]
    assert ee.character_ids(ee.BOS, 5).tolist() == [259, 257, 260, 261, 261]
    assert ee.character_ids("abcdefgh", 5).tolist() == [259, 98, 99, 100, 260]
    vocabulary = ee.vocabulary_from_counts(ee.count_words(["a b a", "c a"]), 5)
    assert vocabulary == ["</S>", "<S>", "<UNK>", "a", "b"]  # a 3, <S> and </S> 2, b and c 1
    records = list(ee.windows(["a b a", "c a"], vocabulary, ee.ElmoExampleConfig(4, 6)))
    # stream: <S> a b a </S> <S> c a </S> (9 tokens) -> windows of 4: [0:4], [4:8], [8:9]
    ids = {w: i for i, w in enumerate(vocabulary)}
    stream = [ids.get(w, 2) for w in ["<S>", "a", "b", "a", "</S>", "<S>", "c", "a", "</S>"]]
    assert [r["ids"].tolist() for r in records] == [
        [0, *stream[0:5]], stream[3:9], [stream[7], stream[8], 0, 0, 0, 0]]
    assert [r["mask"].tolist() for r in records] == [
        [0, 1, 1, 1, 1, 1], [1] * 6, [1, 1, 0, 0, 0, 0]]
    assert records[1]["chars"][2].tolist() == ee.character_ids("c", 6).tolist()  # OOV's own


def numpy_lstm(kernel, bias, projection, x, mask, cell_clip, proj_clip):
    """TF LSTMCell(num_proj, cell_clip, proj_clip), forget bias 1, one step at a time."""
    h = np.zeros((x.shape[0], projection.shape[1]))
    c = np.zeros((x.shape[0], projection.shape[0]))
    outputs = []
    for t in range(x.shape[1]):
        i, j, f, o = np.split(np.concatenate([x[:, t], h], -1) @ kernel + bias, 4, -1)
        new_c = np.clip(sigmoid(f + 1) * c + sigmoid(i) * np.tanh(j), -cell_clip, cell_clip)
        new_h = np.clip((sigmoid(o) * np.tanh(new_c)) @ projection, -proj_clip, proj_clip)
        keep = mask[:, t:t + 1] > 0
        h, c = np.where(keep, new_h, h), np.where(keep, new_c, c)
        outputs.append(h)
    return np.stack(outputs, 1)


def test_lstm_projection_cell_matches_numpy_step_by_step():
    rng = np.random.default_rng(0)
    kernel, bias = rng.normal(0, 0.5, (6 + 6, 48)), rng.normal(0, 0.5, 48)
    projection, x = rng.normal(0, 0.5, (12, 6)), rng.normal(0, 1, (3, 7, 6))
    mask = np.ones((3, 7), np.int32)
    mask[1, 4:] = 0
    mask[2, :2] = 0  # a reversed padded row: padding first keeps the zero state
    ours = np.asarray(lstm_layer(*(jnp.asarray(a, jnp.float32) for a in (
        kernel, bias, projection, x)), jnp.asarray(mask), 0.4, 0.3)[0])
    expected = numpy_lstm(kernel, bias, projection, x, mask, 0.4, 0.3)
    np.testing.assert_allclose(ours, expected, atol=1e-5)
    assert np.isclose(np.abs(expected).max(), 0.3)  # the projection clip binds
    np.testing.assert_allclose(ours[2, :2], 0.0)


def test_char_cnn_highway_and_bilm_match_numpy():
    """Token encoder (convolutions, max over positions, relu, highway, projection) and the two
    LSTM stacks (residual from the second layer, backward right to left) against numpy."""
    model = ElmoLM(CONFIG, rngs=nnx.Rngs(1))
    p = flat(model.bilm)
    chars = np.random.default_rng(1).integers(1, 262, (2, 3, 8))
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    tokens, outputs = nnx.jit(lambda m, c, k: m(c, k))(model.bilm, jnp.asarray(chars),
                                                       jnp.asarray(mask))
    x = p["token_encoder.char_embedding"][chars]  # [2, 3, 8, d]
    features = []
    for i, (width, _) in enumerate(CONFIG.filters):
        w = p[f"token_encoder.conv_kernels.{i}"]
        conv = np.stack([sum(x[..., s + k, :] @ w[k] for k in range(width))
                         for s in range(8 - width + 1)], -2)
        features.append(np.maximum(conv.max(-2) + p[f"token_encoder.conv_biases.{i}"], 0))
    h = np.concatenate(features, -1)
    for layer in range(2):
        carry = sigmoid(h @ p["token_encoder.highway_carry"][layer]
                        + p["token_encoder.highway_carry_bias"][layer])
        transform = np.maximum(h @ p["token_encoder.highway_transform"][layer]
                               + p["token_encoder.highway_transform_bias"][layer], 0)
        h = carry * transform + (1 - carry) * h
    h = h @ p["token_encoder.projection"] + p["token_encoder.projection_bias"]
    np.testing.assert_allclose(np.asarray(tokens), h, atol=1e-5)
    for direction in range(2):
        inputs, m = (h, mask) if direction == 0 else (h[:, ::-1], mask[:, ::-1])
        for layer in range(2):
            out = numpy_lstm(*(p[f"lstm_{n}"][direction, layer] for n in (
                "kernel", "bias", "projection")), inputs, m, 0.4, 0.3)
            inputs = out + inputs if layer else out
            expected = inputs if direction == 0 else inputs[:, ::-1]
            real = mask.astype(bool)
            np.testing.assert_allclose(np.asarray(outputs[direction, layer])[real],
                                       expected[real], atol=1e-5)


def test_full_and_sampled_softmax_losses_match_numpy():
    rng = np.random.default_rng(2)
    hidden, kernel = rng.normal(0, 1, (5, 6)), rng.normal(0, 1, (40, 6))
    bias, targets = rng.normal(0, 1, 40), np.array([0, 3, 7, 3, 39])
    candidates = np.array([3, 0, 0, 11, 25, 1])
    logits = hidden @ kernel.T + bias
    full = -(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))[np.arange(5), targets]
    ours = elmo.full_softmax_nll(*(jnp.asarray(a) for a in (hidden, targets, kernel, bias)))
    np.testing.assert_allclose(np.asarray(ours), full, rtol=1e-5)
    ids = np.arange(40)
    log_q = np.log(6 * (np.log(ids + 2) - np.log(ids + 1)) / np.log(41))
    rows = []
    for n in range(5):
        true = logits[n, targets[n]] - log_q[targets[n]]
        sampled = [logits[n, k] - log_q[k] for k in candidates if k != targets[n]]
        all_logits = np.array([true, *sampled])
        rows.append(-(true - np.log(np.exp(all_logits).sum())))
    ours = elmo.sampled_softmax_nll(*(jnp.asarray(a, jnp.float32) if a.dtype.kind == "f"
                                      else jnp.asarray(a) for a in (
        hidden, targets, kernel, bias, candidates)))
    np.testing.assert_allclose(np.asarray(ours), rows, rtol=1e-5)


def test_elmo_loss_averages_the_directions_over_their_targets():
    """0.5 (forward mean + backward mean), each over the targets that exist (not the stream's
    ends), from the model's top outputs and the shared softmax."""
    model = ElmoLM(CONFIG, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(3)
    batch = {"chars": rng.integers(1, 262, (2, 4, 8)), "ids": rng.integers(0, 40, (2, 6)),
             "mask": np.array([[0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])}
    (loss, metrics), outputs = nnx.jit(lambda m, b: (
        elmo.elmo_loss(m, b, None, objective=elmo.ElmoObjectiveConfig(8)),
        m(b["chars"], b["mask"][:, 1:-1])[0]))(model, {k: jnp.asarray(v) for k, v in batch.items()})
    outputs = np.asarray(outputs)
    w, b = np.asarray(model.softmax_kernel[...]), np.asarray(model.softmax_bias[...])
    means = []
    for direction, positions in ((0, [(0, 0, 2), (0, 1, 3), (0, 2, 4), (0, 3, 5), (1, 0, 2)]),
                                 (1, [(0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 0, 0), (1, 1, 1)])):
        nll = []
        for row, t, target in positions:
            logits = outputs[direction, row, t] @ w.T + b
            nll.append(np.log(np.exp(logits).sum()) - logits[batch["ids"][row, target]])
        means.append(np.mean(nll))
    np.testing.assert_allclose(float(loss), 0.5 * sum(means), rtol=1e-5)
    assert float(metrics["forward_loss"][1]) == 5 and float(metrics["backward_loss"][1]) == 5
    # bilm-tf differentiates loss * unroll_steps: objective.loss_scale scales the loss the
    # gradient is taken of, not the logged mean.
    scaled, scaled_metrics = nnx.jit(lambda m, b: elmo.elmo_loss(
        m, b, None, objective=elmo.ElmoObjectiveConfig(8, loss_scale=20.0)))(
        model, {k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(float(scaled), 20 * float(loss), rtol=1e-6)
    assert float(scaled_metrics["loss"][0]) == pytest.approx(float(metrics["loss"][0]))
    assert make_config("elmo_original").objective.loss_scale == 20.0


def test_log_uniform_sampler_follows_its_distribution():
    """200,000 draws over 50 ids against P(k) = log((k + 2) / (k + 1)) / log(51)."""
    draws = np.asarray(elmo.sample_log_uniform(jax.random.key(0), 200_000, 50))
    expected = np.asarray(elmo.log_uniform_probabilities(50))
    np.testing.assert_allclose(expected.sum(), 1.0, rtol=1e-5)
    observed = np.bincount(draws, minlength=50) / draws.size
    tolerance = 4 * np.sqrt(expected * (1 - expected) / draws.size)  # 4 standard errors
    assert np.all(np.abs(observed - expected) < tolerance), np.abs(observed - expected) / tolerance


# One LSTM layer, one highway layer and two small filters keep compilation short; the numpy
# checks above cover the second layer (residual) and the second highway layer.
SHORT = {"model.num_layers": 1, "model.highway_layers": 1, "model.char_filters": "1:8,2:8",
         "examples.max_seq_length": 12, "examples.max_characters_per_token": 10,
         "data.vocab_size": 60, "train.batch_size": 16, "train.steps": 24,
         "train.log_every": 1, "train.eval_every": 12, "train.eval_batches": 1,
         "train.checkpoint_every": 8, "train.progress": False, "optim.warmup_steps": 2,
         "objective.negative_samples": 16}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """elmo_tiny trained 24 steps (sampled softmax): a reference run, and a run killed in place
    of step 11 (`abort_and_resume`: the step-8 checkpoint is the last) then resumed, which must
    match it: the same batches, losses and final parameters, bit for bit. Returns the
    reference's workdir."""
    root = tmp_path_factory.mktemp("elmo")
    overrides = {**SHORT, **small_corpus(root)}
    reference = root / "reference", root / "reference.log"
    run_in_process("elmo_tiny", overrides, *reference)
    ours = abort_and_resume("elmo_tiny", overrides, root, step=11)
    assert len(assert_same_training("elmo_tiny", overrides, ours, reference)) > 24
    return reference[0]


def test_pretraining_resumes_exactly_and_beats_the_unigram_baseline(pretrained):
    rows = [json.loads(line) for line in (pretrained / "metrics.jsonl").open()]
    held_out = [r["loss"] for r in rows if r["split"] == "eval"]
    assert len(held_out) == 2 and held_out[1] < held_out[0] - 0.3, held_out
    assert held_out[1] < math.log(60) - 0.5, held_out  # well below the uniform guess


def test_same_step_on_one_device_and_a_mixed_mesh(tmp_path):
    """One plain gradient step (sampled softmax) on one device and on the (2, 2, 2) mesh (data,
    fsdp and tensor axes: the softmax's vocabulary and the LSTM's cells are split)."""
    base = {**SHORT, **small_corpus(tmp_path), **GRADIENT_STEP, "train.steps": 1}

    def trainer_at(workdir, mesh, devices):
        return Trainer(make_config("elmo_tiny", {**base, **mesh_overrides(mesh)}), workdir,
                       devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, tmp_path)
    assert np.asarray(batch["mask"]).sum() > 100


# --- Stateful streams (bilm-tf's carried LSTM states) ------------------------------------------
STREAMS = 4


def stream_batches(root: Path, streams: int) -> tuple[Any, np.ndarray, int]:
    """The training batches of `streams` rows (0: the independent windows, 4 rows), read as the
    trainer reads them (`feed.open_loader` on the data's segment), the training split's token
    stream (its windows' own tokens, in order) and T."""
    config = make_config("elmo_tiny", {
        **small_corpus(root), "data.vocab_size": 2000, "examples.max_seq_length": 12,
        "examples.stateful_streams": streams, "train.batch_size": streams or STREAMS})
    data = elmo.prepare_elmo(config.data, config.examples, Path(config.data.cache_dir), 0)
    loader = open_loader(data, data.segment(1, config), None, config, config.train.batch_size)
    ids = data.train.examples(range(len(data.train)))["ids"]
    if streams:  # stored in stream order: each window's neighbours are the next one's ends
        np.testing.assert_array_equal(ids[1:, :2], ids[:-1, -2:])
    return loader, ids[:, 1:-1].reshape(-1), ids.shape[1] - 2


def test_stateful_streams_continue_row_by_row(tmp_path):
    """examples.stateful_streams=4: row r of batch t + 1 holds the forward window after row r's
    window of batch t (r W .. r W + W - 1 of the stream over W batches, then again from r W) and
    the backward window before its backward window (the same stretch read right to left), with
    the tokens around each window (the first and last targets) those of the stream. Negative
    control: the independent windows' rows do not continue."""
    loader, stream, length = stream_batches(tmp_path, STREAMS)
    per_row = len(stream) // length // STREAMS
    batches = [next(loader) for _ in range(per_row + 1)]
    for row in range(STREAMS):
        mine = stream[row * per_row * length:(row + 1) * per_row * length]
        forward = np.concatenate([b["ids"][row, 1:-1] for b in batches[:per_row]])
        backward = np.concatenate([b["backward_ids"][row, 1:-1][::-1]
                                   for b in batches[:per_row]])
        np.testing.assert_array_equal(forward, mine)
        np.testing.assert_array_equal(backward, mine[::-1])
        for before, after in zip(batches[:per_row - 1], batches[1:per_row], strict=True):
            np.testing.assert_array_equal(after["ids"][row, :2], before["ids"][row, -2:])
            np.testing.assert_array_equal(after["backward_ids"][row, -2:],
                                          before["backward_ids"][row, :2])
    for key in batches[0]:  # after W batches each row starts its windows again
        np.testing.assert_array_equal(batches[per_row][key], batches[0][key])
    independent, _, _ = stream_batches(tmp_path, 0)
    first, second = next(independent), next(independent)
    assert "backward_ids" not in first
    continued = [np.array_equal(second["ids"][row, :2], first["ids"][row, -2:])
                 for row in range(STREAMS)]
    assert not all(continued)


def test_carried_state_equals_reading_both_windows_at_once():
    """Two consecutive windows A, B: the forward LM reads A then B from A's final state, the
    backward LM B then A (its stream runs right to left); each output equals that of the
    window A B read at once, and so does the final state; from a zero state the second window's
    outputs differ."""
    model = ElmoLM(CONFIG, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(4)
    chars = jnp.asarray(rng.integers(1, 262, (3, 10, 8)))
    mask = jnp.ones((3, 10), jnp.int32)
    a, b = chars[:, :5], chars[:, 5:]
    call = nnx.jit(lambda m, c, k, bc, bk, s: m(c, k, backward_chars=bc, backward_mask=bk,
                                                initial=s))
    whole, whole_final = call(model, chars, mask, chars, mask, None)
    first, state = call(model, a, mask[:, :5], b, mask[:, 5:], None)
    second, final = call(model, b, mask[:, 5:], a, mask[:, :5], state)
    zero, _ = call(model, b, mask[:, 5:], a, mask[:, :5], None)
    for ours, expected in ((first[0], whole[0, :, :5]), (second[0], whole[0, :, 5:]),
                           (first[1], whole[1, :, 5:]), (second[1], whole[1, :, :5])):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), atol=1e-6)
    for ours, expected in zip(final, whole_final, strict=True):  # (h, c) [2, L, B, .]
        np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), atol=1e-6)
    for direction, expected in ((0, whole[0, :, 5:]), (1, whole[1, :, :5])):
        assert np.abs(np.asarray(zero[direction]) - np.asarray(expected)).max() > 1e-2


def test_held_out_with_carried_states_equals_each_stream_read_whole(tmp_path):
    """`elmo.stateful_held_out` on 4 streams over the held-out windows (stored round-robin in 4
    shards; `written_order` puts them back in stream order: each window's neighbours are the
    next one's ends, which the stored order is not) equals reading each stream's stretch as one
    long window from a zero state (forward left to right, backward right to left), per
    direction. Control: the independent windows' held-out loss (each window from zero)
    differs."""
    config = make_config("elmo_tiny", {
        **small_corpus(tmp_path), "data.vocab_size": 2000, "examples.max_seq_length": 12,
        "examples.stateful_streams": STREAMS, "train.batch_size": STREAMS,
        "data.held_out_fraction": 0.3})
    data = elmo.prepare_elmo(config.data, config.examples, Path(config.data.cache_dir), 0)
    held_out = data.monitor_data
    order = held_out.written_order()
    stored, in_order = (held_out.examples(indices)["ids"] for indices in
                        (np.arange(len(order)), order))
    np.testing.assert_array_equal(in_order[1:, :2], in_order[:-1, -2:])
    assert not np.array_equal(stored[1:, :2], stored[:-1, -2:])
    model_config = ElmoConfig(**{**CONFIG.__dict__, "vocab_size": 2000,
                                 "carried_state_rows": STREAMS})
    model = ElmoLM(model_config, rngs=nnx.Rngs(5))
    ours = elmo.stateful_held_out(model, data, config.examples, None)

    windows = held_out.examples(order)
    per_row = len(order) // STREAMS
    rows = [slice(r * per_row, (r + 1) * per_row) for r in range(STREAMS)]
    whole = {"chars": np.stack([np.concatenate(windows["chars"][r]) for r in rows])}
    for key in ("ids", "mask"):  # the stretch's tokens between its outer neighbours
        whole[key] = np.stack([np.concatenate([windows[key][r][0, :1],
                                               windows[key][r][:, 1:-1].reshape(-1),
                                               windows[key][r][-1, -1:]]) for r in rows])
    _, metrics = nnx.jit(lambda m, b: elmo.bilm_nll(m, b, None, 0, carry=False))(
        model, {k: jnp.asarray(v) for k, v in whole.items()})
    for name in ("forward_loss", "backward_loss"):
        total, count = (float(x) for x in metrics[name])
        assert count > 100
        assert abs(ours[f"stateful_{name}"] - total / count) < 1e-5 * total / count, name
    independent = float(nnx.jit(lambda m, b: elmo.bilm_nll(m, b, None, 0, carry=False))(
        model, {k: jnp.asarray(v) for k, v in windows.items()})[0])
    assert abs(ours["stateful_loss"] - independent) > 1e-4, (ours, independent)


def test_stateful_streams_fix_the_batch():
    config = make_config("elmo_original", {"train.batch_size": 256})
    with pytest.raises(UserError, match=r"train.batch_size=256 must equal "
                                        r"examples.stateful_streams=384"):
        elmo.check_streams(config, 384)
    with pytest.raises(UserError, match="grad_accum_steps=1"):
        elmo.check_streams(make_config("elmo_original", {"optim.grad_accum_steps": 2}), 384)


def test_stateful_training_resumes_exactly_with_its_states(tmp_path):
    """elmo_tiny on 16 stateful streams over 8 devices (2 rows each): 6 steps straight
    equal 3 steps, a new trainer restoring the step-3 checkpoint (states included), 3 more, bit
    for bit (losses, parameters, carried states). The states carried after step 1 are the
    model's final states on batch 1's windows from zero, row for row."""
    settings = {**SHORT, **small_corpus(tmp_path), "examples.stateful_streams": 16,
                "train.steps": 6, "train.checkpoint_every": 3, "train.eval_every": 6}

    def trainer(workdir: Path) -> Trainer:
        return Trainer(make_config("elmo_tiny", settings), workdir)

    straight = trainer(tmp_path / "straight").run()
    assert trainer(tmp_path / "resumed").run(stop_after=3)["step"] == 3
    again = trainer(tmp_path / "resumed")
    resumed = again.run()
    assert resumed["step"] == 6
    losses = [train_losses(tmp_path / name) for name in ("straight", "resumed")]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    a, b = (flat_params(run_["state"].model_state) | flat_params(run_["state"].params)
            for run_ in (straight, resumed))
    assert a.keys() == b.keys() and any("carried_c" in key for key in a)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    carried = [key for key in a if "carried" in key]
    assert all(np.abs(a[key]).max() > 1e-3 for key in carried)
    # Step 1's carried states against the model's own reading of batch 1, on the host.
    batch = next(again.data_iterator())
    initial = again.init_state()
    model = again.model_of(initial)
    _, expected = nnx.jit(lambda m, b: m(b["chars"], b["mask"][:, 1:-1],
                                         backward_chars=b["backward_chars"],
                                         backward_mask=b["backward_mask"][:, 1:-1]))(
        model, {k: jnp.asarray(v) for k, v in batch.items()})
    expected = [np.asarray(x) for x in expected]
    state, _ = again.train_step(initial, batch)
    ours = again.model_of(state)
    np.testing.assert_allclose(np.asarray(ours.carried_h[...]), expected[0], atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours.carried_c[...]), expected[1], atol=1e-6)


def test_scalar_mix_on_glue_sst2_from_the_frozen_bilm(pretrained, tmp_path):
    """`run.py pretrain --preset elmo_tiny_glue model.init=<elmo workdir>` on SST-2 (first 256
    training rows): the mix weights and gamma receive gradient and move; the frozen biLM does
    not."""
    glue_root = Path(os.environ.get("PRETEXT_SHARED_DATA", "/work/shared/data")) / "glue"
    if not (glue_root / "SST-2" / "train.tsv").is_file():
        pytest.skip(f"GLUE SST-2 not found under {glue_root}")
    workdir = tmp_path / "sst2"
    assert run.main(["pretrain", "--preset", "elmo_tiny_glue", "--workdir", str(workdir),
                     "--data", str(glue_root), f"model.init={pretrained}",
                     *[f"{k}={SHORT[k]}" for k in SHORT if k.startswith("model.")],
                     "examples.max_characters_per_token=10",
                     "examples.max_train_examples=256", "examples.max_seq_length=24",
                     "train.steps=4", "train.batch_size=16", "train.eval_every=4",
                     "train.checkpoint_every=4", "train.progress=false"]) == 0
    classifier, bilm = load_model(workdir), load_model(pretrained).bilm
    scalars = np.asarray(classifier.scalar_mix.scalars[...])
    assert np.abs(scalars).max() > 1e-4 and float(classifier.scalar_mix.gamma[...]) != 1.0
    ours, theirs = flat(classifier.bilm), flat(bilm)
    assert ours.keys() == theirs.keys()
    for path, value in ours.items():
        np.testing.assert_array_equal(value, theirs[path], err_msg=path)


def test_finetune_and_eval_from_an_elmo_workdir_choose_the_scalar_mix(pretrained, tmp_path,
                                                                      capsys):
    """`run.py finetune --init <elmo workdir>` runs `elmo_classify` (the method that claims a
    biLM, `Start.finetunes`) with the biLM's own settings and the characters per token it was
    trained with, from its weights, and writes dev metrics beside the majority baseline; `run.py
    eval` reads the workdir back to the same metrics."""
    rng = np.random.default_rng(0)
    words = ["good", "fine", "great", "bad", "awful", "poor", "the", "film", "plot", "was"]
    (tmp_path / "glue" / "SST-2").mkdir(parents=True)
    for split, count in (("train", 64), ("dev", 24)):
        labels = rng.integers(0, 2, count)
        rows = [" ".join(rng.choice(words[6:], 3)) + " " + words[3 * (1 - y) + rng.integers(3)]
                + f"\t{y}" for y in labels]
        (tmp_path / "glue" / "SST-2" / f"{split}.tsv").write_text(
            "sentence\tlabel\n" + "\n".join(rows) + "\n")
    workdir = tmp_path / "ft"
    assert run.main(["finetune", "--task", "sst2", "--init", str(pretrained), "--data",
                     str(tmp_path / "glue"), "--workdir", str(workdir), "--epochs", "1",
                     "train.batch_size=16", "train.progress=false"]) == 0
    config = json.loads((workdir / "config.json").read_text())
    assert config["method"] == "elmo_classify" and config["train"]["steps"] == 4
    assert config["examples"]["max_characters_per_token"] == SHORT[
        "examples.max_characters_per_token"]
    assert config["model"]["char_filters"] == SHORT["model.char_filters"]
    assert config["model"]["num_layers"] == 1 and config["model"]["init"] == str(pretrained)
    ours, theirs = flat(load_model(workdir).bilm), flat(load_model(pretrained).bilm)
    for path, value in ours.items():
        np.testing.assert_array_equal(value, theirs[path], err_msg=path)
    result = json.loads((workdir / "results.json").read_text())
    assert set(result["dev"]) == {"accuracy", "glue_score"}
    assert result["majority_baseline"]["accuracy"] > 0.3
    capsys.readouterr()
    assert run.main(["eval", "--workdir", str(workdir)]) == 0
    accuracy = f"{result['dev']['accuracy']:.4f}"
    assert accuracy in capsys.readouterr().out
