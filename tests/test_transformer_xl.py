"""Transformer-XL: the network with memory over consecutive segments against a numpy
re-statement of kimiyoung/transformer-xl pytorch/mem_transformer.py, the loss's gradient
against central differences of that re-statement, the memory update, the ordered stream layout
against data_utils.py `LMOrderedIterator` re-stated, the long-text evaluation with and without
memory, one step equal on one device and a mixed mesh, an aborted run resuming exactly with its
memory, and the refusals."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from resilience_utils import (
    GRADIENT_STEP,
    abort,
    assert_same_step_on_every_mesh,
    assert_same_training,
    final_params,
    mesh_overrides,
    run_in_process,
    small_corpus,
    tampered_restore,
)

from pretext_jax.errors import UserError
from pretext_jax.input_pipeline.examples import transformer_xl as txl_examples
from pretext_jax.models.transformer_xl import TransformerXL, TransformerXLConfig
from pretext_jax.objectives import transformer_xl as txl
from pretext_jax.pretrain.config import make_config
from pretext_jax.pretrain.trainer import Trainer

H, N, D, L, V = 16, 2, 8, 2, 50
CONFIG = TransformerXLConfig(vocab_size=V, hidden_size=H, num_layers=L, num_heads=N,
                             intermediate_size=24, hidden_dropout=0.0, attention_dropout=0.0,
                             mem_len=7, initializer_range=0.3)


# --- numpy re-statement of mem_transformer.py (attn_type 0, post-LN, no adaptive softmax) ------

def layer_norm(x, gain, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * gain + bias


def rel_shift(x):
    """`RelMultiHeadAttn._rel_shift` on [qlen, klen, ...]."""
    q, k = x.shape[:2]
    padded = np.concatenate([np.zeros((q, 1, *x.shape[2:])), x], 1)
    return padded.reshape(k + 1, q, *x.shape[2:])[1:].reshape(x.shape)


def reference_forward(p, data, mems, mem_len, clamp_len=-1, same_length=False):
    """`MemTransformerLM._forward` + the output layer, time-major: data [qlen, bsz], `mems` a
    list of L + 1 arrays [mlen, bsz, d] (mlen 0 at the start). Returns (logits [qlen, bsz, V],
    `_update_mems`'s new mems)."""
    qlen, bsz = data.shape
    d = p["emb"].shape[1]
    n, dh = p["r_w_bias"].shape
    mlen = mems[0].shape[0]
    klen = mlen + qlen
    ones = np.ones((qlen, klen))
    if same_length:
        mask_len = klen - mem_len
        shift = qlen - mask_len if mask_len > 0 else qlen
        mask = (np.triu(ones, 1 + mlen) + np.tril(ones, -shift)) > 0
    else:
        mask = np.triu(ones, 1 + mlen) > 0
    pos = np.arange(klen - 1, -1, -1.0)
    if clamp_len > 0:
        pos = np.minimum(pos, clamp_len)
    angles = np.outer(pos, 1 / (10000 ** (np.arange(0.0, d, 2.0) / d)))
    r = np.concatenate([np.sin(angles), np.cos(angles)], -1)
    h = p["emb"][data] * d ** 0.5
    hids = [h]
    for i, lp in enumerate(p["layers"]):
        q, k, v = np.split(np.concatenate([mems[i], h], 0) @ lp["qkv"].T, 3, -1)
        q = q[-qlen:].reshape(qlen, bsz, n, dh)
        k, v = k.reshape(klen, bsz, n, dh), v.reshape(klen, bsz, n, dh)
        r_k = (r @ lp["r_net"].T).reshape(klen, n, dh)
        ac = np.einsum("ibnd,jbnd->ijbn", q + p["r_w_bias"], k)
        bd = rel_shift(np.einsum("ibnd,jnd->ijbn", q + p["r_r_bias"], r_k))
        score = np.where(mask[:, :, None, None], -np.inf, (ac + bd) / np.sqrt(dh))
        prob = np.exp(score - score.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        vec = np.einsum("ijbn,jbnd->ibnd", prob, v).reshape(qlen, bsz, n * dh)
        out = layer_norm(h + vec @ lp["o"].T, lp["ln1_g"], lp["ln1_b"])
        ff = np.maximum(out @ lp["ff1_w"].T + lp["ff1_b"], 0) @ lp["ff2_w"].T + lp["ff2_b"]
        h = layer_norm(out + ff, lp["ln2_g"], lp["ln2_b"])
        hids.append(h)
    end = mlen + qlen
    new_mems = [np.concatenate([m, x], 0)[max(0, end - mem_len):end]
                for m, x in zip(mems, hids, strict=True)]
    return h @ p["emb"].T + p["out_b"], new_mems


def reference_params(model: TransformerXL) -> dict:
    """Our parameters in mem_transformer.py's layout (float64): qkv_net / r_net / o_net weights
    [out, in], the FFN's and LayerNorms' tensors, the tied embedding and the output bias."""
    layers = model.layers

    def get(param, i):
        return np.asarray(param[...][i], np.float64)

    def layer(i):
        flat = {name: get(getattr(layers, name), i).reshape(H, N * D) for name in "qkvor"}
        return {"qkv": np.concatenate([flat[x].T for x in "qkv"]), "r_net": flat["r"].T,
                "o": flat["o"], "ln1_g": get(layers.attention_layer_norm.scale, i),
                "ln1_b": get(layers.attention_layer_norm.bias, i),
                "ff1_w": get(layers.intermediate.kernel, i).T,
                "ff1_b": get(layers.intermediate.bias, i),
                "ff2_w": get(layers.output.kernel, i).T, "ff2_b": get(layers.output.bias, i),
                "ln2_g": get(layers.output_layer_norm.scale, i),
                "ln2_b": get(layers.output_layer_norm.bias, i)}

    return {"emb": np.asarray(model.word_embedding.embedding[...], np.float64),
            "r_w_bias": np.asarray(model.r_w_bias[...], np.float64),
            "r_r_bias": np.asarray(model.r_r_bias[...], np.float64),
            "layers": [layer(i) for i in range(L)],
            "out_b": np.asarray(model.lm_bias[...], np.float64)}


@pytest.fixture(scope="module")
def model() -> TransformerXL:
    """CONFIG with every parameter random (LayerNorms and biases too)."""
    model = TransformerXL(CONFIG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and any(p in path for p in ("bias", "scale")):
            base = 1.0 if "scale" in path else 0.0
            param[...] = jnp.asarray(base + rng.normal(0, 0.3, param[...].shape), jnp.float32)
    return model


@pytest.mark.parametrize("same_length,clamp_len,slots", [(False, -1, 7), (True, 3, 7),
                                                         (True, -1, 4), (False, 2, 12)])
def test_three_segments_with_memory_match_the_reference(model, same_length, clamp_len, slots):
    """Three consecutive segments of 5 tokens, the memory carried from one to the next: our M
    slots (the last min(M, 5 s) filled) against the reference's memory growing from empty to
    mem_len, with same_length, clamp_len and M below and above the segment length. Logits and
    the new memory's filled slots (= the reference's mems) agree to 2e-6."""
    params = reference_params(model)
    rng = np.random.default_rng(1)
    data = rng.integers(0, V, (3, 15))
    mems = [np.zeros((0, 3, H))] * (L + 1)
    ours = jnp.zeros((L, 3, slots, H))
    call = nnx.jit(lambda m, x, mem, n: m(x, mems=mem, memory_length=n, clamp_len=clamp_len,
                                          same_length=same_length))
    for step in range(3):
        segment = data[:, 5 * step:5 * step + 5]
        logits, mems = reference_forward(params, segment.T, mems, slots, clamp_len, same_length)
        out = call(model, jnp.asarray(segment), ours, jnp.full(3, min(5 * step, slots)))
        np.testing.assert_allclose(np.asarray(out.logits), logits.transpose(1, 0, 2),
                                   atol=2e-6, rtol=1e-5)
        filled = mems[0].shape[0]
        assert filled == min(5 * step + 5, slots)
        for layer in range(L):  # the reference's L + 1-th state (the output) is never read
            np.testing.assert_allclose(np.asarray(out.new_mems[layer])[:, slots - filled:],
                                       mems[layer].transpose(1, 0, 2), atol=2e-6)
        ours = out.new_mems


def test_memory_carries_no_gradient_and_gradient_matches_central_differences(model):
    """The new memory is the last M states without gradient (its gradient w.r.t. every
    parameter is 0), and the gradient of the loss of a segment after a memory equals central
    differences of the numpy re-statement's mean NLL (float64), on 3 entries of every
    parameter; the loss itself to 1e-5."""
    rng = np.random.default_rng(2)
    first, second = rng.integers(0, V, (2, 2, 6))
    params = reference_params(model)
    _, mems = reference_forward(params, first.T, [np.zeros((0, 2, H))] * (L + 1), 6)
    memory = jnp.asarray(np.stack(mems[:L]).transpose(0, 2, 1, 3), jnp.float32)
    batch = {"tokens": jnp.asarray(np.concatenate([second, rng.integers(0, V, (2, 1))], 1)),
             "token_mask": jnp.ones((2, 7), jnp.int32), "stream_offset": jnp.full(2, 6)}
    graphdef, state = nnx.split(model, nnx.Param)

    def loss_of(state):
        return txl.segment_nll(nnx.merge(graphdef, state), batch, memory, None)[0]

    def memory_of(state):
        out = nnx.merge(graphdef, state)(jnp.asarray(first), mems=memory)
        return jnp.sum(out.new_mems)

    loss, grads = jax.jit(jax.value_and_grad(loss_of))(state)
    assert all(np.all(np.asarray(g) == 0)
               for g in jax.tree.leaves(jax.jit(jax.grad(memory_of))(state)))

    def reference_loss():
        logits, _ = reference_forward(reference_params(model), second.T, mems, 6)
        logits = logits - logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        targets = np.asarray(batch["tokens"])[:, 1:].T
        return -np.take_along_axis(log_probs, targets[..., None], -1).mean()

    np.testing.assert_allclose(float(loss), reference_loss(), rtol=1e-5)
    checked = 0
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param):
            continue
        grad = np.asarray(functools.reduce(lambda tree, key: tree[key], path, grads)[...])
        original = np.array(param[...])
        for index in rng.choice(grad.size, 3, replace=False):
            index = np.unravel_index(index, grad.shape)
            moved = []
            for sign in (1, -1):
                value = original.copy()
                value[index] += sign * 1e-3
                param[...] = jnp.asarray(value)
                moved.append(reference_loss())
            param[...] = jnp.asarray(original)
            numeric = (moved[0] - moved[1]) / 2e-3
            assert abs(grad[index] - numeric) < 1e-3 * max(1.0, abs(numeric)), (path, index)
            checked += 1
    assert checked == 3 * len(jax.tree.leaves(grads))


# --- Data layout -----------------------------------------------------------------------------

def lm_ordered_iterator(data: np.ndarray, bsz: int, bptt: int):
    """data_utils.py `LMOrderedIterator` re-stated: (inputs, targets) [seq_len, bsz] per batch."""
    n_step = len(data) // bsz
    columns = data[:n_step * bsz].reshape(bsz, -1).T
    for i in range(0, n_step - 1, bptt):
        seq_len = min(bptt, n_step - 1 - i)
        yield columns[i:i + seq_len], columns[i + 1:i + 1 + seq_len]


def test_segments_are_the_reference_iterators_batches():
    """`StreamSegments` (streams of 5 and 3, segments of 4 and 7, a stream whose rows end in a
    short batch and one where T divides n - 1) gives `LMOrderedIterator`'s batches, the last
    one padded; its records read in order in batches of B are those batches; each row of batch
    s + 1 starts with the last token row b read at batch s, and `stream_offset` is s T.
    Chunked storage gives back the stream it was cut from."""
    rng = np.random.default_rng(3)
    for length, streams, tgt_len in ((103, 5, 4), (89, 3, 7), (2 * 29, 2, 7)):
        stream = rng.integers(1, 1000, length).astype(np.int32)
        source = txl_examples.StreamSegments(stream, streams, tgt_len, "test")
        expected = list(lm_ordered_iterator(stream, streams, tgt_len))
        assert source.batches == len(expected) and len(source) == len(expected) * streams
        for step, (inputs, targets) in enumerate(expected):
            batch = source.batch(step)
            records = source.examples(range(step * streams, (step + 1) * streams))
            for key, value in batch.items():
                np.testing.assert_array_equal(records[key], value)
            seq_len = len(inputs)
            np.testing.assert_array_equal(batch["token_mask"].sum(1), seq_len + 1)
            np.testing.assert_array_equal(batch["tokens"][:, :seq_len], inputs.T)
            np.testing.assert_array_equal(batch["tokens"][:, 1:seq_len + 1], targets.T)
            np.testing.assert_array_equal(batch["stream_offset"], step * tgt_len)
            if step:
                np.testing.assert_array_equal(batch["tokens"][:, 0],
                                              source.batch(step - 1)["tokens"][:, -1])

    class Tokenizer:
        eos_id = 7

    documents = [[[1, 2, 3], [4]], [[5] * 1500], [[6, 8]]]
    chunks = list(txl_examples.create_training_examples(documents, Tokenizer(), 0))
    stacked = {k: np.stack([c[k] for c in chunks]) for k in chunks[0]}
    np.testing.assert_array_equal(txl_examples.token_stream(stacked),
                                  [1, 2, 3, 4, 7, *[5] * 1500, 7, 6, 8, 7])


def test_long_text_evaluation_with_memory_equals_reading_each_stream_whole(model):
    """Held-out text of 2 streams of 25 tokens in segments of 4 with 32 cached states (more than
    a row holds, no clamping or same_length) predicts every token from all earlier ones of its
    row: the same summed NLL as one segment of 24 per row without memory. Without memory the
    loss differs."""
    stream = np.random.default_rng(5).integers(0, V, 50).astype(np.int32)
    settings = txl.TransformerXLEvaluation(eval_tgt_len=4, eval_mem_len=32, eval_clamp_len=-1,
                                           eval_same_length=False, eval_batch_size=2)
    memory = txl.long_text_nll(model, stream, settings, memory=True)
    whole = txl.long_text_nll(model, stream, txl.TransformerXLEvaluation(
        eval_tgt_len=24, eval_mem_len=32, eval_batch_size=2), memory=False)
    assert memory[1] == whole[1] == 48
    np.testing.assert_allclose(memory[0], whole[0], rtol=1e-5)
    alone = txl.long_text_nll(model, stream, settings, memory=False)
    assert alone[1] == 48 and abs(alone[0] - memory[0]) > 1e-2


# --- Training --------------------------------------------------------------------------------

SHORT = {"data.vocab_size": 60, "data.held_out_fraction": 0.2, "train.steps": 9,
         "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
         "train.checkpoint_every": 3, "train.progress": False,
         "objective.eval_max_tokens": 400}


def memory_of(workdir: Path, overrides: dict) -> np.ndarray:
    """The memory in the workdir's latest checkpoint."""
    trainer = Trainer(make_config("transformer_xl_tiny", overrides), workdir)
    state, _ = trainer.checkpoints.restore_latest_readable()
    trainer.checkpoints.close()
    return np.asarray(trainer.model_of(state).memory[...])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """transformer_xl_tiny trained 9 steps: a reference run, and a run stopped in place of step
    8 (the step-6 checkpoint, memory included, is the last) then resumed in this process (as
    `abort_and_resume`, keeping a copy of the stopped workdir for the control), which must
    match it: the same batches, losses, final parameters and memory, bit for bit.
    Control: the stopped run resumed with its restored memory zeroed ends with other
    parameters. Returns the reference's (workdir, overrides)."""
    root = tmp_path_factory.mktemp("txl")
    overrides = {**SHORT, **small_corpus(root)}
    reference = root / "reference", root / "reference.log"
    run_in_process("transformer_xl_tiny", overrides, *reference)
    ours = root / "w", root / "w.log"
    abort("transformer_xl_tiny", overrides, *ours, step=8)
    control = root / "control", root / "control.log"
    for source, target in zip(ours, control, strict=True):
        (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
    run_in_process("transformer_xl_tiny", overrides, *ours)
    assert_same_training("transformer_xl_tiny", overrides, ours, reference)
    memory = memory_of(reference[0], overrides)
    np.testing.assert_array_equal(memory_of(ours[0], overrides), memory)
    assert np.abs(memory).max() > 0.1

    def forget(state):
        return dataclasses.replace(
            state, model_state=jax.tree.map(jnp.zeros_like, state.model_state))

    with tampered_restore(forget):
        run_in_process("transformer_xl_tiny", overrides, *control)
    theirs, mine = (final_params("transformer_xl_tiny", overrides, w)
                    for w in (reference[0], control[0]))
    assert any(not np.array_equal(theirs[k], mine[k]) for k in theirs)
    return reference[0], overrides


def test_training_reads_the_streams_in_order_and_evaluates_long_text(trained):
    """The trainer's first two batches are `StreamSegments`' batches 0 and 1 (row b of the
    second continues row b of the first); the run's evaluation reports the held-out loss with
    and without memory, and the summary line names both beside the unigram baseline."""
    workdir, overrides = trained
    trainer = Trainer(make_config("transformer_xl_tiny", overrides), workdir)
    batches = trainer.data_iterator()
    first, second = next(batches), next(batches)
    source = trainer.data.train
    for step, batch in enumerate((first, second)):
        for key, value in source.batch(step).items():
            np.testing.assert_array_equal(np.asarray(batch[key]), value)
    np.testing.assert_array_equal(second["tokens"][:, 0], first["tokens"][:, -1])
    trainer.checkpoints.close()
    rows = [r for r in map(json.loads, (workdir / "metrics.jsonl").open())
            if r["split"] == "eval"]
    assert rows and {"memory_loss", "no_memory_loss", "long_text_tokens"} <= set(rows[-1])
    lines = txl.summarize_transformer_xl(rows[-1], trainer.data.report, dict)
    assert "with memory" in lines[0] and "unigram baseline" in lines[0]


def test_same_step_on_one_device_and_a_mixed_mesh(tmp_path):
    """One plain gradient step from the first batch (memory empty: stream_offset 0) on one
    device and on the (2, 2, 2) mesh (batch rows and memory rows split 4 ways)."""
    base = {**SHORT, **small_corpus(tmp_path), **GRADIENT_STEP, "train.steps": 1}

    def trainer_at(workdir, mesh, devices):
        return Trainer(make_config("transformer_xl_tiny", {**base, **mesh_overrides(mesh)}),
                       workdir, devices=devices)

    batch = assert_same_step_on_every_mesh(trainer_at, tmp_path)
    assert np.asarray(batch["token_mask"]).sum() == 8 * 17


def test_refusals():
    """Bad settings are one-line UserErrors that name the fix."""
    config = make_config("transformer_xl_wt103_base", {"train.batch_size": 64})
    with pytest.raises(UserError, match=r"train.batch_size=64 must equal examples.num_streams"):
        txl.check_streams(config, 60)
    with pytest.raises(UserError, match="grad_accum_steps=1"):
        txl.check_streams(make_config("transformer_xl_wt103_base",
                                      {"optim.grad_accum_steps": 2}), 60)
    for overrides, message in (
            ({"model.same_length": True, "model.mem_len": 0}, "needs model.mem_len >= 1"),
            ({"objective.eval_mem_len": 0}, "eval_mem_len=0 must be >= 1"),
            ({"objective.eval_tgt_len": 0}, "eval_tgt_len=0"),
            ({"examples.tgt_len": 0}, "examples.tgt_len=0 must be >= 1"),
            ({"examples.num_streams": 0}, "examples.num_streams=0 must be >= 1")):
        with pytest.raises(UserError, match=message):
            make_config("transformer_xl_tiny", overrides)
    with pytest.raises(UserError, match="fewer than 2 per stream for objective.eval_batch_size=4"):
        txl.long_text_nll(None, np.arange(7), txl.TransformerXLEvaluation(eval_batch_size=4),
                          memory=True)
