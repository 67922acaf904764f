"""XLNet: parity with HF `XLNetLMHeadModel` (two streams, segments, padding, memory over two
segments, bi_data, clamp_len, uni attention) and the HF round trip."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity_utils import assert_same_params, perturbed, random_params

from pretext_jax.models.xlnet import XLNet, XLNetConfig
from pretext_jax.pretrain import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("deterministic_torch")

# HF XLNetConfig fields.
CONFIGS = {
    "base-like": dict(vocab_size=61, d_model=32, n_layer=2, n_head=4, d_inner=48, mem_len=7,
                      reuse_len=5, ff_activation="gelu"),
    "bi_data+clamp": dict(vocab_size=50, d_model=24, n_layer=3, n_head=2, d_inner=40,
                          mem_len=6, reuse_len=0, bi_data=True, clamp_len=4,
                          ff_activation="relu", layer_norm_eps=1e-6),
    "uni+same_length": dict(vocab_size=40, d_model=16, n_layer=1, n_head=2, d_inner=16,
                            mem_len=5, attn_type="uni", same_length=True,
                            ff_activation="gelu_new"),
}
BATCH, SEQ, PREDICT = 4, 9, 3


def hf_xlnet(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return perturbed(transformers.XLNetLMHeadModel(transformers.XLNetConfig(**CONFIGS[name])),
                     seed)


def inputs(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Ids, 3 token types, padding in one row, a random perm_mask and one-hot targets."""
    rng = np.random.default_rng(seed)
    target_mapping = np.zeros((BATCH, PREDICT, SEQ), np.float32)
    for row in range(BATCH):
        target_mapping[row, np.arange(PREDICT), rng.choice(SEQ, PREDICT, replace=False)] = 1
    attention_mask = np.ones((BATCH, SEQ), np.int64)
    attention_mask[1, 7:] = 0
    return {"input_ids": rng.integers(0, vocab_size, (BATCH, SEQ)),
            "token_type_ids": rng.integers(0, 3, (BATCH, SEQ)),
            "attention_mask": attention_mask,
            "perm_mask": (rng.random((BATCH, SEQ, SEQ)) < 0.4).astype(np.float32),
            "target_mapping": target_mapping}


def hf_run(model, batch: dict[str, np.ndarray], mems=None):
    with torch.no_grad():
        out = model(**{k: torch.tensor(v) for k, v in batch.items()}, mems=mems, use_mems=True)
    return out, np.stack([m.numpy().transpose(1, 0, 2) for m in out.mems])


def our_run(model: XLNet, batch: dict[str, np.ndarray], mems=None):
    args = {k: jnp.asarray(v) for k, v in batch.items() if k != "input_ids"}
    return model(jnp.asarray(batch["input_ids"]), **args, mems=mems, use_mems=True)


# Which inputs each case passes: plain, segments only, padding + perm_mask (content stream
# with the permutation), everything (two streams with target_mapping).
CASES = {"plain": (), "segments": ("token_type_ids",),
         "perm_mask": ("token_type_ids", "attention_mask", "perm_mask"),
         "two_stream": ("token_type_ids", "attention_mask", "perm_mask", "target_mapping")}


# HF's `uni` path cannot add a padding/perm mask to its causal mask (an in-place broadcast in
# XLNetModel.forward fails), so `uni` is compared without them.
PAIRS = [(name, case) for name in CONFIGS for case in CASES
         if CONFIGS[name].get("attn_type") != "uni" or case in ("plain", "segments")]


@pytest.mark.parametrize(("name", "case"), PAIRS)
def test_parity_with_hf_over_two_segments(name, case, tmp_path):
    reference = hf_xlnet(name)
    reference.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = hf.load(tmp_path)
    assert isinstance(model, XLNet)
    vocab_size = CONFIGS[name]["vocab_size"]
    first, second = inputs(vocab_size, 0), inputs(vocab_size, 1)
    keys = ("input_ids", *CASES[case])
    first = {k: first[k] for k in keys}
    second = {k: second[k] for k in keys}
    theirs, their_mems = hf_run(reference, first)
    ours = our_run(model, first)
    np.testing.assert_allclose(ours.lm_logits, theirs.logits.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours.new_mems, their_mems, atol=1e-5, rtol=0)
    # The second segment attends to the first one's memory.
    theirs, their_mems = hf_run(reference, second, mems=theirs.mems)
    ours = our_run(model, second, mems=ours.new_mems)
    np.testing.assert_allclose(ours.lm_logits, theirs.logits.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours.new_mems, their_mems, atol=1e-5, rtol=0)
    assert ours.new_mems.shape[2] == CONFIGS[name]["mem_len"]


@pytest.mark.parametrize("name", ["base-like", "bi_data+clamp"])
def test_query_stream_at_target_positions_equals_hf_target_mapping(name, tmp_path):
    """`target_positions` attends from the P target rows only; the logits and memory over two
    segments equal HF's with the full one-hot `target_mapping`."""
    reference = hf_xlnet(name)
    reference.save_pretrained(tmp_path)
    model = hf.load(tmp_path)
    vocab_size = CONFIGS[name]["vocab_size"]
    their_mems = ours = None
    for seed in (0, 1):
        batch = inputs(vocab_size, seed)
        theirs, their_mem_array = hf_run(reference, batch, mems=their_mems)
        positions = {**batch, "target_positions": batch["target_mapping"].argmax(-1)}
        del positions["target_mapping"]
        ours = our_run(model, positions, mems=None if ours is None else ours.new_mems)
        np.testing.assert_allclose(ours.lm_logits, theirs.logits.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(ours.new_mems, their_mem_array, atol=1e-5, rtol=0)
        their_mems = theirs.mems


def test_loop_and_remat_compute_the_same(tmp_path):
    hf_xlnet("base-like").save_pretrained(tmp_path)
    batch = inputs(61, 2)
    scanned = our_run(hf.load(tmp_path), batch)
    looped = our_run(hf.load(tmp_path, scan_layers=False, remat="full"), batch)
    np.testing.assert_allclose(looped.lm_logits, scanned.lm_logits, atol=1e-6, rtol=0)
    np.testing.assert_allclose(looped.new_mems, scanned.new_mems, atol=1e-6, rtol=0)


@pytest.mark.parametrize("untie_r", [True, False])
def test_round_trip_through_transformers(untie_r, tmp_path):
    config = XLNetConfig(vocab_size=45, hidden_size=24, num_layers=2, num_heads=3,
                         intermediate_size=30, mem_len=4, reuse_len=2, untie_r=untie_r,
                         hidden_dropout=0.0, attention_dropout=0.0)
    ours = random_params(nnx.eval_shape(lambda: XLNet(config, rngs=nnx.Rngs(0))), 3)
    hf.save(ours, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["XLNetLMHeadModel"] and saved["untie_r"] is untie_r
    reloaded, info = transformers.XLNetLMHeadModel.from_pretrained(tmp_path,
                                                                   output_loading_info=True)
    assert not any(info.values()), info
    batch = inputs(45, 4)
    theirs, their_mems = hf_run(reloaded.eval(), batch)
    mine = our_run(ours, batch)
    np.testing.assert_allclose(mine.lm_logits, theirs.logits.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(mine.new_mems, their_mems, atol=1e-5, rtol=0)
    back = hf.load(tmp_path, untie_r=untie_r)
    assert back.config == ours.config
    assert_same_params(back, ours)
